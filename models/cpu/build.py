"""Compiling and caching the native XLA:CPU kernels (``models.cpu.kernels``,
``models.cpu.paged_attention``).

Contract:
  * ``cpu_flags() -> frozenset[str]``: the ``flags`` line of ``/proc/cpuinfo`` (empty if
    unreadable), read once per process.
  * ``source(name) -> str``: the C++ source ``models/cpu/native/<name>.cc`` (package data), with
    each ``#include "<file>.h"`` line replaced by ``models/cpu/native/<file>.h`` (shared helpers), so
    the text hashed into a library's cache key is everything compiled.
  * ``build(name, source, flags) -> path``: compiles C++ ``source`` (with ``c++`` / ``g++``,
    ``-O3 -std=c++17 -shared -fPIC`` plus ``flags``, against ``jax.ffi.include_dir()``) into
    ``<cache dir>/<name>_<key>.so`` and returns its path; ``key`` hashes the source, the jax
    version, the include dir and the flags, so a changed kernel never loads a stale library. The
    cache dir is ``$PHASESERVE_CACHE_DIR`` (default ``~/.cache/phaseserve``). Concurrent builders
    race benignly (atomic rename). Raises ``RuntimeError`` when no compiler is found or the
    compile fails (the message ends with the compiler's stderr).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import os
import re
import shutil
import subprocess
import tempfile

import jax


@functools.cache
def cpu_flags() -> frozenset[str]:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          return frozenset(line.split(":", 1)[1].split())
  except OSError:
    pass
  return frozenset()


_INCLUDE = re.compile(r'^#include "(\w+\.h)"$', re.MULTILINE)


def source(name: str) -> str:
  native = importlib.resources.files("models.cpu").joinpath("native")
  return _INCLUDE.sub(lambda m: native.joinpath(m.group(1)).read_text(),
                      native.joinpath(f"{name}.cc").read_text())


def build(name: str, source: str, flags: list[str]) -> str:
  compiler = shutil.which("c++") or shutil.which("g++")
  if compiler is None:
    raise RuntimeError("no C++ compiler (c++ / g++) on PATH")
  include = jax.ffi.include_dir()
  flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-w", *flags]
  key = hashlib.sha256("\n".join([source, jax.__version__, include, *flags]).encode()
                       ).hexdigest()[:16]
  cache = os.environ.get("PHASESERVE_CACHE_DIR") or os.path.join(
      os.path.expanduser("~"), ".cache", "phaseserve")
  os.makedirs(cache, exist_ok=True)
  lib = os.path.join(cache, f"{name}_{key}.so")
  if os.path.exists(lib):
    return lib
  with tempfile.TemporaryDirectory(dir=cache) as tmp:
    src = os.path.join(tmp, f"{name}.cc")
    with open(src, "w") as f:
      f.write(source)
    out = os.path.join(tmp, "lib.so")
    proc = subprocess.run([compiler, *flags, f"-I{include}", src, "-o", out],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode:
      raise RuntimeError(f"compiling {name} failed: {proc.stderr[-2000:]}")
    os.replace(out, lib)
  return lib


__all__ = ["cpu_flags", "build"]
