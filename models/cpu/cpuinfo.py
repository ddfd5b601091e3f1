"""The one reader of ``/proc/cpuinfo``: what this CPU is, for kernels, caches and reports.

Contract: ``fields()`` is the first processor's ``model name``, ``cpu family``, ``model`` and
``flags`` (empty when unreadable), read once per process. ``flags()`` is the flag set,
``model_name()`` the model name (else ``platform``'s guess), ``key()`` a string naming the CPU
for caches keyed per machine: model name, family, model and its AVX-512 / AMX flags.
"""

from __future__ import annotations

import functools
import platform


@functools.cache
def fields() -> dict[str, str]:
  out: dict[str, str] = {}
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if ":" not in line:
          if out:
            break
          continue
        k, v = (s.strip() for s in line.split(":", 1))
        if k in ("model name", "cpu family", "model", "flags") and k not in out:
          out[k] = v
  except OSError:
    pass
  return out


def flags() -> frozenset[str]:
  return frozenset(fields().get("flags", "").split())


def model_name() -> str:
  return fields().get("model name") or platform.processor() or platform.machine()


def key() -> str:
  f = fields()
  wide = sorted(x for x in flags() if x.startswith(("avx512", "amx")))
  return (f"{f.get('model name', 'unknown')} (family {f.get('cpu family', '?')} "
          f"model {f.get('model', '?')}; {' '.join(wide)})")


__all__ = ["fields", "flags", "model_name", "key"]
