"""Partitioning experiments: every layout of each phase over a grid, measured and predicted.

  python -m launch.lab.sweep_partitioning --fake_devices 8 --model tiny --out results/sweep_tiny
  python -m launch.lab.sweep_partitioning --model small --batches 1,8,32 --seqs 128,512 --out DIR

Contract (library): ``Grid(phases, batches, seqs, weights).cells()`` in a fixed order;
``run(cfg, mesh, grid, hardware, out_dir, ...) -> Sweep`` runs ``launch.lab.tune_layouts.autotune``
per cell (every FFN x attention layout timed on the live mesh), cached under ``out_dir/cache`` so a
rerun resumes (``Sweep.resumed``). Per (cell, layout) row: measured and predicted step time, MFU,
bandwidth utilisation, the timing noise (``rep_spread``; ``reps_s`` in the JSON), whether it is the
measured best and the cost model's pick. A cell agrees when the pick runs the measured best
program; ``within`` is the pick's time over the best's; pairs are judged against the measured
noise (``launch.lab.rank_agreement``). ``write(sweep, out_dir, meta)``: sweep.csv (``COLUMNS``),
sweep.json (rows, cells, ``Sweep.summary()``) and measured_vs_predicted.png.
The CLI (flags defined only when run as a program: ``_Flags``) sweeps ``--phases`` x ``--weights``
x ``--batches`` x ``--seqs`` on ``--model`` over the live mesh, predicts on ``--hardware``
(``local``: measured), writes ``--out`` and prints the summary as JSON; bad flags exit 2. Several
processes (``launch.cluster_flags``): each runs every cell, process 0's timings decide and it
alone writes ``--out``.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import math
import os
import statistics
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from absl import flags

from launch import cli
from launch.cli import CliError
from launch.lab import rank_agreement, tune_layouts
from models.config import ModelConfig
from partitioning import cost_model
from partitioning.hardware import Hardware
from partitioning.mesh import mesh_shape

if TYPE_CHECKING:
  from jax.sharding import Mesh

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


def _program(m: tune_layouts.Measurement) -> str:
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
    r = tune_layouts.autotune(cfg, mesh, phase, batch, seq, quantized=w == "int8",
                              cache_dir=cache, hardware=hardware, reps=reps, refresh=refresh,
                              candidates=candidates)
    resumed += r.cache_hit
    best = min((m for m in r.measurements if m.same_as is None), key=lambda m: m.measured_s)
    predicted = [m for m in r.measurements if m.predicted_s is not None]
    pick = min(predicted, key=lambda m: m.predicted_s) if predicted else None
    timed = {_program(m): m.measured_s for m in r.measurements}
    within = None if pick is None else timed[_program(pick)] / best.measured_s
    # Pairs of distinct programs (a shared program's aliases once, at its best prediction).
    programs: dict[str, tune_layouts.Measurement] = {}
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


class _Flags:
  """The CLI's flags, defined when the module runs as a program (never on import)."""

  def __init__(self) -> None:
    from launch import cluster_flags  # noqa: F401 (--coordinator_address --num_processes ...)
    self.model = flags.DEFINE_string("model", "tiny", "model preset (its shape, random weights)")
    self.phases = flags.DEFINE_list("phases", ["prefill", "decode"], "phases")
    self.batches = flags.DEFINE_list("batches", ["1", "8"], "batch sizes")
    self.seqs = flags.DEFINE_list("seqs", ["32", "128"],
                                  "prompt (prefill) / context (decode) lengths")
    self.weights = flags.DEFINE_list("weights", ["bf16", "int8"], "weight dtypes: bf16, int8")
    self.candidates = flags.DEFINE_string("candidates", None,
                                          "ffn:attn,... (default: every pair)")
    self.mesh_shape = flags.DEFINE_string("mesh_shape", None, "x,y,z (default: factorised)")
    self.hardware = flags.DEFINE_string("hardware", "local",
                                        "cost-model hardware preset or 'local'")
    self.reps = flags.DEFINE_integer("reps", 3, "timed calls per program (the best counts)",
                                     lower_bound=1)
    self.fake_devices = flags.DEFINE_integer("fake_devices", None,
                                             "split the CPU into N devices (testing)",
                                             lower_bound=1)
    self.out = flags.DEFINE_string("out", None, "output directory (required)")
    self.refresh = flags.DEFINE_bool("refresh", False, "re-time finished cells")


def main(f: _Flags, argv: list[str]) -> None:
  from launch import cluster_flags
  cli.start(argv, required=("out",))
  if f.fake_devices.value:
    tune_layouts.use_fake_devices(f.fake_devices.value)
  cluster = cluster_flags.join()
  bad = [p for p in f.phases.value if p not in ("prefill", "decode")]
  bad += [w for w in f.weights.value if w not in ("bf16", "int8")]
  if bad:
    raise CliError(f"unknown phase or weight dtype: {bad}")
  batches = cli.positive_ints("batches", f.batches.value)
  seqs = cli.positive_ints("seqs", f.seqs.value)
  import jax
  from tqdm import tqdm
  from launch import machine
  from models.config import get_preset
  from partitioning import distributed, layouts
  from partitioning.hardware import get_hardware
  from partitioning.mesh import make_mesh
  try:
    cfg = get_preset(f.model.value)
    if cfg.name.startswith("palm"):
      raise ValueError(f"preset {cfg.name!r} is for the cost model only")
    shape = [int(s) for s in f.mesh_shape.value.split(",")] if f.mesh_shape.value else None
    mesh = make_mesh(shape=shape)
    candidates = layouts.parse_pairs(f.candidates.value) if f.candidates.value else None
    # ``local`` is measured: process 0's measurement for every process.
    hw = Hardware(**distributed.agree(
        "sweep_hardware", lambda: dataclasses.asdict(get_hardware(f.hardware.value))))
  except ValueError as e:
    raise CliError(str(e))
  grid = Grid(tuple(f.phases.value), batches, seqs, tuple(f.weights.value))
  leader = distributed.is_leader()
  sweep = run(cfg, mesh, grid, hw, f.out.value, reps=f.reps.value, refresh=f.refresh.value,
              candidates=candidates,
              progress=lambda it: tqdm(it, total=len(grid), desc="cells", unit="cell",
                                       disable=not leader))
  if not leader:  # process 0 writes the results (every process ran every cell's programs)
    jax.distributed.shutdown()
    return
  x, y, z = mesh_shape(mesh)
  dev = jax.devices()[0]
  meta = {"model": cfg.name, "mesh": [x, y, z], "devices": f"{dev.platform}:{dev.device_kind}",
          "hardware": hw.name, "hardware_spec": dataclasses.asdict(hw),
          "machine": machine.describe(),
          "title": f"{cfg.name} on {x}x{y}x{z} {dev.platform} ({hw.name} cost model)"}
  paths = write(sweep, f.out.value, meta)
  print(json.dumps({**sweep.summary(), "files": paths}))
  if cluster.multi:
    jax.distributed.shutdown()


__all__ = ["Grid", "Cell", "Sweep", "run", "write", "COLUMNS", "main"]


if __name__ == "__main__":
  cli.run(functools.partial(main, _Flags()))
