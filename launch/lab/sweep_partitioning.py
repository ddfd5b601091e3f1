"""Partitioning experiments: every layout of each phase over a grid, measured and predicted.

  python -m launch.lab.sweep_partitioning --fake_devices 8 --model tiny --out results/sweep_tiny
  python -m launch.lab.sweep_partitioning --model small --batches 1,8,32 --seqs 128,512 --out DIR

For the model and the live mesh (``--mesh_shape`` x,y,z or factorised; ``--fake_devices N``
splits the CPU, testing only), every FFN layout x attention layout (``--candidates ffn:attn,...``
to restrict) for each ``--phases`` x ``--weights`` (bf16 / int8 weight-only) x ``--batches`` x
``--seqs`` cell: measured step time (``launch.lab.layout_autotune``, the best of ``--reps`` calls),
MFU, bandwidth utilisation, and the cost model's prediction on ``--hardware`` (default
``local``: this device measured). Writes ``--out``/sweep.csv, sweep.json (the summary: cells,
agreement rate of the cost model's pick with the measured best, the median slowdown of its pick)
and measured_vs_predicted.png; a rerun with the same ``--out`` resumes (finished cells are read
from ``--out``/cache, ``--refresh`` re-times them). Prints the summary as JSON. Bad flags exit 2.

Several processes (``--coordinator_address --num_processes --process_id``, ``launch.cluster_flags``):
the mesh spans every process's devices, each process runs every cell, process 0's timings and
cache decide (``launch.lab.layout_autotune``) and process 0 alone writes ``--out``.
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import flags

from launch import cli, cluster_flags
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "tiny", "model preset (its shape, random weights)")
_PHASES = flags.DEFINE_list("phases", ["prefill", "decode"], "phases")
_BATCHES = flags.DEFINE_list("batches", ["1", "8"], "batch sizes")
_SEQS = flags.DEFINE_list("seqs", ["32", "128"], "prompt (prefill) / context (decode) lengths")
_WEIGHTS = flags.DEFINE_list("weights", ["bf16", "int8"], "weight dtypes: bf16, int8")
_CANDIDATES = flags.DEFINE_string("candidates", None, "ffn:attn,... (default: every pair)")
_MESH = flags.DEFINE_string("mesh_shape", None, "x,y,z (default: factorised)")
_HARDWARE = flags.DEFINE_string("hardware", "local", "cost-model hardware preset or 'local'")
_REPS = flags.DEFINE_integer("reps", 3, "timed calls per program (the best counts)",
                             lower_bound=1)
_FAKE = flags.DEFINE_integer("fake_devices", None, "split the CPU into N devices (testing)",
                             lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "output directory (required)")
_REFRESH = flags.DEFINE_bool("refresh", False, "re-time finished cells")


def main(argv: list[str]) -> None:
  cli.start(argv, required=("out",))
  if _FAKE.value:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_FAKE.value}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  cluster = cluster_flags.join()
  bad = [p for p in _PHASES.value if p not in ("prefill", "decode")]
  bad += [w for w in _WEIGHTS.value if w not in ("bf16", "int8")]
  if bad:
    raise CliError(f"unknown phase or weight dtype: {bad}")
  batches = cli.positive_ints("batches", _BATCHES.value)
  seqs = cli.positive_ints("seqs", _SEQS.value)
  import jax
  from tqdm import tqdm
  from launch import machine, partition_sweep as ps
  from models.config import get_preset
  from partitioning import layouts
  from partitioning import distributed as multihost
  from partitioning.hardware import Hardware, get_hardware
  from partitioning.mesh import make_mesh, mesh_shape
  try:
    cfg = get_preset(_MODEL.value)
    if cfg.name.startswith("palm"):
      raise ValueError(f"preset {cfg.name!r} is for the cost model only")
    shape = [int(s) for s in _MESH.value.split(",")] if _MESH.value else None
    mesh = make_mesh(shape=shape)
    candidates = layouts.parse_pairs(_CANDIDATES.value) if _CANDIDATES.value else None
    # ``local`` is measured: process 0's measurement for every process.
    hw = Hardware(**multihost.agree("sweep_hardware",
                                    lambda: dataclasses.asdict(get_hardware(_HARDWARE.value))))
  except ValueError as e:
    raise CliError(str(e))
  grid = ps.Grid(tuple(_PHASES.value), batches, seqs, tuple(_WEIGHTS.value))
  leader = multihost.is_leader()
  sweep = ps.run(cfg, mesh, grid, hw, _OUT.value, reps=_REPS.value, refresh=_REFRESH.value,
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
  paths = ps.write(sweep, _OUT.value, meta)
  print(json.dumps({**sweep.summary(), "files": paths}))
  if cluster.multi:
    jax.distributed.shutdown()


if __name__ == "__main__":
  cli.run(main)
