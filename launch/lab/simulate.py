"""Cluster capacity simulator: interleaved vs disaggregated serving at equal chips, at an SLO.

  python -m launch.lab.simulate --model llama-3-70b --hardware tpu-v5e,h100 \\
      --chips 16,32,64,128,256 --weights bf16,int8 --slo 2:0.05 --out results/sim

A discrete-event simulation (``launch.lab.simulator``) of a cluster of model instances serving a
trace: the load generator's length profiles (``--profile``, weighted mixes allowed) with Poisson
arrivals, or a ``--trace`` (JSONL / CSV of ``arrival_s``, ``prompt_len``, ``output_len``). Step
times come from the analytic cost model with the planner's layouts per phase, calibrated by
``--calibration`` files (``launch.lab.calibrate``; each applies to the hardware it names, or to the
one given as ``HARDWARE=PATH``; by default, ``auto``, the ones installed for the ``--hardware``
presets by ``launch.lab.calibrate --install``, if any; ``none`` for the uncalibrated model).
Per hardware x weights x chips: the capacity (highest request rate meeting p99 TTFT and TPOT
of ``--slo``), interleaved (every instance prefills and decodes, chunked prefill) and
disaggregated (prefill and decode pools, KV moved over ``--link_gb_s`` per chip; the best of the
prefill:decode splits swept), $ per million tokens at ``--chip_hour_usd`` prices, utilisation
per pool. Writes ``capacity.csv``, ``splits.csv``, ``runs.csv``, ``simulate.json``,
``capacity.png``, ``splits.png`` to ``--out`` and prints the capacity table as JSON.
"""

from __future__ import annotations

import dataclasses
import json

from absl import flags

from launch import cli
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "llama-3-70b", "model shape (models.config.SHAPE_NAMES)")
_HARDWARE = flags.DEFINE_list("hardware", ["tpu-v5e", "h100"], "hardware presets")
_CHIPS = flags.DEFINE_list("chips", ["16", "32", "64", "128", "256"], "cluster sizes")
_WEIGHTS = flags.DEFINE_list("weights", ["bf16", "int8"], "weight dtypes")
_PROFILE = flags.DEFINE_string("profile", "interactive:0.7,long_context:0.3",
                               "loadgen profiles with weights, name[:weight],...")
_TRACE = flags.DEFINE_string("trace", None, "a loadgen trace (JSONL / CSV) instead of --profile")
_SLO = flags.DEFINE_string("slo", "2:0.05", "preset (interactive, server, long) or TTFT_S:TPOT_S")
_DURATION = flags.DEFINE_float("duration_s", 30.0, "arrivals per run: at least this long",
                               lower_bound=0.0)
_MIN_REQUESTS = flags.DEFINE_integer("min_requests", 400, "requests per run, at least",
                                     lower_bound=10)
_CELL = flags.DEFINE_integer("cell_instances", 8, "instances simulated together (cells)",
                             lower_bound=1)
_SPLITS = flags.DEFINE_list("splits", [], "prefill fractions of a cell (default: up to 7)")
_SEED = flags.DEFINE_integer("seed", 0, "lengths and arrivals seed")
_SCALE = flags.DEFINE_float("length_scale", 1.0, "profile length multiplier", lower_bound=1e-3)
_HIT = flags.DEFINE_float("prefix_hit_rate", 0.0, "share of each prompt found cached",
                          lower_bound=0.0, upper_bound=0.99)
_CALIBRATION = flags.DEFINE_list(
    "calibration", ["auto"], "calibration JSON files (launch.lab.calibrate), each PATH or "
    "HARDWARE=PATH; 'auto': the ones installed for the --hardware presets (launch.lab.calibrate "
    "--install), else the ones shipped (tpu-v4), if any; 'none': uncalibrated")
_LINK = flags.DEFINE_float("link_gb_s", 50.0, "KV transfer link per chip, GB/s", lower_bound=1e-3)
_EARLY = flags.DEFINE_bool("early_reject", False, "reject arrivals predicted to miss TTFT")
_PRICES = flags.DEFINE_list("chip_hour_usd", [], "price overrides, hardware=usd,...")
_OUT = flags.DEFINE_string("out", None, "output directory")


def _calibration(calibration, spec: str):
  """``PATH`` (applies to the hardware the file names) or ``HARDWARE=PATH`` (applies to that
  preset: a sweep on a real chip measured as ``local``)."""
  hw, _, path = spec.rpartition("=")
  cal = calibration.load(path)
  return dataclasses.replace(cal, hardware=hw) if hw else cal


def _calibrations(calibration, specs: list[str], hws) -> tuple:
  out = []
  for spec in specs:
    if spec == "auto":
      found = (calibration.resolve("auto", hw.name)[0] for hw in hws)
      out += [c for c in found if c is not None]
    elif spec != "none":
      out.append(_calibration(calibration, spec))
  return tuple(out)


def main(argv: list[str]) -> None:
  cli.start(argv, required=("out",))
  from tqdm import tqdm

  from launch.lab.loadgen_lib.slo import parse_slo
  from launch.lab.loadgen_lib.workload import load_trace
  from launch.lab.simulator import report, workload
  from launch.lab.simulator.compare import CHIP_HOUR_USD, GridSpec, compare
  from models.config import get_shape
  from partitioning import calibration
  from partitioning.hardware import get_hardware

  try:
    model = get_shape(_MODEL.value)
    hws = tuple(get_hardware(h) for h in _HARDWARE.value)
    slo = parse_slo(_SLO.value)
    mix = workload.parse_mix(_PROFILE.value)
    trace = load_trace(_TRACE.value) if _TRACE.value else ()
    cals = _calibrations(calibration, _CALIBRATION.value, hws)
    splits = tuple(float(x) for x in _SPLITS.value)
    prices = tuple((k, float(v)) for k, _, v in (p.partition("=") for p in _PRICES.value))
  except (ValueError, OSError) as e:
    raise CliError(str(e)) from None
  for w in _WEIGHTS.value:
    if w not in ("bf16", "int8"):
      raise CliError(f"--weights: bf16 or int8, got {w!r}")
  for hw in hws:
    if hw.name not in CHIP_HOUR_USD and hw.name not in dict(prices):
      raise CliError(f"no price for {hw.name}: give --chip_hour_usd {hw.name}=USD")
  if any(not 0 < f < 1 for f in splits):
    raise CliError("--splits: fractions in (0, 1)")
  grid = GridSpec(model, hws, cli.positive_ints("chips", _CHIPS.value),
                  tuple(_WEIGHTS.value), mix, slo, _DURATION.value, _MIN_REQUESTS.value,
                  _CELL.value, splits, _SEED.value, _SCALE.value, _HIT.value, cals,
                  _LINK.value * 1e9, _EARLY.value, prices, trace)
  with tqdm(total=len(hws) * len(grid.weights) * len(grid.chips), desc="simulate") as bar:
    result = compare(grid, progress=bar.update)
  meta = {"model": model.name, "slo": {"name": slo.name, "ttft_s": slo.ttft_s,
                                       "tpot_s": slo.tpot_s},
          "profile": _PROFILE.value if not trace else None, "trace": _TRACE.value,
          "duration_s": _DURATION.value, "min_requests": _MIN_REQUESTS.value,
          "cell_instances": _CELL.value, "link_gb_s_per_chip": _LINK.value,
          "prefix_hit_rate": _HIT.value, "early_reject": _EARLY.value,
          "calibrations": [c.source or c.hardware for c in cals],
          "chip_hour_usd": {**CHIP_HOUR_USD, **dict(prices)}}
  report.write(_OUT.value, result, meta)
  print(json.dumps({"bench": "simulate", **meta, "capacity": list(result.rows)}))


if __name__ == "__main__":
  cli.run(main)
