"""Times the candidate layouts of one phase and shape on the live mesh and caches the winner.

Contract:
  * ``autotune(cfg, mesh, phase, batch, seq, ...) -> AutotuneResult``: compiles and times every
    candidate ``(ffn, attn)`` pair (default: all of ``layouts.FFN_LAYOUTS x ATTN_LAYOUTS``;
    pairs whose ``StepPlan`` is identical run the same program and are timed once, the others
    reported ``same_as`` it), picks the fastest and stores the result in a JSON file
    (``<cache_dir>/autotune.json``; default dir ``$PHASESERVE_CACHE_DIR`` or
    ``~/.cache/phaseserve``). The key is (model name + config hash, platform/device kind/count
    and mesh shape, phase, batch, seq, weight dtype, candidates); a later call with the same key
    returns the stored result without compiling anything (``cache_hit=True``) unless
    ``refresh=True``.
  * Measured: best wall time of ``reps`` calls after one compile + warm-up call (every call's
    time is kept in ``Measurement.reps_s``: their spread is the measured noise that
    ``launch.lab.partition_sweep`` judges layout rankings against). ``prefill``: one
    chunk of ``seq`` tokens per row into an empty cache; ``decode``: one token per row attending to
    ``seq`` cached positions.
  * Predicted: ``partitioning.cost_model.step_cost(...).latency_s`` on ``hardware`` (``None``:
    not predicted), on the live mesh shape and weights ``bf16`` or ``int8``; a combination the
    cost model rejects gets ``predicted_s=None`` and the reason in ``note``.
  * Several processes (``partitioning.distributed``): every process compiles and runs every
    candidate (the programs span all of them); process 0's cache lookup and process 0's times
    decide for all (``multihost.agree``), and only process 0 writes the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models.cpu import json_cache
from models.config import ModelConfig
from models.weights import Params, init_params, quantize
from partitioning import collectives, layouts, distributed as multihost
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
  from models.cpu import env
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
  entry = multihost.agree("autotune_cached", lambda: None if refresh else _load(path).get(key))
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
  times = multihost.agree("autotune_times", lambda: [list(m.reps_s) for m in results])
  results = [dataclasses.replace(m, measured_s=min(t), reps_s=tuple(t))
             for m, t in zip(results, times)]
  best = min((m for m in results if m.same_as is None), key=lambda m: m.measured_s)
  result = AutotuneResult(key=key, phase=phase, batch=batch, seq=seq, best_ffn=best.ffn,
                          best_attn=best.attn, measurements=tuple(results), cache_hit=False,
                          path=path)
  entry = result.to_dict()
  entry.pop("cache_hit")
  if multihost.is_leader():
    _store(path, key, entry)
  return result


__all__ = ["Measurement", "AutotuneResult", "autotune", "cache_key", "default_cache_dir",
           "predict"]
