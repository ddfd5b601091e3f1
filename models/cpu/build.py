"""Compiling, caching and loading the native XLA:CPU kernels (``models.cpu.kernels``,
``models.cpu.paged_attention``).

Contract:
  * ``source(name) -> str``: ``models/cpu/native/<name>.cc`` (package data) with each
    ``#include "<file>.h"`` inlined from ``models/cpu/native/``, so the hashed text is all that
    is compiled.
  * ``build(name, source, flags) -> path``: compiles ``source`` (``c++`` / ``g++``, ``-O3
    -std=c++17 -shared -fPIC`` plus ``flags``, against ``jax.ffi.include_dir()``) into
    ``<models.cpu.env.cache_dir()>/<name>_<key>.so``; ``key`` hashes the source, jax version,
    include dir and flags. Concurrent builders race benignly (atomic rename). Raises
    ``RuntimeError`` when no compiler is found or the compile fails.
  * ``load(name, flags, need, targets, init=None) -> CDLL | None`` (the one loader, once per
    process and name): when the default backend is CPU and the CPU lists every flag in
    ``need``, builds ``name``, loads it, calls ``init`` (a C function returning 0 on success)
    if given, and registers each ``(target, symbol)`` as an XLA:CPU FFI target. Any failure is
    ``None``, logged once (``optional``: at INFO, else WARNING).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.resources
import logging
import os
import re
import shutil
import subprocess
import tempfile

import jax

from models.cpu import cpuinfo, env

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
  cache = env.cache_dir()
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


@functools.cache
def load(name: str, flags: tuple[str, ...], need: frozenset[str],
         targets: tuple[tuple[str, str], ...], init: str | None = None,
         optional: bool = False) -> ctypes.CDLL | None:
  if jax.default_backend() != "cpu":
    return None
  try:
    missing = need - cpuinfo.flags()
    if missing:
      raise RuntimeError(f"CPU lacks {sorted(missing)}")
    lib = ctypes.cdll.LoadLibrary(build(name, source(name), list(flags)))
    if init is not None and lib[init]() != 0:
      raise RuntimeError(f"{init} failed (e.g. the OS refused the AMX tile state)")
    for target, symbol in targets:
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib[symbol]),
                                  platform="cpu")
    return lib
  except Exception as e:  # noqa: BLE001 - any failure means "use XLA's own ops"
    logging.getLogger(__name__).log(logging.INFO if optional else logging.WARNING,
                                    "native %s unavailable: %s", name, e)
    return None


__all__ = ["source", "build", "load"]
