"""``--find_capacity``: the highest request rate whose run meets the SLO at p99, resumable.

Contract: ``find_capacity(search, store, measure)`` evaluates rates (requests/s): the explicit
``search.rates`` in order, or a search: ``start_rate``, doubled while it passes (up to
``max_rate``), then ``steps`` bisections between the best pass and the first fail (if the start
fails, halvings down to ``start_rate / 2^steps`` first find a pass; ``ValueError`` when
``start_rate > max_rate``). A rate is rounded to 4
significant digits. Each evaluation is ``store.get(rate)`` (a finished rate of an earlier run of
the same fingerprint: reused, not redone) or ``measure(rate)``, whose summary ``store.put``s
before the next rate starts. The search depends only on the summaries' ``meets_slo_p99``, so a
resumed run walks the same rates. A stored rate of another fingerprint raises ``ValueError``.
Returns ``{"best_rate_per_s", "rows", "measured", "reused"}``; ``write_capacity`` writes
``capacity.csv`` (one row per rate), ``capacity.json`` and ``capacity.png`` (TTFT / TPOT p50 /
p90 / p99 and goodput against rate, the SLO targets drawn).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

from launch.lab.loadgen_lib.report import write_csv, write_json

ROW_COLUMNS = ("rate_per_s", "offered_sessions_per_s", "source", "sent", "ok", "rejected",
               "errors", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s",
               "tpot_p99_s", "e2e_p50_s", "e2e_p99_s", "p99_ttft_all_s", "p99_tpot_all_s",
               "throughput_rps", "goodput_rps", "output_tokens_per_s", "max_send_lag_s",
               "meets_slo_p99")


@dataclasses.dataclass(frozen=True)
class Search:
  start_rate: float = 1.0
  max_rate: float = 64.0
  steps: int = 3
  rates: tuple[float, ...] = ()


def round_rate(rate: float) -> float:
  return float(f"{rate:.4g}")


class RateStore:
  """``<root>/rate_<r>/summary.json``, each holding the run's ``fingerprint``."""

  def __init__(self, root: str, fingerprint: str):
    self.root, self.fingerprint = root, fingerprint

  def dir(self, rate: float) -> str:
    return os.path.join(self.root, f"rate_{rate:g}")

  def get(self, rate: float) -> dict | None:
    path = os.path.join(self.dir(rate), "summary.json")
    if not os.path.exists(path):
      return None
    with open(path, encoding="utf-8") as f:
      summary = json.load(f)
    if summary.get("fingerprint") != self.fingerprint:
      raise ValueError(f"{path} is from a run of another configuration (fingerprint "
                       f"{summary.get('fingerprint')} != {self.fingerprint}): use another --out")
    return summary


def find_capacity(search: Search, store: RateStore,
                  measure: Callable[[float], dict]) -> dict:
  rows: dict[float, dict] = {}
  measured, reused = [], []

  def passes(rate: float) -> bool:
    rate = round_rate(rate)
    if rate not in rows:
      summary = store.get(rate)
      if summary is None:
        summary = measure(rate)
        measured.append(rate)
      else:
        reused.append(rate)
      rows[rate] = summary
    return bool(rows[rate]["meets_slo_p99"])

  if search.rates:
    for r in search.rates:
      passes(r)
  elif search.start_rate > search.max_rate:
    raise ValueError(f"start rate {search.start_rate:g} > max rate {search.max_rate:g}: the "
                     "search would measure (and could report) a rate past its bound")
  else:
    lo, hi, r = None, None, round_rate(search.start_rate)
    top = round_rate(search.max_rate)  # rounded as the rates are, or the doubling never ends
    while True:
      if passes(r):
        lo = r
        if r >= top:
          break
        r = round_rate(min(r * 2, top))
      else:
        hi = r
        break
    steps = search.steps
    while lo is None and steps > 0:
      r, steps = round_rate(r / 2), steps - 1
      if passes(r):
        lo = r
      else:
        hi = r
    for _ in range(steps):
      if lo is None or hi is None:
        break
      mid = round_rate((lo + hi) / 2)
      if mid in (lo, hi):
        break
      if passes(mid):
        lo = mid
      else:
        hi = mid
  best = max((r for r, s in rows.items() if s["meets_slo_p99"]), default=None)
  return {"best_rate_per_s": best, "rows": {r: rows[r] for r in sorted(rows)},
          "measured": measured, "reused": reused}


def _row(rate: float, s: dict, source: str) -> dict:
  row = {"rate_per_s": rate, "source": source}
  for k in ("offered_sessions_per_s", "sent", "ok", "rejected", "errors", "p99_ttft_all_s",
            "p99_tpot_all_s", "throughput_rps", "goodput_rps", "output_tokens_per_s",
            "max_send_lag_s", "meets_slo_p99"):
    row[k] = s.get(k)  # older summaries lack offered_sessions_per_s
  for m in ("ttft", "tpot", "e2e"):
    for q in ("p50", "p90", "p99"):
      if f"{m}_{q}_s" in ROW_COLUMNS:
        row[f"{m}_{q}_s"] = s[f"{m}_s"][q]
  return row


def _plot(path: str, rows: list[dict], slo: dict) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rates = [r["rate_per_s"] for r in rows]
  fig, axes = plt.subplots(1, 3, figsize=(14, 4))
  for ax, m in ((axes[0], "ttft"), (axes[1], "tpot")):
    for q in ("p50", "p90", "p99"):
      ys = [r[f"{m}_{q}_s"] for r in rows]
      ax.plot(rates, [None if y is None else y * 1e3 for y in ys], marker="o", label=q)
    ax.axhline(slo[f"{m}_s"] * 1e3, color="r", ls="--", label="SLO")
    ax.set(xlabel="request rate (1/s)", ylabel=f"{m.upper()} (ms)",
           title=f"{m.upper()} vs rate (ok requests)")
    ax.legend()
  axes[2].plot(rates, [r["throughput_rps"] for r in rows], marker="o", label="throughput")
  axes[2].plot(rates, [r["goodput_rps"] for r in rows], marker="s", label="goodput")
  offered = [(r["rate_per_s"], r["offered_sessions_per_s"]) for r in rows
             if r["offered_sessions_per_s"] is not None]
  axes[2].plot([x for x, _ in offered], [y for _, y in offered], ls=":", marker=".",
               color="gray", label="offered (sampled)")
  axes[2].set(xlabel="request rate (1/s)", ylabel="requests/s", title="throughput, goodput")
  axes[2].legend()
  fig.tight_layout()
  fig.savefig(path + ".tmp.png", dpi=80)
  plt.close(fig)
  os.replace(path + ".tmp.png", path)


def write_capacity(out_dir: str, result: dict, slo: dict, extra: dict) -> dict:
  sources = {r: ("measured" if r in result["measured"] else "reused") for r in result["rows"]}
  rows = [_row(r, s, sources[r]) for r, s in result["rows"].items()]
  write_csv(os.path.join(out_dir, "capacity.csv"), ROW_COLUMNS, rows)
  _plot(os.path.join(out_dir, "capacity.png"), rows, slo)
  out = {"best_rate_per_s": result["best_rate_per_s"], "slo": slo,
         "measured_rates": result["measured"], "reused_rates": result["reused"],
         "rows": rows, **extra}
  write_json(os.path.join(out_dir, "capacity.json"), out)
  return out
