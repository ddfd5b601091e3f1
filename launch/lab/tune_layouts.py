"""Time the partitioning layouts of one phase on the live devices; print measured vs predicted.

  python -m launch.lab.tune_layouts --model tiny --phase decode --batch 8 --seq 64 [--json]
  python -m launch.lab.tune_layouts --fake_devices 8 --model tiny --phase prefill --batch 8 --seq 32

Contract: runs ``launch.lab.layout_autotune.autotune`` on a mesh over every device (``--mesh_shape``
x,y,z or factorised), prints one row per (ffn, attn) candidate with the measured and the
cost-model-predicted step time, and the winner; ``--json`` prints ``AutotuneResult.to_dict()``.
Results are cached (``--cache_dir``, default ``~/.cache/phaseserve``) by model, devices, phase
and shape; ``--refresh`` re-measures. ``--hardware`` names the cost model's hardware preset
(``local`` measures this device, ``none`` skips the prediction). ``--fake_devices N`` splits the
host CPU into N XLA devices (testing only: they share the host's cores, so measured times say
little about real chips). Bad flags print one ``error: ...`` line and exit with status 2.
"""

from __future__ import annotations

import json
import os

from absl import flags

from launch import cli

_MODEL = flags.DEFINE_string(
    "model", "tiny", "model preset (tiny, small, smollm2-135m), a .gguf file or a checkpoint "
    "directory: its shape, with random weights (autotune measures speed)")
_PHASE = flags.DEFINE_enum("phase", "decode", ["prefill", "decode"], "phase to tune")
_BATCH = flags.DEFINE_integer("batch", 8, "sequences per step", lower_bound=1)
_SEQ = flags.DEFINE_integer("seq", 64, "prompt length (prefill) or cached context (decode)",
                            lower_bound=1)
_QUANTIZE = flags.DEFINE_enum("quantize", "none", ["none", "int8"], "weight quantization")
_MESH_SHAPE = flags.DEFINE_string("mesh_shape", None, "x,y,z (default: factorised)")
_HARDWARE = flags.DEFINE_string("hardware", "local",
                                "cost-model hardware preset, 'local' (measured) or 'none'")
_CANDIDATES = flags.DEFINE_string("candidates", None,
                                  "comma-separated ffn:attn pairs (default: all)")
_REPS = flags.DEFINE_integer("reps", 3, "timed calls per candidate (best is kept)",
                             lower_bound=1)
_CACHE_DIR = flags.DEFINE_string("cache_dir", None, "autotune cache directory")
_REFRESH = flags.DEFINE_bool("refresh", False, "ignore the cache and re-measure")
_FAKE_DEVICES = flags.DEFINE_integer("fake_devices", None,
                                     "split the CPU into N devices (testing)", lower_bound=1)
_JSON = flags.DEFINE_bool("json", False, "print JSON")


def _table(result) -> str:
  def ms(s):
    return "-" if s is None else f"{s * 1e3:9.3f}"
  lines = [f"{'ffn':7} {'attn':9} {'measured_ms':>11} {'predicted_ms':>12} {'ratio':>6}  note"]
  for m in result.measurements:
    ratio = (f"{m.measured_s / m.predicted_s:6.1f}"
             if m.measured_s and m.predicted_s else "     -")
    note = f"same program as {m.same_as}" if m.same_as else m.note
    lines.append(f"{m.ffn:7} {m.attn:9} {ms(m.measured_s):>11} {ms(m.predicted_s):>12} {ratio}"
                 f"  {note}")
  lines.append(f"best: {result.best_ffn} + {result.best_attn}"
               f"{' (cached)' if result.cache_hit else ''}  [{result.path}]")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    cli.fail(f"unexpected arguments {argv[1:]}")
  if _FAKE_DEVICES.value:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_FAKE_DEVICES.value}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from models.io.loader import load_config
  from launch.lab import layout_autotune as at
  from partitioning import layouts
  from partitioning.mesh import make_mesh

  try:
    cfg = load_config(_MODEL.value)
    if cfg.name.startswith("palm"):
      raise ValueError(f"preset {cfg.name!r} is for the cost model only; too large to instantiate")
    shape = ([int(s) for s in _MESH_SHAPE.value.split(",")] if _MESH_SHAPE.value else None)
    mesh = make_mesh(shape=shape)
    candidates = layouts.parse_pairs(_CANDIDATES.value) if _CANDIDATES.value else None
    hardware = None
    if _HARDWARE.value != "none":
      from partitioning.hardware import get_hardware
      hardware = get_hardware(_HARDWARE.value)
  except (ValueError, FileNotFoundError) as e:
    cli.fail(str(e))
  result = at.autotune(cfg, mesh, _PHASE.value, _BATCH.value, _SEQ.value,
                       quantized=_QUANTIZE.value == "int8", candidates=candidates,
                       cache_dir=_CACHE_DIR.value, hardware=hardware, reps=_REPS.value,
                       refresh=_REFRESH.value)
  if _JSON.value:
    print(json.dumps(result.to_dict(), indent=1))
  else:
    print(f"mesh {dict(mesh.shape)} ({mesh.devices.flat[0].platform}), model {cfg.name}, "
          f"{_PHASE.value} batch {_BATCH.value} seq {_SEQ.value}, hardware {_HARDWARE.value}")
    print(_table(result))


if __name__ == "__main__":
  cli.run(main)
