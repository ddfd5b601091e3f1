"""Pareto frontiers of latency against MFU and against cost (the paper's Figure 1).

  python -m launch.lab.sweep_frontier --model palm-540b --hardware tpu-v4 --chips 8,16,32,64,128,256 \
      --out results/frontier_palm540b
  python -m launch.lab.sweep_frontier --model palm-62b --hardware tpu-v4 --chips 8,16,32 \
      --measured results/sweep_tiny --out DIR

Predicted: every feasible layout x attention x mesh of the cost model on each ``--chips`` count
of ``--hardware`` (a named target), for each ``--batches`` x ``--weights`` x ``--phases`` at
``--context`` (``launch.lab.frontier.predicted``). Measured (``--measured DIR``, a
``launch.lab.sweep_partitioning`` output): its timed programs on the live devices, on the same
figure. ``--calibration FILE`` (``launch.lab.calibrate``): the calibrated frontier beside the
uncalibrated one (default ``auto``: the calibration installed for ``--hardware`` by
``launch.lab.calibrate --install``, if there is one; ``none``: without). Writes
``--out``/frontier.csv (every point, Pareto flags), frontier.json (each frontier's two ends:
lowest latency, highest MFU) and frontier.png; prints the ends as JSON. Bad flags exit 2.
"""

from __future__ import annotations

import json

from absl import flags

from launch import cli
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "palm-540b", "model preset (the cost model's shape)")
_HARDWARE = flags.DEFINE_string("hardware", "tpu-v4", "target hardware preset")
_CHIPS = flags.DEFINE_list("chips", ["8", "16", "32", "64", "128", "256"], "chip counts")
_BATCHES = flags.DEFINE_list("batches", [str(1 << i) for i in range(11)], "batch sizes")
_CONTEXT = flags.DEFINE_integer("context", 2048, "context (decode) / prompt (prefill) length",
                                lower_bound=1)
_PHASES = flags.DEFINE_list("phases", ["decode", "prefill"], "phases")
_WEIGHTS = flags.DEFINE_list("weights", ["bf16", "int8"], "weight dtypes")
_MEASURED = flags.DEFINE_string("measured", None, "a launch.lab.sweep_partitioning --out directory")
_CALIBRATION = flags.DEFINE_string(
    "calibration", "auto", "a launch.lab.calibrate JSON: adds the calibrated frontier beside the "
    "uncalibrated one; 'auto': the one installed for --hardware, if any; 'none': no calibration")
_OUT = flags.DEFINE_string("out", None, "output directory (required)")


def main(argv: list[str]) -> None:
  cli.start(argv, required=("out",))
  chips = list(cli.positive_ints("chips", _CHIPS.value))
  batches = list(cli.positive_ints("batches", _BATCHES.value))
  from launch.lab import frontier, machine
  from models.config import get_preset
  from partitioning import calibration
  from partitioning.hardware import get_hardware
  try:
    cfg = get_preset(_MODEL.value)
    hw = get_hardware(_HARDWARE.value)
    points = frontier.predicted(cfg, hw, chips, batches, _CONTEXT.value, _PHASES.value,
                                _WEIGHTS.value)
    c, calibrated_by = calibration.resolve(_CALIBRATION.value, hw.name)
    if c is not None:
      points += frontier.predicted(cfg, hw, chips, batches, _CONTEXT.value, _PHASES.value,
                                   _WEIGHTS.value, calibration=c)
  except (OSError, ValueError) as e:
    raise CliError(str(e))
  if _MEASURED.value:
    try:
      with open(f"{_MEASURED.value}/sweep.json") as f:
        points += frontier.measured(json.load(f))
    except (OSError, KeyError, ValueError) as e:
      raise CliError(f"--measured {_MEASURED.value!r}: {e}")
  if not points:
    raise CliError("no feasible configuration")
  title = (f"{cfg.name} on {hw.name} ({','.join(map(str, chips))} chips), context "
           f"{_CONTEXT.value}: predicted"
           + ("" if c is None else f", calibrated ({calibrated_by})")
           + (" and measured (live devices)" if _MEASURED.value else ""))
  meta = {"model": cfg.name, "hardware": hw.name, "chips": chips, "batches": batches,
          "context": _CONTEXT.value, "calibration": calibrated_by, "machine": machine.describe()}
  paths = frontier.write(points, _OUT.value, title, meta)
  print(json.dumps({"ends": frontier.ends(points), "files": paths}))


if __name__ == "__main__":
  cli.run(main)
