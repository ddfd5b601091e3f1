"""The simulator's requests: the load generator's length profiles and arrivals, or a trace.

Contract:
* ``parse_mix("interactive")`` / ``parse_mix("long_context:0.6,interactive:0.4")``: profile
  names of ``launch.lab.loadgen_lib.workload.PROFILES`` with weights (normalised); multi-turn
  profiles are refused (a later turn's arrival depends on the previous answer; model the reuse
  with ``prefix_hit_rate`` instead).
* ``from_profiles(mix, rate, count, seed, ...)``: ``count`` requests; each draws its profile by
  weight, then its prompt and output lengths from that profile's ``LengthDist``s (``length_scale``
  as the load generator); arrivals from ``launch.lab.loadgen_lib.arrivals`` at ``rate``. Lengths and
  arrivals use separate streams of ``seed``, so the first ``count`` requests are the same at
  every rate and count, and Poisson / Gamma times scale exactly as 1 / rate (a capacity search
  compares like with like).
* ``from_trace(rows, rate=None)``: a ``load_trace`` file's rows; with ``rate`` the arrival
  times are rescaled to that mean rate (the trace's shape kept).
* Cached tokens: ``shared_prefix`` requests after the first find the common prefix cached
  (whole pages of ``page_size``); every request also finds ``prefix_hit_rate`` of the rest of
  its prompt cached (whole pages; at least one prompt token is always prefilled).
"""

from __future__ import annotations

import numpy as np

from launch.lab.loadgen_lib.arrivals import Arrivals, arrival_times_s
from launch.lab.loadgen_lib.workload import PROFILES, TraceRow
from launch.lab.simulator.cluster import SimRequest


def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
  out = []
  for part in text.split(","):
    name, _, w = part.strip().partition(":")
    if name not in PROFILES:
      raise ValueError(f"profile {name!r} is not one of {', '.join(PROFILES)}")
    if PROFILES[name].max_turns > 1:
      raise ValueError(f"profile {name!r} is multi-turn: not simulated (use prefix_hit_rate)")
    try:
      weight = float(w) if w else 1.0
    except ValueError:
      raise ValueError(f"profile weight {w!r} is not a number") from None
    if not weight > 0:
      raise ValueError(f"profile weight must be > 0, got {weight}")
    out.append((name, weight))
  total = sum(w for _, w in out)
  return tuple((n, w / total) for n, w in out)


def _cached(prompt: int, prefix: int, hit_rate: float, page_size: int) -> int:
  cached = prefix // page_size * page_size
  cached += int((prompt - cached) * hit_rate) // page_size * page_size
  return min(cached, prompt - 1)


def from_profiles(mix: tuple[tuple[str, float], ...], rate: float, count: int, seed: int = 0,
                  length_scale: float = 1.0, process: str = "poisson", burstiness: float = 1.0,
                  prefix_hit_rate: float = 0.0, page_size: int = 16) -> tuple[SimRequest, ...]:
  if not 0.0 <= prefix_hit_rate < 1.0:
    raise ValueError(f"prefix_hit_rate must be in [0, 1), got {prefix_hit_rate}")
  lengths = np.random.default_rng(seed)
  names = [n for n, _ in mix]
  cumulative = np.cumsum([w for _, w in mix])
  times = arrival_times_s(Arrivals(process, rate, burstiness), count, 0.0,
                          np.random.default_rng([seed, 1]))
  seen_prefix: set[str] = set()
  out = []
  for t in times:  # one draw after another per request: a longer run extends a shorter one
    k = min(int(np.searchsorted(cumulative, lengths.random(), side="right")), len(names) - 1)
    prof = PROFILES[names[k]]
    prefix = round(prof.shared_prefix_len * length_scale)
    prompt = prefix + prof.prompt.sample(lengths, length_scale)
    output = prof.output.sample(lengths, length_scale)
    cached_prefix = prefix if prof.name in seen_prefix else 0
    seen_prefix.add(prof.name)
    out.append(SimRequest(float(t), prompt, output,
                       _cached(prompt, cached_prefix, prefix_hit_rate, page_size)))
  return tuple(out)


def from_trace(rows: tuple[TraceRow, ...], rate: float | None = None,
               prefix_hit_rate: float = 0.0, page_size: int = 16) -> tuple[SimRequest, ...]:
  if not rows:
    raise ValueError("an empty trace")
  t0 = rows[0].arrival_s
  scale = 1.0
  if rate is not None:
    span = rows[-1].arrival_s - t0
    if len(rows) < 2 or span <= 0:
      raise ValueError("rescaling a trace's rate needs two or more distinct arrival times")
    scale = (len(rows) - 1) / span / rate
  return tuple(SimRequest((r.arrival_s - t0) * scale, r.prompt_len, r.output_len,
                       _cached(r.prompt_len, 0, prefix_hit_rate, page_size)) for r in rows)


def mean_tokens(requests: tuple[SimRequest, ...]) -> tuple[float, float]:
  """Mean prompt and output lengths."""
  n = max(1, len(requests))
  return (sum(r.prompt_len for r in requests) / n, sum(r.output_len for r in requests) / n)
