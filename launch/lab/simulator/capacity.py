"""Capacity at an SLO, cost per million tokens, and the prefill:decode split sweep, simulated.

Contract:
* ``summarize(result, slo) -> dict``: p50 / p90 / p99 of TTFT and TPOT over the ok requests
  (nearest rank, ``launch.lab.loadgen_lib.report.percentile``), the SLO verdict at p99 over all
  requests with a rejected one infinitely late (``meets_slo_p99``, as the load generator),
  throughput, goodput, output tokens/s over the simulated span, utilisation per pool.
* ``find_capacity(requests_at, deployment, slo, search)``: the highest rate (requests/s) whose
  run ``meets_slo_p99``, by the load generator's own search (``launch.lab.loadgen_lib.capacity.
  find_capacity``: doubling from ``search.start_rate``, then bisections). ``requests_at(rate)``
  builds the trace at a rate. ``saturation_rate`` (every request at t = 0: requests / span) is
  the start of the default search (``default_search``): the cluster's throughput ceiling.
* ``cost_per_million(rate, tokens_per_request, chips, chip_hour_usd)``: dollars per million
  tokens served at ``rate``.
* ``sweep_split(requests_at, instances, build, slo, splits)``: capacity of each disaggregated
  deployment ``build(prefill_instances, decode_instances)`` with ``p + d = instances``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from launch.lab.loadgen_lib import capacity as loadgen_capacity
from launch.lab.loadgen_lib.report import percentile
from launch.lab.loadgen_lib.slo import Slo
from launch.lab.simulator.cluster import SimDeployment, SimRequest, SimResult, simulate

RequestsAt = Callable[[float], Sequence[SimRequest]]


def _stats(xs: list[float]) -> dict[str, float | None]:
  return {q: percentile(xs, v) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}


def summarize(result: SimResult, slo: Slo) -> dict:
  recs = result.records
  ok = [r for r in recs if r.status == "ok"]
  ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
  tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
  inf = math.inf
  ttft_all = [r.ttft_s if r.ttft_s is not None else inf for r in recs]
  tpot_all = [inf if r.status != "ok" else (r.tpot_s or 0.0) for r in recs]
  p99_ttft, p99_tpot = percentile(ttft_all, 0.99), percentile(tpot_all, 0.99)
  good = sum(slo.met(r.ttft_s, r.tpot_s) for r in ok)
  span = result.span_s
  starts = sorted(r.arrival_s for r in recs)
  offered = ((len(starts) - 1) / (starts[-1] - starts[0])
             if len(starts) > 1 and starts[-1] > starts[0] else None)
  return {
      "requests": len(recs), "ok": len(ok), "rejected": len(recs) - len(ok),
      "offered_rps": offered, "ttft_s": _stats(ttft), "tpot_s": _stats(tpot),
      "p99_ttft_all_s": p99_ttft, "p99_tpot_all_s": p99_tpot,
      "meets_slo_p99": bool(p99_ttft is not None and p99_ttft <= slo.ttft_s
                            and p99_tpot is not None and p99_tpot <= slo.tpot_s),
      "throughput_rps": len(ok) / span, "goodput_rps": good / span,
      "output_tokens_per_s": sum(r.output_len for r in ok) / span,
      "span_s": span, "utilisation": result.pool_utilisation(),
      "mean_decode_rows": _mean_by_role(result, "mean_decode_rows"),
  }


def _mean_by_role(result: SimResult, field: str) -> dict[str, float]:
  out: dict[str, list[float]] = {}
  for s in result.instances:
    out.setdefault(s.role, []).append(getattr(s, field))
  return {k: sum(v) / len(v) for k, v in out.items()}


class _Memory:
  """The load generator's rate store, in memory: nothing is resumed across simulator runs."""

  def get(self, rate: float) -> dict | None:
    return None


def saturation_rate(requests: Sequence[SimRequest], deployment: SimDeployment) -> float:
  """Requests per second when every request arrives at once (the throughput ceiling)."""
  burst = [dataclasses.replace(r, arrival_s=0.0) for r in requests]
  result = simulate(burst, deployment)
  ok = sum(r.status == "ok" for r in result.records)
  return ok / result.span_s


def default_search(ceiling_rps: float, steps: int = 6) -> loadgen_capacity.Search:
  return loadgen_capacity.Search(start_rate=loadgen_capacity.round_rate(ceiling_rps / 4),
                                 max_rate=loadgen_capacity.round_rate(ceiling_rps * 4),
                                 steps=steps)


def find_capacity(requests_at: RequestsAt, deployment: SimDeployment, slo: Slo,
                  search: loadgen_capacity.Search | None = None) -> dict:
  """``{"best_rate_per_s", "rows": {rate: summary}, "ceiling_rps"}``; see the contract."""
  ceiling = None
  if search is None:
    ceiling = saturation_rate(requests_at(1.0), deployment)
    search = default_search(ceiling)

  def measure(rate: float) -> dict:
    return summarize(simulate(requests_at(rate), deployment, slo), slo)

  out = loadgen_capacity.find_capacity(search, _Memory(), measure)  # type: ignore[arg-type]
  return {"best_rate_per_s": out["best_rate_per_s"], "rows": out["rows"],
          "ceiling_rps": ceiling}


def cost_per_million(rate: float | None, tokens_per_request: float, chips: int,
                     chip_hour_usd: float) -> float | None:
  if not rate or tokens_per_request <= 0:
    return None
  return chips * chip_hour_usd / 3600.0 / (rate * tokens_per_request) * 1e6


def default_splits(instances: int, most: int = 7) -> tuple[int, ...]:
  """Prefill instance counts to try: up to ``most`` spread over [1, instances - 1]."""
  if instances < 2:
    return ()
  k = min(most, instances - 1)
  return tuple(sorted({max(1, min(instances - 1, round(instances * (i + 1) / (k + 1))))
                       for i in range(k)}))


def sweep_split(requests_at: RequestsAt, instances: int,
                build: Callable[[int, int], SimDeployment], slo: Slo,
                splits: Sequence[int] | None = None,
                progress: Callable[[], None] | None = None) -> list[dict]:
  """One row per prefill instance count: ``{"prefill", "decode", "best_rate_per_s", ...}``."""
  rows = []
  for p in (splits if splits is not None else default_splits(instances)):
    if not 1 <= p < instances:
      raise ValueError(f"split {p}: needs 1 <= prefill < {instances}")
    dep = build(p, instances - p)
    cap = find_capacity(requests_at, dep, slo)
    best = cap["best_rate_per_s"]
    at = cap["rows"].get(best) if best is not None else None
    rows.append({"prefill": p, "decode": instances - p, "best_rate_per_s": best,
                 "ceiling_rps": cap["ceiling_rps"],
                 "utilisation": at["utilisation"] if at else None})
    if progress is not None:
      progress()
  return rows
