"""Fit a calibration of the cost model to measured runs and check it on runs it did not see.

  python -m launch.calibrate --sweep results/sweep_tiny --out results/calibration_local.json
  python -m launch.calibrate --published tpu-v4 --out results/calibration_tpu_v4.json

``--sweep DIR`` (a ``launch.sweep_partitioning`` output): the cells are split in two (every
other cell, in the sweep's order, is held out); the five parameters of
``partitioning.calibration`` are fitted on the first half's timed programs and judged on the
held-out half: the ratio calibrated / measured (median and worst of |log|), and per held-out
cell whether the calibrated pick runs within ``--noise`` of the measured best, against the
same for the uncalibrated model. ``--published tpu-v4``: the paper's published PaLM 540B runs
(``partitioning.published``: two checkable figures, so two parameters are fitted, the achieved
FLOP/s and HBM fractions; there is no held-out set) and the planner's choices and figures before
and after. Writes the calibration to ``--out`` and prints a JSON report. Bad flags exit 2.
"""

from __future__ import annotations

import json
import math
import statistics

from absl import flags, logging

from launch import cli
from launch.cli import CliError

_SWEEP = flags.DEFINE_string("sweep", None, "a launch.sweep_partitioning output directory")
_PUBLISHED = flags.DEFINE_enum("published", None, ["tpu-v4"], "fit to the paper's runs")
_NOISE = flags.DEFINE_float("noise", 0.1, "a pick within this fraction of the best agrees",
                            lower_bound=0.0)
_OUT = flags.DEFINE_string("out", None, "write the calibration JSON here")


def _summary(ratios: list[float]) -> dict:
  logs = [abs(math.log(r)) for r in ratios]
  return {"n": len(ratios), "median_ratio": statistics.median(ratios),
          "median_abs_log": statistics.median(logs), "worst_ratio": max(ratios, key=lambda r:
                                                                         abs(math.log(r)))}


def _from_sweep(path: str, noise: float) -> tuple[object, dict]:
  from models.config import get_preset
  from partitioning import calibration as cal
  from partitioning import cost_model
  from partitioning.hardware import Hardware
  with open(f"{path}/sweep.json") as f:
    sweep = json.load(f)
  if "hardware_spec" not in sweep:
    raise ValueError("the sweep has no hardware_spec (rerun it with this version)")
  hw = Hardware(**sweep["hardware_spec"])
  model = get_preset(sweep["model"])
  mesh = tuple(sweep["mesh"])
  keys = [(c["phase"], c["batch"], c["seq"], c["weights"]) for c in sweep["cells"]]
  held = set(keys[1::2])
  by_cell: dict[tuple, list] = {}
  for r in sweep["rows"]:
    if r["same_as"] or not r["measured_s"]:
      continue
    try:
      cost = cost_model.step_cost(model, hw, r["ffn"], r["attn"], mesh, r["phase"], r["batch"],
                                  r["seq"], r["weights"])
    except ValueError:
      continue
    key = (r["phase"], r["batch"], r["seq"], r["weights"])
    by_cell.setdefault(key, []).append(
        (cal.Sample(cost, model.num_layers, r["measured_s"], f"{r['ffn']}+{r['attn']}"), r))
  train = [s for k, v in by_cell.items() if k not in held for s, _ in v]
  test = [s for k, v in by_cell.items() if k in held for s, _ in v]
  fitted = cal.fit(train, hw.name, source=f"launch.calibrate --sweep {path} (every other cell)")

  def picks(c) -> float:
    agree = 0
    cells = [v for k, v in by_cell.items() if k in held]
    for v in cells:
      best = min(s.measured_s for s, _ in v)
      pick = min(v, key=lambda p: c.apply(p[0].cost, p[0].num_layers).latency_s)[0]
      agree += pick.measured_s <= best * (1 + noise)
    return agree / len(cells) if cells else float("nan")

  report = {"source": "sweep", "model": model.name, "mesh": list(mesh), "hardware": hw.name,
            "fit_samples": len(train), "held_out_samples": len(test),
            "uncalibrated": {"fit": _summary(cal.errors(cal.IDENTITY, train)),
                             "held_out": _summary(cal.errors(cal.IDENTITY, test)),
                             "held_out_pick_within_noise": picks(cal.IDENTITY)},
            "calibrated": {"fit": _summary(cal.errors(fitted, train)),
                           "held_out": _summary(cal.errors(fitted, test)),
                           "held_out_pick_within_noise": picks(fitted)},
            "noise": noise}
  return fitted, report


def _from_published(noise: float) -> tuple[object, dict]:
  from models.config import get_preset
  from partitioning import calibration as cal
  from partitioning import cost_model, planner, published
  from partitioning.hardware import get_hardware
  hw = get_hardware("tpu-v4")
  samples = []
  for p in published.PALM_540B_TPU_V4:
    m = get_preset(p.model)
    cost = cost_model.step_cost(m, hw, p.layout, p.attention, p.mesh, p.phase, p.batch,
                                p.context, p.weights)
    samples.append(cal.Sample(cost, m.num_layers, p.measured_s, p.figure))
  fitted = cal.fit(samples, hw.name, free=("flops_fraction", "hbm_fraction"),
                   source="the paper's abstract (partitioning.published.PALM_540B_TPU_V4)")
  choices = []
  for name, chips, phase, batch, w in (("palm-540b", 64, "decode", 64, "int8"),
                                       ("palm-540b", 64, "prefill", 512, "bf16"),
                                       ("palm-540b", 64, "prefill", 1, "int8"),
                                       ("palm-62b", 16, "decode", 64, "bf16"),
                                       ("palm-62b", 8, "decode", 64, "int8")):
    m = get_preset(name)
    row = {"model": name, "chips": chips, "phase": phase, "batch": batch, "weights": w}
    for tag, c in (("uncalibrated", None), ("calibrated", fitted)):
      best = planner.plan(m, hw, chips, phase, batch, 2048, w, calibration=c).best
      row[tag] = {"layout": f"{best.layout}+{best.attention}", "mesh": list(best.mesh),
                  "latency_s": best.latency_s, "mfu": best.mfu}
    choices.append(row)
  report = {"source": "published", "hardware": hw.name,
            "samples": [{"figure": s.label, "measured_s": s.measured_s,
                         "uncalibrated_s": s.cost.latency_s,
                         "calibrated_s": fitted.apply(s.cost, s.num_layers).latency_s}
                        for s in samples],
            "held_out": "none: the paper's PaLM 62B tables were not reachable",
            "planner": choices}
  return fitted, report


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  if (_SWEEP.value is None) == (_PUBLISHED.value is None):
    raise CliError("give exactly one of --sweep and --published")
  import dataclasses
  from partitioning import calibration as cal
  try:
    fitted, report = (_from_sweep(_SWEEP.value, _NOISE.value) if _SWEEP.value
                      else _from_published(_NOISE.value))
  except (OSError, KeyError, ValueError) as e:
    raise CliError(str(e))
  if _OUT.value:
    cal.save(fitted, _OUT.value)
  print(json.dumps({"calibration": dataclasses.asdict(fitted), **report}))


if __name__ == "__main__":
  cli.run(main)
