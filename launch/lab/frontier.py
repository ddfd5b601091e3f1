"""Latency-versus-MFU and latency-versus-cost Pareto frontiers (the paper's Figure 1), no flags.

Contract:
  * ``Point``: one configuration (source ``predicted`` or ``measured``, phase, weights, chips,
    batch, layout label) with ``latency_s`` (decode: per generated token, i.e. one step;
    prefill: the whole prompt pass), ``mfu`` and ``cost`` (chip-seconds per token).
  * ``predicted(model, hardware, chips, batches, context, phases, weights, calibration=None)``:
    every feasible candidate of ``partitioning.planner.plan`` (every layout x attention x mesh on
    exactly that many chips) for each (chips, batch, phase, weights), as points (source
    ``calibrated`` when a ``partitioning.calibration.Calibration`` is given).
  * ``measured(sweep_json)``: the rows of a ``launch.lab.sweep_partitioning`` result (its own
    programs only, not the ``same_as`` duplicates), as points on its mesh.
  * ``pareto(points, against)``: the points no other point of the same source and phase
    dominates: lower or equal latency and higher MFU (``against="mfu"``) or lower cost
    (``"cost"``), strictly better in one; sorted by latency.
  * ``ends(points)``: per (source, phase) the frontier's two ends: the lowest latency and the
    highest MFU, with their configurations (for PaLM 540B on 64 TPU v4 the paper's headline pair:
    int8 decode near 29 ms/token at low batch, prefill near 76% MFU at large batch).
  * ``write(points, out_dir, title)``: ``frontier.csv`` (``COLUMNS``, with ``pareto_mfu`` /
    ``pareto_cost`` flags), ``frontier.json`` (ends, counts) and ``frontier.png`` (rows: decode,
    prefill; columns: latency vs MFU, latency vs cost; Pareto points joined, and every one of
    them named by a layout label: ``runs_of_a_layout``).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from typing import Iterable, Sequence

from models.config import ModelConfig
from partitioning import planner
from partitioning.calibration import Calibration
from partitioning.hardware import Hardware

COLUMNS = ("source", "phase", "weights", "chips", "batch", "context", "layout", "latency_s",
           "mfu", "cost_chip_s_per_token", "pareto_mfu", "pareto_cost")


@dataclasses.dataclass(frozen=True)
class Point:
  source: str  # "predicted" (cost model, a named target) or "measured" (the live devices)
  phase: str
  weights: str
  chips: int
  batch: int
  context: int
  layout: str  # "ffn+attn x.y.z"
  latency_s: float
  mfu: float
  cost: float  # chip-seconds per token

  @property
  def label(self) -> str:
    return f"{self.layout} B{self.batch} {self.weights} {self.chips}c"


def predicted(model: ModelConfig, hardware: Hardware, chips: Sequence[int],
              batches: Sequence[int], context: int, phases: Sequence[str] = ("decode", "prefill"),
              weights: Sequence[str] = ("bf16", "int8"),
              calibration: Calibration | None = None) -> list[Point]:
  out = []
  for n in chips:
    for phase in phases:
      for w in weights:
        for b in batches:
          try:
            p = planner.plan(model, hardware, n, phase, b, context, w,  # type: ignore[arg-type]
                             calibration=calibration)
          except planner.NoFeasiblePlan:
            continue
          for c in p.candidates:
            mesh = ".".join(map(str, c.mesh))
            out.append(Point("calibrated" if calibration else "predicted", phase, w, n, b,
                             context,
                             f"{c.layout}+{c.attention} {mesh}", c.latency_s, c.mfu,
                             c.cost_chip_s_per_token))
  return out


def measured(sweep: dict) -> list[Point]:
  x, y, z = sweep["mesh"]
  n = x * y * z
  out = []
  for r in sweep["rows"]:
    if r["same_as"] or not r["measured_s"]:
      continue
    tokens = r["batch"] * r["seq"] if r["phase"] == "prefill" else r["batch"]
    out.append(Point("measured", r["phase"], r["weights"], n, r["batch"], r["seq"],
                     f"{r['ffn']}+{r['attn']} {x}.{y}.{z}", r["measured_s"], r["mfu"] or 0.0,
                     r["measured_s"] * n / tokens))
  return out


def pareto(points: Iterable[Point], against: str = "mfu") -> list[Point]:
  key = (lambda p: -p.mfu) if against == "mfu" else (lambda p: p.cost)
  best: list[Point] = []
  for p in sorted(points, key=lambda p: (p.latency_s, key(p))):
    if not best or key(p) < key(best[-1]) or (
        (p.latency_s, key(p)) == (best[-1].latency_s, key(best[-1]))):
      best.append(p)  # an exact twin of a frontier point is not dominated either
  return best


def _groups(points: Sequence[Point]) -> dict[tuple[str, str], list[Point]]:
  g: dict[tuple[str, str], list[Point]] = {}
  for p in points:
    g.setdefault((p.source, p.phase), []).append(p)
  return g


def ends(points: Sequence[Point]) -> dict[str, dict]:
  out = {}
  for (source, phase), pts in sorted(_groups(points).items()):
    front = pareto(pts, "mfu")
    low, high = front[0], max(front, key=lambda p: p.mfu)
    out[f"{source}/{phase}"] = {
        "lowest_latency": {**dataclasses.asdict(low), "label": low.label},
        "highest_mfu": {**dataclasses.asdict(high), "label": high.label},
        "points": len(pts), "pareto_points": len(front)}
  return out


def write(points: Sequence[Point], out_dir: str, title: str, meta: dict) -> dict[str, str]:
  os.makedirs(out_dir, exist_ok=True)
  paths = {k: os.path.join(out_dir, f) for k, f in (
      ("csv", "frontier.csv"), ("json", "frontier.json"), ("png", "frontier.png"))}
  on_mfu, on_cost = set(), set()
  for pts in _groups(points).values():
    on_mfu.update(pareto(pts, "mfu"))
    on_cost.update(pareto(pts, "cost"))
  with open(paths["csv"], "w", newline="") as f:
    wr = csv.writer(f)
    wr.writerow(COLUMNS)
    for p in points:
      wr.writerow([p.source, p.phase, p.weights, p.chips, p.batch, p.context, p.layout,
                   p.latency_s, p.mfu, p.cost, p in on_mfu, p in on_cost])
  with open(paths["json"], "w") as f:
    json.dump({**meta, "ends": ends(points), "points": len(points)}, f, indent=1)
  _plot(points, paths["png"], title)
  return paths


def runs_of_a_layout(front: Sequence[Point]) -> list[tuple[Point, str]]:
  """Every Pareto point's label, one per run of consecutive points sharing a layout (its FFN and
  attention names, on any mesh: the label names the first point's mesh and counts the others),
  chip count and weight dtype:
  ``(first point, "ffn+attn x.y.z wdtype Nc B1-64")``, with ``(+k meshes)`` when the run spans
  several mesh shapes, so each point on the plot is named without one label per point."""
  out: list[tuple[Point, str]] = []
  key = lambda p: (p.layout.split(" ")[0], p.chips, p.weights)
  i = 0
  while i < len(front):
    j = i
    while j + 1 < len(front) and key(front[j + 1]) == key(front[i]):
      j += 1
    run = front[i:j + 1]
    batches = sorted({p.batch for p in run})
    meshes = len({p.layout for p in run})
    b = f"B{batches[0]}" + (f"-{batches[-1]}" if len(batches) > 1 else "")
    more = f" (+{meshes - 1} meshes)" if meshes > 1 else ""
    out.append((front[i], f"{front[i].layout}{more} {front[i].weights} {front[i].chips}c {b}"))
    i = j + 1
  return out


def _plot(points: Sequence[Point], path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  phases = [ph for ph in ("decode", "prefill") if any(p.phase == ph for p in points)]
  fig, axes = plt.subplots(len(phases), 2, figsize=(20, 5.6 * len(phases)), squeeze=False,
                           gridspec_kw={"wspace": 0.75})
  style = {"predicted": ("tab:blue", "o"), "calibrated": ("tab:green", "^"),
           "measured": ("tab:red", "s")}
  for row, phase in zip(axes, phases):
    for ax, against in zip(row, ("mfu", "cost")):
      names: list[str] = []
      for source, (color, marker) in style.items():
        pts = [p for p in points if p.phase == phase and p.source == source]
        if not pts:
          continue
        ys = lambda ps: [p.mfu * 100 if against == "mfu" else p.cost for p in ps]
        ax.scatter([p.latency_s for p in pts], ys(pts), s=6, color=color, alpha=0.15)
        front = pareto(pts, against)
        ax.plot([p.latency_s for p in front], ys(front), marker=marker, color=color, lw=1.2,
                ms=4, label=f"{source} Pareto")
        for first, run in runs_of_a_layout(front):  # numbered on the plot, named beside it
          names.append(f"{source[0].upper()}{len(names) + 1}: {run}")
          ax.annotate(names[-1].split(":")[0], (first.latency_s, ys([first])[0]), fontsize=6,
                      color=color, xytext=(3, 3), textcoords="offset points")
      unit = "s per token (one step)" if phase == "decode" else "s per prompt pass"
      ax.set_xscale("log")
      ax.set_xlabel(f"{phase} latency, {unit}")
      if against == "cost":
        ax.set_yscale("log")
        ax.set_ylabel("cost, chip-seconds per token")
      else:
        ax.set_ylabel("MFU (%)")
      ax.legend(fontsize=7)
      ax.grid(alpha=0.3, which="both")
      ax.text(1.02, 1.0, "\n".join(names), transform=ax.transAxes, fontsize=5, va="top",
              family="monospace")
  fig.suptitle(title, fontsize=10)
  fig.subplots_adjust(left=0.04, right=0.83, top=0.94, bottom=0.06)
  fig.savefig(path, dpi=90)
  plt.close(fig)


__all__ = ["Point", "predicted", "measured", "pareto", "ends", "runs_of_a_layout", "write",
           "COLUMNS"]
