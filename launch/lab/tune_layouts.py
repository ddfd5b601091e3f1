"""Times the partitioning layouts of one phase and shape on the live mesh; caches the winner.

  python -m launch.lab.tune_layouts --model tiny --phase decode --batch 8 --seq 64 [--json]
  python -m launch.lab.tune_layouts --fake_devices 8 --model tiny --phase prefill --batch 8 --seq 32

Contract:
  * ``autotune(cfg, mesh, phase, batch, seq, ...) -> AutotuneResult``: compiles and times every
    candidate ``(ffn, attn)`` pair (default: every layout pair; pairs with an identical
    ``LayoutPlan`` run one program, timed once, the others ``same_as`` it), picks the fastest and
    stores it in ``<cache_dir>/autotune.json`` (``default_cache_dir()``) under ``cache_key``; a
    stored key is returned without compiling (``cache_hit``) unless ``refresh``. Measured: the
    best of ``reps`` calls after a warm-up (all in ``Measurement.reps_s``); prefill: one chunk of
    ``seq`` tokens per row, decode: one token per row over ``seq`` cached positions. Predicted:
    ``cost_model.step_cost`` on ``hardware`` (``None``: not predicted; a rejection in ``note``).
    Several processes (``partitioning.distributed``): all run every candidate, process 0's cache
    and times decide, only process 0 writes.
  * The CLI (flags defined only when run as a program: ``_Flags``) tunes one cell on a mesh over
    every device (``--mesh_shape`` or factorised; ``--fake_devices N`` splits the host CPU,
    testing only) and prints measured against predicted per pair, or ``AutotuneResult.to_dict()``
    with ``--json``. Bad flags print ``error: ...`` and exit 2.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
from absl import flags
from jax.sharding import Mesh

from launch import cli
from models.config import ModelConfig
from models.cpu import env, json_cache
from models.weights import Params, init_params, quantize
from partitioning import collectives, distributed, layouts
from partitioning.mesh import mesh_shape

CACHE_FILE = "autotune.json"


@dataclasses.dataclass(frozen=True)
class Measurement:
  ffn: str
  attn: str
  measured_s: float | None
  predicted_s: float | None
  note: str = ""  # cost-model rejection, or the fallbacks the plan recorded
  same_as: str | None = None  # "ffn+attn" whose program this pair shares
  plan: str = ""
  reps_s: tuple[float, ...] = ()  # every timed call (``measured_s`` is their minimum)

  @property
  def spread(self) -> float | None:
    """Slowest / fastest timed call - 1: this program's measured timing noise, the width of the
    band ``launch.lab.rank_agreement`` judges against (None with fewer than two calls, or for a
    cache entry written before calls were kept)."""
    if len(self.reps_s) < 2:
      return None
    return max(self.reps_s) / min(self.reps_s) - 1.0


@dataclasses.dataclass(frozen=True)
class AutotuneResult:
  key: str
  phase: str
  batch: int
  seq: int
  best_ffn: str
  best_attn: str
  measurements: tuple[Measurement, ...]
  cache_hit: bool
  path: str

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["measurements"] = [dataclasses.asdict(m) for m in self.measurements]
    return d

  @classmethod
  def from_dict(cls, d: dict, cache_hit: bool) -> "AutotuneResult":
    ms = tuple(Measurement(**{**m, "reps_s": tuple(m.get("reps_s", ()))})
               for m in d["measurements"])
    fields = {k: d[k] for k in ("key", "phase", "batch", "seq", "best_ffn", "best_attn", "path")}
    return cls(measurements=ms, cache_hit=cache_hit, **fields)


def default_cache_dir() -> str:
  return env.cache_dir()


def cache_key(cfg: ModelConfig, mesh: Mesh, phase: str, batch: int, seq: int, quantized: bool,
              candidates: Sequence[tuple[str, str]], hardware=None, reps: int = 3) -> str:
  """Everything an entry depends on: the model, devices and mesh, the cell, the candidates, the
  cost model's hardware (its predictions are stored too) and the timing repetitions."""
  cfg_hash = hashlib.sha256(repr(cfg).encode()).hexdigest()[:10]
  # A preset by its name and spec; "local" by name only (its figures are re-measured each run,
  # never twice the same, and it is this machine either way).
  hw = "none" if hardware is None else hardware.name if hardware.name == "local" else (
      f"{hardware.name}-{hashlib.sha256(repr(hardware).encode()).hexdigest()[:8]}")
  dev = mesh.devices.flat[0]
  x, y, z = mesh_shape(mesh)
  cand = hashlib.sha256(repr(sorted(candidates)).encode()).hexdigest()[:8]
  return (f"{cfg.name}-{cfg_hash}|{dev.platform}:{dev.device_kind}x{mesh.size}:{x}x{y}x{z}|"
          f"{phase}|b{batch}|s{seq}|{'int8' if quantized else 'float'}|c{cand}|hw:{hw}|r{reps}"
          "|calls")  # entries keep every timed call (older ones, without, are not reused)


def _load(path: str) -> dict:
  return json_cache.load(path)


def _store(path: str, key: str, entry: dict) -> None:
  json_cache.store(path, key, entry)


def predict(cfg: ModelConfig, hardware, ffn: str, attn: str, mesh: Mesh, phase: str, batch: int,
            seq: int, quantized: bool) -> tuple[float | None, str]:
  """(cost-model latency or None, why not)."""
  if hardware is None:
    return None, ""
  try:
    from partitioning import cost_model
  except ImportError:
    return None, "cost model unavailable"
  try:
    cost = cost_model.step_cost(cfg, hardware, ffn, attn, mesh_shape(mesh), phase, batch, seq,
                                "int8" if quantized else "bf16")
  except ValueError as e:
    return None, f"cost model: {e}"
  return cost.latency_s, ""


def _time_one(step, params, cfg, mesh, ffn, attn, phase, batch, seq, reps,
              dtype) -> tuple[float, ...]:
  """Wall time of each of ``reps`` calls, after one compile + warm-up call."""
  key = jax.random.key(1)
  times = []
  if phase == "prefill":
    toks = jax.random.randint(key, (batch, seq), 0, cfg.vocab_size)
    start, lens = jnp.zeros((batch,), jnp.int32), jnp.full((batch,), seq, jnp.int32)
    for i in range(reps + 1):  # call 0 compiles and warms up
      cache = collectives.init_sharded_cache(cfg, batch, seq, mesh, ffn, attn, dtype)
      jax.block_until_ready(cache)
      t0 = time.perf_counter()
      jax.block_until_ready(step(params, toks, cache, start, lens))
      if i:
        times.append(time.perf_counter() - t0)
    return tuple(times)
  toks = jax.random.randint(key, (batch,), 0, cfg.vocab_size)
  cache = collectives.init_sharded_cache(cfg, batch, seq + reps + 1, mesh, ffn, attn, dtype)
  cache = cache.replace(lengths=jnp.full_like(cache.lengths, seq))
  for i in range(reps + 1):
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    _, cache = step(params, toks, cache)
    jax.block_until_ready(cache)
    if i:
      times.append(time.perf_counter() - t0)
  return tuple(times)


def autotune(cfg: ModelConfig, mesh: Mesh, phase: str, batch: int, seq: int, *,
             quantized: bool = False, candidates: Sequence[tuple[str, str]] | None = None,
             cache_dir: str | None = None, hardware=None, reps: int = 3, refresh: bool = False,
             params: Params | None = None, dtype=jnp.float32) -> AutotuneResult:
  """Fastest (ffn, attn) layout for ``phase`` at (batch, seq) on ``mesh``; cached on disk."""
  if phase not in ("prefill", "decode"):
    raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
  if batch < 1 or seq < 1 or reps < 1:
    raise ValueError("batch, seq and reps must be >= 1")
  if candidates is None:
    candidates = [(f, a) for f in layouts.FFN_LAYOUTS for a in layouts.ATTN_LAYOUTS]
  candidates = [(layouts.get_ffn_layout(f).name, layouts.get_attn_layout(a).name)
                for f, a in candidates]
  path = os.path.join(cache_dir or default_cache_dir(), CACHE_FILE)
  key = cache_key(cfg, mesh, phase, batch, seq, quantized, candidates, hardware, reps)
  # Several processes: process 0's cache decides and its timings are everyone's (all processes
  # must compile and run the same programs, and agree on the winner); only process 0 writes.
  entry = distributed.agree("autotune_cached", lambda: None if refresh else _load(path).get(key))
  if entry:
    return AutotuneResult.from_dict(entry, cache_hit=True)

  if params is None:
    params = init_params(cfg, jax.random.key(0), dtype)
    if quantized:
      params = quantize(params, cfg)
  dtype = params["final_norm"].dtype
  placed: dict[tuple, Params] = {}  # one resident copy per stored layout
  programs: dict[tuple, tuple[str, tuple[float, ...]]] = {}  # plan key -> (name, call times)
  results = []
  for ffn, attn in candidates:
    step = collectives.make_sharded_step(cfg, mesh, ffn, attn, phase)
    plan = step.plan(batch)
    predicted, note = predict(cfg, hardware, ffn, attn, mesh, phase, batch, seq, quantized)
    note = "; ".join(x for x in (note, *plan.reasons) if x)
    pkey = (layouts.get_ffn_layout(ffn).stored, layouts.get_ffn_layout(ffn).gathered, plan.key())
    if pkey in programs:
      name, calls = programs[pkey]
      results.append(Measurement(ffn, attn, min(calls), predicted, note, name, plan.describe(),
                                 calls))
      continue
    skey = layouts.get_ffn_layout(ffn).stored
    if skey not in placed:
      placed[skey] = collectives.shard_params(params, cfg, mesh, ffn)
    calls = _time_one(step, placed[skey], cfg, mesh, ffn, attn, phase, batch, seq, reps, dtype)
    programs[pkey] = (f"{ffn}+{attn}", calls)
    results.append(Measurement(ffn, attn, min(calls), predicted, note, None, plan.describe(),
                               calls))
  times = distributed.agree("autotune_times", lambda: [list(m.reps_s) for m in results])
  results = [dataclasses.replace(m, measured_s=min(t), reps_s=tuple(t))
             for m, t in zip(results, times)]
  best = min((m for m in results if m.same_as is None), key=lambda m: m.measured_s)
  result = AutotuneResult(key=key, phase=phase, batch=batch, seq=seq, best_ffn=best.ffn,
                          best_attn=best.attn, measurements=tuple(results), cache_hit=False,
                          path=path)
  entry = result.to_dict()
  entry.pop("cache_hit")
  if distributed.is_leader():
    _store(path, key, entry)
  return result


def use_fake_devices(n: int) -> None:
  """Splits the host CPU into ``n`` XLA devices (testing only: they share the host's cores, so
  their times say little about real chips); call before the first device query."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={n}")
  if "JAX_PLATFORMS" not in os.environ:  # jax read the variable when it was imported
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")


class _Flags:
  """The CLI's flags, defined when the module runs as a program (never on import)."""

  def __init__(self) -> None:
    self.model = flags.DEFINE_string(
        "model", "tiny", "model preset (tiny, small, smollm2-135m), a .gguf file or a checkpoint "
        "directory: its shape, with random weights (autotune measures speed)")
    self.phase = flags.DEFINE_enum("phase", "decode", ["prefill", "decode"], "phase to tune")
    self.batch = flags.DEFINE_integer("batch", 8, "sequences per step", lower_bound=1)
    self.seq = flags.DEFINE_integer("seq", 64, "prompt length (prefill) or cached context (decode)",
                                    lower_bound=1)
    self.quantize = flags.DEFINE_enum("quantize", "none", ["none", "int8"], "weight quantization")
    self.mesh_shape = flags.DEFINE_string("mesh_shape", None, "x,y,z (default: factorised)")
    self.hardware = flags.DEFINE_string("hardware", "local",
                                        "cost-model hardware preset, 'local' (measured) or 'none'")
    self.candidates = flags.DEFINE_string("candidates", None,
                                          "comma-separated ffn:attn pairs (default: all)")
    self.reps = flags.DEFINE_integer("reps", 3, "timed calls per candidate (best is kept)",
                                     lower_bound=1)
    self.cache_dir = flags.DEFINE_string("cache_dir", None, "autotune cache directory")
    self.refresh = flags.DEFINE_bool("refresh", False, "ignore the cache and re-measure")
    self.fake_devices = flags.DEFINE_integer("fake_devices", None,
                                             "split the CPU into N devices (testing)",
                                             lower_bound=1)
    self.json = flags.DEFINE_bool("json", False, "print JSON")


def _table(result: AutotuneResult) -> str:
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


def main(f: _Flags, argv: list[str]) -> None:
  if len(argv) > 1:
    cli.fail(f"unexpected arguments {argv[1:]}")
  if f.fake_devices.value:
    use_fake_devices(f.fake_devices.value)
  from models.io.loader import load_config
  from partitioning.mesh import make_mesh

  try:
    cfg = load_config(f.model.value)
    if cfg.name.startswith("palm"):
      raise ValueError(f"preset {cfg.name!r} is for the cost model only; too large to instantiate")
    shape = ([int(s) for s in f.mesh_shape.value.split(",")] if f.mesh_shape.value else None)
    mesh = make_mesh(shape=shape)
    candidates = layouts.parse_pairs(f.candidates.value) if f.candidates.value else None
    hardware = None
    if f.hardware.value != "none":
      from partitioning.hardware import get_hardware
      hardware = get_hardware(f.hardware.value)
  except (ValueError, FileNotFoundError) as e:
    cli.fail(str(e))
  result = autotune(cfg, mesh, f.phase.value, f.batch.value, f.seq.value,
                    quantized=f.quantize.value == "int8", candidates=candidates,
                    cache_dir=f.cache_dir.value, hardware=hardware, reps=f.reps.value,
                    refresh=f.refresh.value)
  if f.json.value:
    print(json.dumps(result.to_dict(), indent=1))
  else:
    print(f"mesh {dict(mesh.shape)} ({mesh.devices.flat[0].platform}), model {cfg.name}, "
          f"{f.phase.value} batch {f.batch.value} seq {f.seq.value}, hardware {f.hardware.value}")
    print(_table(result))


__all__ = ["Measurement", "AutotuneResult", "autotune", "cache_key", "default_cache_dir",
           "predict", "use_fake_devices", "main"]


if __name__ == "__main__":
  cli.run(functools.partial(main, _Flags()))
