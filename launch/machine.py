"""What machine a benchmark ran on, for every figure the launch scripts print.

Contract: ``cpu_model()`` is this CPU's model name (``models.cpu.cpuinfo``);
``describe()`` adds the JAX platform, device kind and count, CPU count and the 1-minute load.
"""

from __future__ import annotations

import os


def cpu_model() -> str:
  from models.cpu import cpuinfo
  return cpuinfo.model_name()


def describe() -> dict[str, object]:
  import jax
  dev = jax.devices()[0]
  info: dict[str, object] = {"platform": dev.platform, "device_kind": dev.device_kind,
                             "cpu": cpu_model(), "cpu_count": os.cpu_count(),
                             "devices": jax.device_count(), "jax_version": jax.__version__}
  if hasattr(os, "getloadavg"):
    info["load_avg_1m"] = round(os.getloadavg()[0], 2)
  return info
