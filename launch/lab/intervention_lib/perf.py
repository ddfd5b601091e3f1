"""One segment's A-vs-B performance comparison over every rate and repeat it ran.

Contract: ``compare_segment(runs_a, runs_b, rng, n_boot, min_effect, cores)`` takes each config's
``SegmentRun``s (``load.run_segment``), keyed by ``(repeat, rate)`` and identical in keys between
the configs. At the segment's highest rate (the one nearest capacity) it compares, over the requests
ok in both configs (records pooled over repeats, paired by request, the repeat as the bootstrap's
group): TTFT and TPOT p50 / p90 / p99 (lower is better), and output tokens per second per core
(higher is better; per run, its interval over the repeats). Failures: B failing more requests
(refused or errored) than A is a ``worse`` change. Capacity at SLO: per config, the highest rate
whose every repeat met the SLO at p99 (None if none did; ``capacity_at_least`` when that is
the top rung); a higher capacity is ``better`` (the ladder's step is its resolution: no
interval). Returns a JSON-ready dict: ``verdict``, ``changes``,
and per config ``{capacity_per_s, ttft/tpot p50 / p99, failed, refused, errors,
tokens_per_s_per_core, phases_s}``.
"""

from __future__ import annotations

import numpy as np

from launch.lab.intervention_lib import stats
from launch.lab.intervention_lib.load import SegmentRun
from launch.lab.loadgen_lib import report

Runs = dict[tuple[int, float], SegmentRun]


def capacity(runs: Runs) -> float | None:
  rates = sorted({rate for _, rate in runs})
  ok = [r for r in rates if all(run.summary["meets_slo_p99"]
                                for (_, rate), run in runs.items() if rate == r)]
  return max(ok) if ok else None


def _side(runs: list[SegmentRun], cores: int) -> dict:
  recs = [r for run in runs for r in run.records.values()]
  ok = [r for r in recs if r.status == "ok"]
  wall = sum(run.summary["wall_s"] for run in runs)

  def q(metric: str, p: float):
    return report.percentile([getattr(r, metric) for r in ok if getattr(r, metric) is not None],
                             p)

  phases = {k: report.percentile([v for run in runs if (v := run.phases_s[k]) is not None], 0.5)
            for k in runs[0].phases_s}
  return {"requests": len(recs), "ok": len(ok),
          "refused": sum(run.summary["rejected"] for run in runs),
          "errors": sum(run.summary["errors"] for run in runs),
          "failed": len(recs) - len(ok),
          "ttft_p50_s": q("ttft_s", 0.5), "ttft_p99_s": q("ttft_s", 0.99),
          "tpot_p50_s": q("tpot_s", 0.5), "tpot_p99_s": q("tpot_s", 0.99),
          "tokens_per_s_per_core": sum(r.output_tokens for r in ok) / wall / cores,
          "phases_s": phases}


def _tps(run: SegmentRun, cores: int) -> float:
  return run.summary["output_tokens_per_s"] / cores


def compare_segment(runs_a: Runs, runs_b: Runs, rng: np.random.Generator, n_boot: int,
                    min_effect: float, cores: int) -> dict:
  if set(runs_a) != set(runs_b):
    raise ValueError("A and B ran different (repeat, rate) sets")
  top = max(rate for _, rate in runs_a)
  keys = sorted(k for k in runs_a if k[1] == top)
  side_a = _side([runs_a[k] for k in keys], cores)
  side_b = _side([runs_b[k] for k in keys], cores)
  pairs = [(k[0], ra, runs_b[k].records.get(key)) for k in keys
           for key, ra in runs_a[k].records.items()]
  both = [(rep, ra, rb) for rep, ra, rb in pairs
          if rb is not None and ra.status == rb.status == "ok"]
  changes: list[stats.Change] = []
  for metric, field, p in (("ttft_p50", "ttft_s", 0.5), ("ttft_p90", "ttft_s", 0.9),
                           ("ttft_p99", "ttft_s", 0.99), ("tpot_p50", "tpot_s", 0.5),
                           ("tpot_p90", "tpot_s", 0.9), ("tpot_p99", "tpot_s", 0.99)):
    xy = [(rep, getattr(ra, field), getattr(rb, field)) for rep, ra, rb in both
          if getattr(ra, field) is not None and getattr(rb, field) is not None]
    if xy:
      changes.append(stats.paired_change(
          metric, np.array([x for _, x, _ in xy]), np.array([y for _, _, y in xy]),
          np.array([g for g, _, _ in xy]), stats.quantile(p), rng, n_boot=n_boot,
          min_effect=min_effect, need=stats.min_samples(p)))
  changes.append(stats.run_change(
      "tokens_per_s_per_core", np.array([_tps(runs_a[k], cores) for k in keys]),
      np.array([_tps(runs_b[k], cores) for k in keys]), rng, n_boot=n_boot,
      min_effect=min_effect))
  fa, fb = side_a["failed"], side_b["failed"]
  if fb != fa:
    rel = (fb - fa) / fa if fa else float("inf")
    changes.append(stats.Change("failed_requests", fa, fb, rel, rel, rel, True,
                                "worse" if fb > fa else "better"))
  cap_a, cap_b = capacity(runs_a), capacity(runs_b)
  side_a["capacity_per_s"], side_b["capacity_per_s"] = cap_a, cap_b
  # the ladder's top rung passed: capacity is at least that
  side_a["capacity_at_least"], side_b["capacity_at_least"] = cap_a == top, cap_b == top
  if cap_a != cap_b:
    ca, cb = cap_a or 0.0, cap_b or 0.0
    rel = (cb - ca) / ca if ca else float("inf")
    changes.append(stats.Change("capacity_per_s", ca, cb, rel, rel, rel, False,
                                "better" if cb > ca else "worse"))
  return {"rate_per_s": top, "paired_requests": len(both), "verdict": stats.verdict(changes),
          "changes": [c.to_json() for c in changes], "a": side_a, "b": side_b}
