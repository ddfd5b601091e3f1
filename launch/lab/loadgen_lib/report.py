"""Statistics of one run and its files: ``requests.csv``, ``summary.json``, ``latency.png``.

Contract: ``summarize(result, slo)`` returns a JSON-ready dict: counts (sent, ok, rejected =
RESOURCE_EXHAUSTED / HTTP 429, errors = any other failure, each by status), p50 / p90 / p99 and
mean of TTFT, TPOT, e2e (client clock) and of the server's queue, prefill, TTFT, TPOT (where the
API gives them) over the ok requests; throughput (ok requests/s, output tokens/s over the wall
time), goodput (ok requests meeting both SLO targets, per second of wall time), and the SLO
verdict at p99 over *all* sent requests and the turns never sent (a session stops at its first
failed turn), a failed or unsent one counting as infinitely late (``meets_slo_p99``). Percentiles are nearest-rank (the smallest value with at least q of the
values at or below it). ``offered_sessions_per_s`` is the schedule's own arrival rate (sessions
- 1 over the first to last arrival: a short run's sample differs from the nominal rate).
``write_run(out_dir, result, summary)`` writes the three files, each
atomically (a temp file renamed), so a crash leaves no half-written file.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
import math
import os

from launch.lab.loadgen_lib.drivers import REJECTED
from launch.lab.loadgen_lib.runner import COLUMNS, RunResult
from launch.lab.loadgen_lib.slo import Slo

QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
METRICS = ("ttft_s", "tpot_s", "e2e_s", "queue_s", "prefill_s", "server_ttft_s",
           "server_tpot_s")


def percentile(xs: list[float], q: float) -> float | None:
  if not xs:
    return None
  xs = sorted(xs)
  return xs[max(0, math.ceil(q * len(xs)) - 1)]


def _stats(xs: list[float]) -> dict[str, float | None]:
  out = {name: percentile(xs, q) for name, q in QUANTILES}
  out["mean"] = sum(xs) / len(xs) if xs else None
  return out


def summarize(result: RunResult, slo: Slo) -> dict:
  recs = result.records
  ok = [r for r in recs if r.status == "ok"]
  failed = collections.Counter(r.status for r in recs if r.status != "ok")
  inf = math.inf
  # Turns a session never sent (its earlier turn failed) are failures too: infinitely late.
  lost = [inf] * result.turns_not_sent
  ttft_all = [r.ttft_s if r.ttft_s is not None else inf for r in recs] + lost
  tpot_all = [inf if r.status != "ok" else (r.tpot_s or 0.0) for r in recs] + lost
  p99_ttft, p99_tpot = percentile(ttft_all, 0.99), percentile(tpot_all, 0.99)
  good = sum(r.meets_slo for r in recs)
  wall = result.wall_s
  out_tokens = sum(r.output_tokens for r in ok)
  starts = sorted(r.scheduled_s for r in recs if r.turn == 0)
  offered = (len(starts) - 1) / (starts[-1] - starts[0]) if len(starts) > 1 and \
      starts[-1] > starts[0] else None
  return {
      "sent": len(recs), "ok": len(ok), "turns_not_sent": result.turns_not_sent,
      "rejected": sum(n for s, n in failed.items() if s in REJECTED),
      "errors": sum(n for s, n in failed.items() if s not in REJECTED),
      "rejected_by_status": {s: n for s, n in sorted(failed.items()) if s in REJECTED},
      "errors_by_status": {s: n for s, n in sorted(failed.items()) if s not in REJECTED},
      "wall_s": wall, "max_send_lag_s": result.max_send_lag_s, "offered_sessions_per_s": offered,
      "throughput_rps": len(ok) / wall, "output_tokens_per_s": out_tokens / wall,
      "output_tokens": out_tokens, "good": good, "goodput_rps": good / wall,
      "slo": dataclasses.asdict(slo),
      "p99_ttft_all_s": None if p99_ttft in (None, inf) else p99_ttft,
      "p99_tpot_all_s": None if p99_tpot in (None, inf) else p99_tpot,
      "meets_slo_p99": bool(recs) and p99_ttft is not None and p99_ttft <= slo.ttft_s
      and p99_tpot <= slo.tpot_s,
      **{m: _stats([getattr(r, m) for r in ok if getattr(r, m) is not None]) for m in METRICS},
  }


def _atomic(path: str, write) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", newline="", encoding="utf-8") as f:
    write(f)
  os.replace(tmp, path)


def write_json(path: str, obj: dict) -> None:
  _atomic(path, lambda f: json.dump(obj, f, indent=2, sort_keys=True))


def write_csv(path: str, columns: tuple[str, ...], rows: list[dict]) -> None:
  def w(f):
    out = csv.DictWriter(f, fieldnames=columns)
    out.writeheader()
    for row in rows:
      out.writerow({k: "" if row.get(k) is None else row[k] for k in columns})
  _atomic(path, w)


def _plot(path: str, result: RunResult, slo: Slo) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ok = [r for r in result.records if r.status == "ok"]
  fig, axes = plt.subplots(1, 3, figsize=(14, 4))
  for ax, metric, target in ((axes[0], "ttft_s", slo.ttft_s), (axes[1], "tpot_s", slo.tpot_s)):
    xs = sorted(getattr(r, metric) * 1e3 for r in ok if getattr(r, metric) is not None)
    if xs:
      ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post")
    ax.axvline(target * 1e3, color="r", ls="--", label=f"SLO {target * 1e3:g} ms")
    ax.set(xlabel=f"{metric[:-2].upper()} (ms)", ylabel="fraction of ok requests",
           title=f"{metric[:-2].upper()} CDF")
    ax.legend()
  ax = axes[2]
  ax.scatter([r.scheduled_s for r in ok], [r.e2e_s for r in ok], s=8, label="ok")
  bad = [r for r in result.records if r.status != "ok"]
  if bad:
    ax.scatter([r.scheduled_s for r in bad], [r.e2e_s for r in bad], s=12, c="r", marker="x",
               label="rejected / error")
  ax.set(xlabel="scheduled send (s from start)", ylabel="e2e (s)", title="requests over time")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path + ".tmp.png", dpi=80)
  plt.close(fig)
  os.replace(path + ".tmp.png", path)


def write_run(out_dir: str, result: RunResult, summary: dict, slo: Slo) -> None:
  os.makedirs(out_dir, exist_ok=True)
  rows = [dataclasses.asdict(r) for r in sorted(result.records,
                                                key=lambda r: (r.scheduled_s, r.turn))]
  write_csv(os.path.join(out_dir, "requests.csv"), COLUMNS, rows)
  _plot(os.path.join(out_dir, "latency.png"), result, slo)
  write_json(os.path.join(out_dir, "summary.json"), summary)  # last: it marks the run done
