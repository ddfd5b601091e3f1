"""The Python 3.11 reference environment (torch + transformers), shared by the reference tests.

Contract: ``ref_python()`` is ``$PHASESERVE_REF_PYTHON`` or ``<repo>/.venv-ref/bin/python`` and
FAILS the calling test (never skips) when it is missing: ``make test`` builds ``.venv-ref``.
``cached_artifacts(name, script, args, is_complete)`` runs ``script OUT_DIR *args`` under it once
and caches OUT_DIR as ``tests/_ref_artifacts/<name>`` until the script's sha256 (or ``key``)
changes; a file lock serializes concurrent pytest sessions sharing the tree.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Sequence

import pytest

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "tests" / "_ref_artifacts"
REF_PYTHON_ENV = "PHASESERVE_REF_PYTHON"


def ref_python() -> Path:
  override = os.environ.get(REF_PYTHON_ENV)
  py = Path(override) if override else REPO / ".venv-ref" / "bin" / "python"
  if not (py.is_file() and os.access(py, os.X_OK)):
    source = f"${REF_PYTHON_ENV}" if override else "the default location"
    pytest.fail(
        f"HF reference interpreter not found at {py} ({source}). These tests need a Python 3.11 "
        "env with torch (CPU), transformers, gguf, tokenizers, safetensors and numpy: `make test` "
        "builds <repo>/.venv-ref, or point $PHASESERVE_REF_PYTHON at such an interpreter.",
        pytrace=False)
  return py


def ref_env() -> dict[str, str]:
  """The environment for reference subprocesses: offline, CPU, none of our JAX settings, one
  OpenMP thread (beside the suite's other worker a second thread makes small torch programs
  1.7x slower: each op's barrier waits for a busy core)."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "XLA_FLAGS")}
  env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="",
             OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1")
  return env


def run_ref(script: Path, args: Sequence[str], timeout_s: float) -> str:
  """Runs ``script *args`` under the reference interpreter; returns stdout or fails the test."""
  py = ref_python()
  try:
    proc = subprocess.run([str(py), str(script), *args], env=ref_env(), capture_output=True,
                          text=True, timeout=timeout_s)
  except subprocess.TimeoutExpired:
    pytest.fail(f"{script.name} took over {timeout_s}s under {py}", pytrace=False)
  if proc.returncode != 0:
    pytest.fail(f"{script.name} failed under {py} (rc {proc.returncode}):\n"
                f"{(proc.stdout + proc.stderr)[-4000:]}", pytrace=False)
  return proc.stdout


def script_key(script: Path, *extra: str) -> str:
  h = hashlib.sha256(script.read_bytes())
  for e in extra:
    h.update(e.encode())
  return h.hexdigest()


def cached_artifacts(name: str, script: Path, args: Sequence[str],
                     is_complete: Callable[[Path], bool], *, key: str | None = None,
                     timeout_s: float = 300) -> Path:
  """``tests/_ref_artifacts/<name>``, made by ``script OUT_DIR *args`` when missing or stale.

  The directory is current when its ``.key`` file holds ``key`` (default: the script's sha256)
  and ``is_complete(dir)`` holds. The interpreter is required even when the cache is valid, so
  a tree without it never passes.
  """
  ref_python()
  key = key or script_key(script)
  out = ARTIFACTS / name
  ARTIFACTS.mkdir(parents=True, exist_ok=True)

  def current() -> bool:
    try:
      return (out / ".key").read_text() == key and is_complete(out)
    except OSError:
      return False

  with open(ARTIFACTS / f".{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not current():
      tmp = ARTIFACTS / f"{name}.tmp-{os.getpid()}"
      shutil.rmtree(tmp, ignore_errors=True)
      try:
        run_ref(script, [str(tmp), *args], timeout_s)
        (tmp / ".key").write_text(key)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
      finally:
        shutil.rmtree(tmp, ignore_errors=True)
      if not current():
        pytest.fail(f"{script.name} ran but left {out} incomplete", pytrace=False)
  return out


def read_json(path: Path) -> dict:
  return json.loads(path.read_text())
