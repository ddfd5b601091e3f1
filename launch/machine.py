"""What machine a benchmark ran on, for every figure the launch scripts print.

Contract: ``cpu_model()`` is ``/proc/cpuinfo``'s model name (else ``platform``'s guess);
``describe()`` adds the JAX platform, device kind and count, CPU count and the 1-minute load.
"""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def describe() -> dict[str, object]:
  import jax
  dev = jax.devices()[0]
  info: dict[str, object] = {"platform": dev.platform, "device_kind": dev.device_kind,
                             "cpu": cpu_model(), "cpu_count": os.cpu_count(),
                             "devices": jax.device_count(), "jax_version": jax.__version__}
  if hasattr(os, "getloadavg"):
    info["load_avg_1m"] = round(os.getloadavg()[0], 2)
  return info
