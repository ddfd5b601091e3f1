"""The files of a ``launch.lab.simulate`` run: CSVs, one JSON, PNG plots.

Contract: ``write(out_dir, comparison, meta) -> dict`` writes ``capacity.csv`` (one row per
hardware x weights x chips x mode: capacity at the SLO, tokens/s, $ per million tokens,
utilisation per pool), ``splits.csv`` (capacity per prefill:decode split of each cell),
``runs.csv`` (every simulated rate: latency percentiles, SLO verdict), ``simulate.json`` (all of
it plus ``meta`` and the deployments) and ``capacity.png`` (capacity and $ per million output
tokens against chips, interleaved vs disaggregated, per hardware and weights) and
``splits.png`` (capacity against the prefill share of a cell); returns the JSON object. Files
are written atomically (``launch.lab.loadgen_lib.report``).
"""

from __future__ import annotations

import os

from launch.lab.loadgen_lib.report import write_csv, write_json
from launch.lab.simulator.compare import Comparison

CAPACITY_COLUMNS = ("hardware", "weights", "chips", "chips_per_instance", "instances",
                    "cell_instances", "cells", "idle_chips", "mode", "split", "capacity_rps",
                    "output_tokens_per_s", "usd_per_m_output", "usd_per_m_tokens",
                    "utilisation", "note")
SPLIT_COLUMNS = ("hardware", "weights", "cell_instances", "prefill", "decode", "capacity_rps",
                 "utilisation")


def _columns(rows: tuple[dict, ...]) -> tuple[str, ...]:
  cols: dict[str, None] = {}
  for r in rows:
    cols.update(dict.fromkeys(r))
  return tuple(cols)


def write(out_dir: str, comparison: Comparison, meta: dict) -> dict:
  os.makedirs(out_dir, exist_ok=True)
  write_csv(os.path.join(out_dir, "capacity.csv"), CAPACITY_COLUMNS, list(comparison.rows))
  write_csv(os.path.join(out_dir, "splits.csv"), SPLIT_COLUMNS, list(comparison.splits))
  write_csv(os.path.join(out_dir, "runs.csv"), _columns(comparison.runs), list(comparison.runs))
  out = {**meta, "capacity": list(comparison.rows), "splits": list(comparison.splits),
         "deployments": list(comparison.deployments), "runs": len(comparison.runs)}
  write_json(os.path.join(out_dir, "simulate.json"), out)
  _plot_capacity(os.path.join(out_dir, "capacity.png"), comparison.rows)
  _plot_splits(os.path.join(out_dir, "splits.png"), comparison.splits)
  return out


def _save(fig, path: str) -> None:
  import matplotlib.pyplot as plt
  fig.tight_layout()
  fig.savefig(path + ".tmp.png", dpi=80)
  plt.close(fig)
  os.replace(path + ".tmp.png", path)


def _plot_capacity(path: str, rows: tuple[dict, ...]) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
  groups: dict[tuple[str, str, str], list[dict]] = {}
  for r in rows:
    if r["mode"] != "none":
      groups.setdefault((r["hardware"], r["weights"], r["mode"]), []).append(r)
  for (hw, w, mode), rs in sorted(groups.items()):
    rs = sorted(rs, key=lambda r: r["chips"])
    style = "-" if mode == "interleaved" else "--"
    label = f"{hw} {w} {mode}"
    axes[0].plot([r["chips"] for r in rs], [r["capacity_rps"] for r in rs], style, marker="o",
                 label=label)
    axes[1].plot([r["chips"] for r in rs], [r["usd_per_m_output"] for r in rs], style,
                 marker="o", label=label)
  met = any((r["capacity_rps"] or 0) > 0 for rs in groups.values() for r in rs)
  axes[0].set(xscale="log", yscale="log" if met else "linear", xlabel="chips",  # none met:
              ylabel="requests/s at SLO (p99)", title="capacity at the SLO")  # no log of 0
  axes[1].set(xscale="log", xlabel="chips", ylabel="$ per million output tokens",
              title="cost at capacity")
  for ax in axes:
    ax.legend(fontsize=7)
  _save(fig, path)


def _plot_splits(path: str, rows: tuple[dict, ...]) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  groups: dict[tuple[str, str, int], list[dict]] = {}
  for r in rows:
    groups.setdefault((r["hardware"], r["weights"], r["cell_instances"]), []).append(r)
  for (hw, w, cell), rs in sorted(groups.items()):
    rs = sorted(rs, key=lambda r: r["prefill"])
    ax.plot([r["prefill"] / cell for r in rs], [r["capacity_rps"] or 0 for r in rs], marker="o",
            label=f"{hw} {w} ({cell} instances)")
  ax.set(xlabel="prefill share of the instances", ylabel="requests/s at SLO (p99)",
         title="disaggregated: the prefill:decode split")
  ax.legend(fontsize=7)
  _save(fig, path)
