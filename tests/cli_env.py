"""The XLA flags of the CLIs and servers the tests start (``XLA_FLAGS=CLI_XLA_FLAGS`` in their
environment): their own, not the suite's 8 fake devices, with LLVM at optimization level 0 as
the suite's own programs (conftest.py). XLA's HLO passes, hence the numerics, are the product's;
the tiny models' many programs are compile-bound (tests/launch/test_serve_offline.py: 51 -> 31 s
on the Xeon, measured)."""

CLI_XLA_FLAGS = "--xla_backend_optimization_level=0"


def run_module(module: str, *args: str, timeout: float = 60, env: dict | None = None):
  """``python -m module args`` from the repository root, on CPU with ``CLI_XLA_FLAGS`` (and
  ``env`` over the inherited environment): the completed process (text output captured)."""
  import os
  import subprocess
  import sys

  from tests import paths
  full = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS, **(env or {}))
  return subprocess.run([sys.executable, "-m", module, *args], cwd=str(paths.REPO), env=full,
                        capture_output=True, text=True, timeout=timeout)
