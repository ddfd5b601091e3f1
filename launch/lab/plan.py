"""Command line front end of the layout planner (``partitioning.planner``).

  python -m launch.lab.plan --model palm-540b --hardware tpu-v4 --chips 64 --phase decode \
      --batch 512 --context 2048 [--weights int8|bf16] [--objective latency|cost] \
      [--latency_bound_ms X] [--top 10] [--json]

Contract: prints the best plan and the top ``--top`` candidates, as a table or (``--json``) as one
JSON object with at least layout, attention, mesh, latency_s, mfu, cost_chip_s_per_token and
candidates (``attn_B`` / ``attention_batch_axes``: the mesh axes attention and the KV cache shard
the batch over; weight-gathered layouts keep their gathered axes there). Any bad flag, unknown
model/hardware, or infeasible workload prints a single ``error: ...`` line on stderr and exits
with status 2 (no traceback).
"""

from __future__ import annotations

import json

from absl import flags

from launch import cli

from models.config import PRESET_NAMES
from models.io.loader import load_config
from partitioning.hardware import HARDWARE_NAMES, get_hardware
from partitioning.planner import Plan, plan

_MODEL = flags.DEFINE_string(
    "model", "palm-540b",
    f"Model preset ({', '.join(PRESET_NAMES)}), a .gguf file or a checkpoint directory.")
_HARDWARE = flags.DEFINE_string(
    "hardware", "tpu-v4", f"Hardware preset: {', '.join(HARDWARE_NAMES)} ('local' measures).")
_CHIPS = flags.DEFINE_integer("chips", 64, "Number of chips (slice size).")
_PHASE = flags.DEFINE_string("phase", "decode", "prefill or decode.")
_BATCH = flags.DEFINE_integer("batch", 64, "Sequences per step.")
_CONTEXT = flags.DEFINE_integer(
    "context", 2048, "Prompt length (prefill) or cached tokens attended to (decode).")
_WEIGHTS = flags.DEFINE_string("weights", "bf16", "Weight storage: bf16 or int8.")
_OBJECTIVE = flags.DEFINE_string(
    "objective", "latency", "latency, or cost (chip-seconds per token; may use a sub-slice).")
_LATENCY_BOUND_MS = flags.DEFINE_float(
    "latency_bound_ms", None, "Drop candidates slower than this (milliseconds per step).")
_TOP = flags.DEFINE_integer("top", 10, "Candidates to print.")
_CALIBRATION = flags.DEFINE_string(
    "calibration", "auto", "A launch.lab.calibrate JSON to plan with the calibrated model; 'auto': "
    "the one installed for --hardware (launch.lab.calibrate --install), else the one shipped for it "
    "(tpu-v4), if any; 'none': uncalibrated.")
_COLLECTIVE_MATMUL = flags.DEFINE_enum(
    "collective_matmul", "both", ["both", "on", "off"], "Cost the weight-stationary layouts "
    "with their FFN collectives looped into the matmuls (on), plain (off), or both variants, "
    "each a candidate (marked +cm).")
_JSON = flags.DEFINE_bool("json", False, "Print JSON instead of a table.")


def _table(result: Plan, header: str, top: int) -> str:
  lines = [header, f"{'#':>3} {'layout':<9} {'attention':<10} {'attn_B':<6} {'mesh':<12} "
           f"{'latency_ms':>12} "
           f"{'mfu':>6} {'chip_ms/tok':>12} {'compute_ms':>11} {'memory_ms':>10} "
           f"{'comm_ms':>10} {'hbm_GiB':>8}"]
  for i, c in enumerate(result.candidates[:top], 1):
    k = c.cost
    mesh = "x".join(str(d) for d in c.mesh)
    lines.append(
        f"{i:>3} {c.layout + ('+cm' if c.collective_matmul else ''):<9} {c.attention:<10} "
        f"{c.attention_batch_axes or '-':<6} {mesh:<12} "
        f"{k.latency_s * 1e3:>12.3f} "
        f"{k.mfu:>6.1%} {k.cost_chip_s_per_token * 1e3:>12.4f} {k.compute_s * 1e3:>11.3f} "
        f"{(k.weight_mem_s + k.kv_mem_s) * 1e3:>10.3f} {k.comm_s * 1e3:>10.3f} "
        f"{k.hbm_bytes_per_chip / 2**30:>8.2f}")
  lines.append(f"({len(result.candidates)} feasible, {len(result.dropped)} dropped)")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    cli.fail(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    model = load_config(_MODEL.value)
    hardware = get_hardware(_HARDWARE.value)
    bound = None if _LATENCY_BOUND_MS.value is None else _LATENCY_BOUND_MS.value / 1e3
    if _TOP.value < 1:
      raise ValueError(f"--top must be >= 1, got {_TOP.value}")
    # Flag strings are validated by plan() (ValueError), hence the Literal ignores.
    from partitioning.calibration import resolve
    calibration, calibrated_by = resolve(_CALIBRATION.value, hardware.name)
    result = plan(model, hardware, _CHIPS.value,
                  _PHASE.value,  # type: ignore[arg-type]
                  _BATCH.value, _CONTEXT.value,
                  weights=_WEIGHTS.value,  # type: ignore[arg-type]
                  objective=_OBJECTIVE.value,  # type: ignore[arg-type]
                  latency_bound_s=bound, calibration=calibration,
                  collective_matmul=None if _COLLECTIVE_MATMUL.value == "both"
                  else _COLLECTIVE_MATMUL.value == "on")
  except (ValueError, OSError) as e:  # OSError: an unreadable --calibration
    cli.fail(str(e))
  if _JSON.value:
    out = {"model": model.name, "hardware": hardware.name, "chips": _CHIPS.value,
           "calibration": calibrated_by}
    out.update(result.to_dict(top=_TOP.value))
    print(json.dumps(out, indent=2))
  else:
    header = (f"{model.name} on {_CHIPS.value} x {hardware.name}, {result.phase} batch "
              f"{result.batch} context {result.context}, {result.weights} weights, "
              f"objective {result.objective}, calibration {calibrated_by}")
    print(_table(result, header, _TOP.value))


if __name__ == "__main__":
  cli.run(main)
