"""Pareto frontiers of latency against MFU and against cost (the paper's Figure 1).

  python -m launch.lab.sweep_frontier --model palm-540b --hardware tpu-v4 --chips 8,16,32,64,128,256 \
      --out results/frontier_palm540b
  python -m launch.lab.sweep_frontier --model palm-62b --hardware tpu-v4 --chips 8,16,32 \
      --measured results/sweep_tiny --out DIR

Contract (library): a ``Point`` is one configuration (source ``predicted``, ``calibrated`` or
``measured``; phase, weights, chips, batch, ``layout`` "ffn+attn x.y.z") with ``latency_s``
(decode: one step; prefill: the prompt pass), ``mfu`` and ``cost`` (chip-seconds per token).
``predicted(model, hardware, chips, batches, context, phases, weights, calibration=None)``: every
feasible candidate of ``partitioning.planner.plan``; ``measured(sweep_json)``: the own programs of
a ``launch.lab.sweep_partitioning`` result; ``pareto(points, against)``: the undominated points
of one source and phase (``"mfu"`` or ``"cost"``), by latency; ``ends(points)``: each frontier's
lowest-latency and highest-MFU ends; ``write(points, out_dir, title, meta)``: frontier.csv
(``COLUMNS``), frontier.json (ends, counts) and frontier.png (Pareto runs named by
``runs_of_a_layout``). The CLI (flags defined only when run as a program: ``_Flags``) plots
``--chips`` x ``--batches`` x ``--weights`` x ``--phases`` at ``--context`` on ``--hardware``, the
calibrated frontier beside it (``--calibration``, default ``auto``: the installed one, else the
shipped one, ``partitioning.calibration.resolve``; ``none``)
and ``--measured DIR``; it prints the ends as JSON. Bad flags exit 2.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import os
from typing import Iterable, Sequence

from absl import flags

from launch import cli
from launch.cli import CliError
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


class _Flags:
  """The CLI's flags, defined when the module runs as a program (never on import)."""

  def __init__(self) -> None:
    self.model = flags.DEFINE_string("model", "palm-540b", "model preset (the cost model's shape)")
    self.hardware = flags.DEFINE_string("hardware", "tpu-v4", "target hardware preset")
    self.chips = flags.DEFINE_list("chips", ["8", "16", "32", "64", "128", "256"], "chip counts")
    self.batches = flags.DEFINE_list("batches", [str(1 << i) for i in range(11)], "batch sizes")
    self.context = flags.DEFINE_integer("context", 2048,
                                        "context (decode) / prompt (prefill) length",
                                        lower_bound=1)
    self.phases = flags.DEFINE_list("phases", ["decode", "prefill"], "phases")
    self.weights = flags.DEFINE_list("weights", ["bf16", "int8"], "weight dtypes")
    self.measured = flags.DEFINE_string("measured", None,
                                        "a launch.lab.sweep_partitioning --out directory")
    self.calibration = flags.DEFINE_string(
        "calibration", "auto", "a launch.lab.calibrate JSON: adds the calibrated frontier beside "
        "the uncalibrated one; 'auto': the one installed for --hardware, else the one shipped for "
        "it (tpu-v4), if any; 'none': no calibration")
    self.out = flags.DEFINE_string("out", None, "output directory (required)")


def main(f: _Flags, argv: list[str]) -> None:
  cli.start(argv, required=("out",))
  chips = list(cli.positive_ints("chips", f.chips.value))
  batches = list(cli.positive_ints("batches", f.batches.value))
  from launch import machine
  from models.config import get_preset
  from partitioning import calibration
  from partitioning.hardware import get_hardware
  context, phases, weights = f.context.value, f.phases.value, f.weights.value
  try:
    cfg = get_preset(f.model.value)
    hw = get_hardware(f.hardware.value)
    points = predicted(cfg, hw, chips, batches, context, phases, weights)
    c, calibrated_by = calibration.resolve(f.calibration.value, hw.name)
    if c is not None:
      points += predicted(cfg, hw, chips, batches, context, phases, weights, calibration=c)
  except (OSError, ValueError) as e:
    raise CliError(str(e))
  if f.measured.value:
    try:
      with open(f"{f.measured.value}/sweep.json") as fh:
        points += measured(json.load(fh))
    except (OSError, KeyError, ValueError) as e:
      raise CliError(f"--measured {f.measured.value!r}: {e}")
  if not points:
    raise CliError("no feasible configuration")
  title = (f"{cfg.name} on {hw.name} ({','.join(map(str, chips))} chips), context "
           f"{context}: predicted"
           + ("" if c is None else f", calibrated ({calibrated_by})")
           + (" and measured (live devices)" if f.measured.value else ""))
  meta = {"model": cfg.name, "hardware": hw.name, "chips": chips, "batches": batches,
          "context": context, "calibration": calibrated_by, "machine": machine.describe()}
  paths = write(points, f.out.value, title, meta)
  print(json.dumps({"ends": ends(points), "files": paths}))


__all__ = ["Point", "predicted", "measured", "pareto", "ends", "runs_of_a_layout", "write",
           "COLUMNS", "main"]


if __name__ == "__main__":
  cli.run(functools.partial(main, _Flags()))
