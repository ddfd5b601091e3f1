"""The one place phaseserve's ``PHASESERVE_*`` environment switches are read.

Contract: called at start-up (``models.cpu.backend.resolve``, the calibration and cache
helpers), never at trace time; library code takes the values these return.
  * ``native_kernels()``: ``PHASESERVE_NATIVE_KERNELS`` is not ``0`` (may the native XLA:CPU
    kernels be loaded).
  * ``measure_lowering()``: ``PHASESERVE_CPU_AUTOTUNE`` is not ``0`` (may the CPU lowering be
    read from its cache or measured at start-up; else ``models.cpu.lowering.DEFAULT``).
  * ``paged_bf16_dot()``: ``PHASESERVE_PAGED_BF16_DOT`` is not ``0``.
  * ``amx()``: ``PHASESERVE_AMX`` is not ``0`` (may the process ask Linux for the AMX tile state
    and load the AMX kernels; ``0``: neither, so phaseserve itself never runs AMX).
  * ``pallas_attention()``: ``PHASESERVE_PALLAS_ATTENTION`` is not ``0`` (on a GPU backend, may
    decode attention run the Pallas kernel; ``0``: the gather path, the device check's A/B).
  * ``cache_dir()``: ``$PHASESERVE_CACHE_DIR``, default ``~/.cache/phaseserve`` (the one
    cache-directory helper: native libraries, lowering and layout measurements, JAX's cache).
  * ``calibration_dir()``: ``$PHASESERVE_CALIBRATION_DIR``, default
    ``~/.cache/phaseserve/calibration`` (not moved by ``PHASESERVE_CACHE_DIR``).
"""

from __future__ import annotations

import os


def _on(name: str) -> bool:
  return os.environ.get(name, "1") != "0"


def native_kernels() -> bool:
  return _on("PHASESERVE_NATIVE_KERNELS")


def measure_lowering() -> bool:
  return _on("PHASESERVE_CPU_AUTOTUNE")


def paged_bf16_dot() -> bool:
  return _on("PHASESERVE_PAGED_BF16_DOT")


def amx() -> bool:
  return _on("PHASESERVE_AMX")


def pallas_attention() -> bool:
  return _on("PHASESERVE_PALLAS_ATTENTION")


def cache_dir() -> str:
  return os.environ.get("PHASESERVE_CACHE_DIR") or os.path.join(
      os.path.expanduser("~"), ".cache", "phaseserve")


def calibration_dir() -> str:
  return os.environ.get("PHASESERVE_CALIBRATION_DIR") or os.path.join(
      os.path.expanduser("~"), ".cache", "phaseserve", "calibration")


__all__ = ["native_kernels", "measure_lowering", "paged_bf16_dot", "amx", "pallas_attention",
           "cache_dir", "calibration_dir"]
