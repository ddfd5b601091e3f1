"""Open-loop arrival times: Poisson, Gamma-renewal (bursty) and on/off (a 2-state MMPP).

Contract: ``arrival_times_s(cfg, count, duration_s, rng)`` returns increasing offsets in seconds
from the run's start: the first ``count`` arrivals (``count`` 0: no bound), none past
``duration_s`` (0: no bound; one of the two must bound it). The mean rate is ``rate_per_s`` for
every process:

* ``poisson``: exponential gaps, mean ``1 / rate``.
* ``gamma``: Gamma gaps with coefficient of variation ``burstiness`` (shape ``1 / b^2``, scale
  ``b^2 / rate``): 1 is Poisson, above 1 burstier (clumps and long gaps), below 1 more regular.
* ``onoff``: exponential ON periods (mean ``on_s``) and OFF periods (mean ``off_s``); Poisson
  arrivals at ``rate * (on_s + off_s) / on_s`` while ON, none while OFF; starts ON.

The same ``rng`` seed gives the same times; Poisson and Gamma times scale exactly as 1 / rate.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PROCESSES = ("poisson", "gamma", "onoff")


@dataclasses.dataclass(frozen=True)
class Arrivals:
  process: str = "poisson"
  rate_per_s: float = 1.0
  burstiness: float = 1.0
  on_s: float = 1.0
  off_s: float = 1.0

  def __post_init__(self):
    if self.process not in PROCESSES:
      raise ValueError(f"arrival process {self.process!r} is not one of {PROCESSES}")
    if not self.rate_per_s > 0:
      raise ValueError(f"rate must be > 0, got {self.rate_per_s}")
    if not (self.burstiness > 0 and self.on_s > 0 and self.off_s >= 0):
      raise ValueError("burstiness and on_s must be > 0, off_s >= 0")


def _gaps(cfg: Arrivals, n: int, rng: np.random.Generator) -> np.ndarray:
  if cfg.process == "poisson":
    return rng.exponential(1.0, n) / cfg.rate_per_s
  b2 = cfg.burstiness ** 2
  return rng.gamma(1.0 / b2, b2, n) / cfg.rate_per_s


def _onoff(cfg: Arrivals, count: int, duration_s: float,
           rng: np.random.Generator) -> list[float]:
  rate_on = cfg.rate_per_s * (cfg.on_s + cfg.off_s) / cfg.on_s
  out: list[float] = []
  t, on, end = 0.0, True, rng.exponential(cfg.on_s)
  while (not count or len(out) < count) and (not duration_s or t <= duration_s):
    if on:
      gap = rng.exponential(1.0 / rate_on)
      if t + gap < end:
        t += gap
        out.append(t)
        continue
      t, on, end = end, False, end + rng.exponential(cfg.off_s) if cfg.off_s else end
    else:
      t, on, end = end, True, end + rng.exponential(cfg.on_s)
  return out


def arrival_times_s(cfg: Arrivals, count: int, duration_s: float,
                    rng: np.random.Generator) -> np.ndarray:
  if count <= 0 and duration_s <= 0:
    raise ValueError("bound the run: a request count or a duration")
  if cfg.process == "onoff":
    times = np.asarray(_onoff(cfg, count, duration_s, rng))
  elif count > 0:
    times = np.cumsum(_gaps(cfg, count, rng))
  else:
    chunks, t = [], 0.0
    while t <= duration_s:
      c = t + np.cumsum(_gaps(cfg, 256, rng))
      chunks.append(c)
      t = float(c[-1])
    times = np.concatenate(chunks)
  if duration_s > 0:
    times = times[times <= duration_s]
  return times[:count] if count > 0 else times
