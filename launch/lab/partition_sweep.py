"""The partitioning sweep behind ``launch.lab.sweep_partitioning`` (no flags here).

Contract:
  * ``Grid(phases, batches, seqs, weights)``: the cells; ``cells()`` in a fixed order.
  * ``run(cfg, mesh, grid, hardware, out_dir, reps, refresh, candidates, progress)`` ->
    ``Sweep``: every
    cell is ``launch.lab.layout_autotune.autotune`` (every FFN x attention layout compiled and timed
    on the live mesh, pairs sharing a program timed once) with its results cached under
    ``out_dir/cache`` (so a partial run resumes: a finished cell is read back, never re-timed;
    ``Sweep.resumed`` counts them). Per (cell, layout) row: measured and predicted step time,
    measured MFU (model FLOPs / (time x chips x peak)), measured bandwidth utilisation (the cost
    model's HBM time of the step / the measured time), whether it is the measured best and the
    cost model's pick, and the program's timing noise (``rep_spread``: slowest / fastest timed
    call - 1; the JSON rows keep every call in ``reps_s``). A cell agrees when the cost model's
    pick runs the measured best program; ``within`` is the pick's measured time over the best's
    (1 = agreement); judged against the measured noise (``launch.lab.rank_agreement``): whether the
    pick is unresolved from the best, and how many of the pairs of programs whose measured bands
    (fastest to slowest call) do not overlap the cost model orders the same way.
  * ``write(sweep, out_dir)`` writes ``sweep.csv`` (``COLUMNS``), ``sweep.json`` (rows, cells,
    summary: agreement rate, agreement within a fixed noise band and within the measured one,
    rank agreement on the resolved pairs, median pick/best ratio, the machine) and
    ``measured_vs_predicted.png`` (log-log, one marker per FFN layout, the y = x line).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import statistics
from typing import Callable, Iterator, Sequence

from jax.sharding import Mesh

from launch.lab import rank_agreement
from models.config import ModelConfig
from launch.lab import layout_autotune as at
from partitioning import cost_model
from partitioning.hardware import Hardware
from partitioning.mesh import mesh_shape

COLUMNS = ("phase", "batch", "seq", "weights", "ffn", "attn", "measured_s", "predicted_s",
           "measured_over_predicted", "mfu", "bandwidth_util", "rep_spread", "same_as", "best",
           "pick", "note")


@dataclasses.dataclass(frozen=True)
class Grid:
  phases: tuple[str, ...] = ("prefill", "decode")
  batches: tuple[int, ...] = (1, 8)
  seqs: tuple[int, ...] = (32, 128)
  weights: tuple[str, ...] = ("bf16", "int8")

  def cells(self) -> Iterator[tuple[str, int, int, str]]:
    for phase in self.phases:
      for w in self.weights:
        for b in self.batches:
          for s in self.seqs:
            yield phase, b, s, w

  def __len__(self) -> int:
    return len(self.phases) * len(self.batches) * len(self.seqs) * len(self.weights)


@dataclasses.dataclass(frozen=True)
class Cell:
  phase: str
  batch: int
  seq: int
  weights: str
  best: str  # "ffn+attn" of the measured fastest program
  pick: str | None  # the cost model's fastest predicted pair (None: it predicted none)
  within: float | None  # the pick's measured time / the best's
  # Judged against the measured timing noise (``launch.lab.rank_agreement``):
  within_measured_noise: bool | None = None  # the pick's measured band overlaps the best's
  pairs_resolved: int = 0  # pairs of distinct programs whose measured bands do not overlap
  pairs_agree: int = 0  # of those, ordered the same by the cost model


@dataclasses.dataclass(frozen=True)
class Sweep:
  rows: tuple[dict, ...]
  cells: tuple[Cell, ...]
  resumed: int  # cells read back from the cache

  def summary(self, noise: float = 0.1) -> dict:
    """``agreement_within_noise``: the pick's measured time within ``1 + noise`` of the best's
    (on fake CPU devices layouts often differ by less than the timing noise)."""
    judged = [c for c in self.cells if c.within is not None]
    agree = [c for c in judged if c.within == 1.0]
    near = [c for c in judged if c.within <= 1.0 + noise]
    noisy = [c for c in judged if c.within_measured_noise is not None]
    resolved = sum(c.pairs_resolved for c in judged)
    spreads = [r["rep_spread"] for r in self.rows
               if r.get("rep_spread") is not None and not r["same_as"]]
    return {"cells": len(self.cells), "resumed": self.resumed, "judged": len(judged),
            "agreement_rate": len(agree) / len(judged) if judged else None,
            "noise": noise,
            "agreement_within_noise": len(near) / len(judged) if judged else None,
            "median_rep_spread": statistics.median(spreads) if spreads else None,
            "agreement_within_measured_noise":
                sum(c.within_measured_noise for c in noisy) / len(noisy) if noisy else None,
            "pairs_resolved": resolved,
            "rank_agreement_resolved_pairs":
                sum(c.pairs_agree for c in judged) / resolved if resolved else None,
            "median_pick_over_best": statistics.median(c.within for c in judged)
            if judged else None}


def _program(m: at.Measurement) -> str:
  return m.same_as or f"{m.ffn}+{m.attn}"


def run(cfg: ModelConfig, mesh: Mesh, grid: Grid, hardware: Hardware, out_dir: str, *,
        reps: int = 3, refresh: bool = False,
        candidates: Sequence[tuple[str, str]] | None = None,
        progress: Callable[[Iterator], Iterator] = lambda it: it) -> Sweep:
  cache = os.path.join(out_dir, "cache")
  n = mesh.devices.size
  shape = mesh_shape(mesh)
  rows, cells, resumed = [], [], 0
  for phase, batch, seq, w in progress(grid.cells()):
    r = at.autotune(cfg, mesh, phase, batch, seq, quantized=w == "int8", cache_dir=cache,
                    hardware=hardware, reps=reps, refresh=refresh, candidates=candidates)
    resumed += r.cache_hit
    best = min((m for m in r.measurements if m.same_as is None), key=lambda m: m.measured_s)
    predicted = [m for m in r.measurements if m.predicted_s is not None]
    pick = min(predicted, key=lambda m: m.predicted_s) if predicted else None
    timed = {_program(m): m.measured_s for m in r.measurements}
    within = None if pick is None else timed[_program(pick)] / best.measured_s
    # Pairs of distinct programs (a shared program's aliases once, at its best prediction).
    programs: dict[str, at.Measurement] = {}
    for m in predicted:
      if _program(m) not in programs or m.predicted_s < programs[_program(m)].predicted_s:
        programs[_program(m)] = m
    ranking = rank_agreement.judge([rank_agreement.Timed(m.reps_s, m.predicted_s)
                                    for m in programs.values()])
    # The pick runs its program: within the noise when that is the best's or unresolved from it.
    near = None if pick is None or not pick.reps_s else (
        _program(pick) == _program(best)
        or not rank_agreement.resolved(pick.reps_s, best.reps_s))
    cells.append(Cell(phase, batch, seq, w, _program(best),
                      None if pick is None else f"{pick.ffn}+{pick.attn}", within,
                      near, ranking.resolved, ranking.agree))
    flops = cost_model.step_flops(cfg, phase, batch, seq)  # type: ignore[arg-type]
    for m in r.measurements:
      mem_s = None
      try:
        c = cost_model.step_cost(cfg, hardware, m.ffn, m.attn,  # type: ignore[arg-type]
                                 shape, phase, batch, seq, w)  # type: ignore[arg-type]
        mem_s = c.weight_mem_s + c.kv_mem_s
      except ValueError:
        pass
      t = m.measured_s
      rows.append({
          "phase": phase, "batch": batch, "seq": seq, "weights": w, "ffn": m.ffn,
          "attn": m.attn, "measured_s": t, "predicted_s": m.predicted_s,
          "measured_over_predicted": t / m.predicted_s if t and m.predicted_s else None,
          "mfu": flops / (t * n * hardware.peak_flops_bf16) if t else None,
          "bandwidth_util": mem_s / t if t and mem_s is not None else None,
          "rep_spread": m.spread, "reps_s": list(m.reps_s),
          "same_as": m.same_as or "", "best": _program(m) == _program(best),
          "pick": pick is not None and (m.ffn, m.attn) == (pick.ffn, pick.attn),
          "note": m.note})
  return Sweep(tuple(rows), tuple(cells), resumed)


def write(sweep: Sweep, out_dir: str, meta: dict) -> dict[str, str]:
  os.makedirs(out_dir, exist_ok=True)
  paths = {k: os.path.join(out_dir, f) for k, f in (
      ("csv", "sweep.csv"), ("json", "sweep.json"), ("png", "measured_vs_predicted.png"))}
  with open(paths["csv"], "w", newline="") as f:
    wr = csv.DictWriter(f, fieldnames=COLUMNS)
    wr.writeheader()
    for row in sweep.rows:
      wr.writerow({k: ("" if row[k] is None else row[k]) for k in COLUMNS})
  with open(paths["json"], "w") as f:
    json.dump({**meta, "summary": sweep.summary(), "rows": list(sweep.rows),
               "cells": [dataclasses.asdict(c) for c in sweep.cells]}, f, indent=1)
  _plot(sweep.rows, paths["png"], meta.get("title", ""))
  return paths


def _plot(rows: Sequence[dict], path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.4, 5.2))
  markers = dict(zip(cost_model.FFN_LAYOUT_NAMES, "os^Dv"))
  lo, hi = math.inf, 0.0
  for ffn, mk in markers.items():
    pts = [(r["predicted_s"], r["measured_s"]) for r in rows
           if r["ffn"] == ffn and r["predicted_s"] and r["measured_s"] and not r["same_as"]]
    if not pts:
      continue
    xs, ys = zip(*pts)
    lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
    ax.scatter(xs, ys, marker=mk, label=ffn, alpha=0.75)
  if hi > 0:
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = predicted")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("predicted step time (s), cost model")
  ax.set_ylabel("measured step time (s)")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


__all__ = ["Grid", "Cell", "Sweep", "run", "write", "COLUMNS"]
