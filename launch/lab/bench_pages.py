"""Paged against contiguous KV decode: the measurement behind the page size.

  python -m launch.lab.bench_pages --json          # small preset, bf16, batch 8, context 2048
  python -m launch.lab.bench_pages --model smollm2-135m --page_sizes 64 --kv_int8 --json

Every row of a batch of ``--batch`` holds ``--context - --steps`` positions; one timed call runs
``--steps`` greedy decode steps (``models.transformer.decode_step`` in a jitted ``fori_loop``, the
store donated) with ``attend_len = --context``, over the contiguous ``KVCache`` and over a
``models.paged_kv.PagedKV`` per ``--page_sizes`` entry whose pages are scattered over the pool (a
random permutation, as a long-running pool's free list would give). The configurations are timed
interleaved (one call of each per round, ``--repeats`` rounds after a warm-up call each), so load
from other processes hits them alike; the figures are the median and the best (least disturbed
on a shared machine) call. ``--json`` prints one JSON object {"model", "dtype", "batch",
"context", "steps", "repeats", "date", "cpu", "load_avg_1m", "contiguous_ms_per_step",
"contiguous_best_ms_per_step", "paged": [{"page_size", "ms_per_step", "x_contiguous",
"best_ms_per_step", "x_contiguous_best", "kv_bytes"}], "wall_s"}; ``--kv_int8`` also times an
int8 pool (per-token, per-head scales) with the same table and adds "int8_ms_per_step",
"int8_x_paged" (int8 over the float pool), "int8_best_ms_per_step", "int8_x_paged_best",
"int8_kv_bytes" to each page size's entry. ``--model`` may be a preset or ``smollm2-135m``
(its shapes, random weights: the timing does not depend on them).
``run(model, dtype_name, batch, context, page_sizes, steps, repeats, kv_int8=False) -> dict``
is the library (also ``launch.lab.bench_engine``'s; a bad argument is a ``ValueError``); the
flags exist only when run as a program (``_Flags``). Bad flags exit 2 with a one-line error.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import statistics
import time

from absl import flags, logging

from launch import cli, machine
from launch.cli import CliError


def run(model: str, dtype_name: str, batch: int, context: int, page_sizes: tuple[int, ...],
        steps: int, repeats: int, kv_int8: bool = False) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from models import paged_kv, transformer
  from models.config import get_preset
  from models.kv_cache import KVStore, init_cache
  from models.weights import init_params

  t0 = time.perf_counter()
  cfg = get_preset(model)
  if context > cfg.max_seq_len or steps >= context:
    raise ValueError(f"--context must be in ({steps}, {cfg.max_seq_len}] for {model}")
  bad = [z for z in page_sizes if z < 1 or context % z]
  if bad:
    raise ValueError(f"--page_sizes must divide --context {context}: {bad}")
  dtype = jnp.float32 if dtype_name == "float32" else jnp.bfloat16
  params = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), dtype)
  start = context - steps

  @functools.partial(jax.jit, static_argnames=("n",), donate_argnames=("store",))
  def decode(params, tok_B, store: KVStore, *, n: int):
    def body(_, carry):
      tok_B, store = carry
      logits_BV, store = transformer.decode_step(params, tok_B, store, cfg=cfg,
                                                 attend_len=context)
      return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), store
    return jax.lax.fori_loop(0, n, body, (tok_B, store))

  rng = np.random.default_rng(0)
  stores: dict[str, KVStore] = {"contiguous": init_cache(cfg, batch, context, dtype)}
  for z in page_sizes:
    m = context // z
    pool = paged_kv.init_paged(cfg, batch, batch * m, z, m, dtype)
    table = rng.permutation(batch * m).reshape(batch, m).astype(np.int32)
    stores[f"paged_{z}"] = pool.replace(page_table=jnp.asarray(table))
    if kv_int8:
      pool8 = paged_kv.init_paged(cfg, batch, batch * m, z, m, jnp.int8)
      stores[f"int8_{z}"] = pool8.replace(page_table=jnp.asarray(table))

  def call(name: str) -> float:
    store = stores[name].replace(lengths=jnp.full((batch,), start, jnp.int32))  # donated
    t = time.perf_counter()
    out, store = decode(params, jnp.zeros((batch,), jnp.int32), store, n=steps)
    jax.block_until_ready(out)
    stores[name] = store
    return time.perf_counter() - t

  for name in stores:  # compile + warm up
    call(name)
  times: dict[str, list[float]] = {name: [] for name in stores}
  for _ in range(repeats):
    for name in stores:
      times[name].append(call(name))
  ms = {name: statistics.median(v) / steps * 1e3 for name, v in times.items()}
  best = {name: min(v) / steps * 1e3 for name, v in times.items()}
  base, base_best = ms["contiguous"], best["contiguous"]

  def entry(z: int) -> dict:
    e = {"page_size": z, "ms_per_step": ms[f"paged_{z}"], "x_contiguous": ms[f"paged_{z}"] / base,
         "best_ms_per_step": best[f"paged_{z}"],
         "x_contiguous_best": best[f"paged_{z}"] / base_best,
         "kv_bytes": batch * context // z * paged_kv.page_bytes(cfg, z, dtype)}
    if kv_int8:
      e.update({"int8_ms_per_step": ms[f"int8_{z}"],
                "int8_x_paged": ms[f"int8_{z}"] / ms[f"paged_{z}"],
                "int8_best_ms_per_step": best[f"int8_{z}"],
                "int8_x_paged_best": best[f"int8_{z}"] / best[f"paged_{z}"],
                "int8_kv_bytes": batch * context // z * paged_kv.page_bytes(cfg, z, jnp.int8)})
    return e

  return {
      "model": cfg.name, "dtype": dtype_name, "batch": batch, "context": context,
      "steps": steps, "repeats": repeats,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "cpu": machine.cpu_model(), "jax_version": jax.__version__,
      "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
      "contiguous_ms_per_step": base, "contiguous_best_ms_per_step": base_best,
      "paged": [entry(z) for z in page_sizes],
      "wall_s": time.perf_counter() - t0,
  }


class _Flags:
  """The CLI's flags, defined when the module runs as a program (never on import)."""

  def __init__(self) -> None:
    self.model = flags.DEFINE_string("model", "small",
                                     "a preset (tiny, small) or a trained model (smollm2-135m)")
    self.dtype = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"],
                                   "param / KV dtype")
    self.batch = flags.DEFINE_integer("batch", 8, "decode batch", lower_bound=1)
    self.context = flags.DEFINE_integer("context", 2048, "attended positions (attend_len)",
                                        lower_bound=2)
    self.page_sizes = flags.DEFINE_list("page_sizes", ["16", "32", "64", "128"],
                                        "page sizes to time")
    self.steps = flags.DEFINE_integer("steps", 8, "decode steps per timed call", lower_bound=1)
    self.repeats = flags.DEFINE_integer("repeats", 3, "timed rounds", lower_bound=1)
    self.json = flags.DEFINE_bool("json", False, "print one JSON object instead of a table")
    self.kv_int8 = flags.DEFINE_bool("kv_int8", False, "also time an int8 KV pool per page size")


def _page_sizes(f: _Flags) -> tuple[int, ...]:
  try:
    out = tuple(int(v) for v in f.page_sizes.value if v.strip())
  except ValueError:
    raise CliError(f"--page_sizes must be integers, got {','.join(f.page_sizes.value)!r}")
  if not out:
    raise CliError("--page_sizes is empty")
  return out


def main(f: _Flags, argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  cli.preset(f.model.value)
  try:
    r = run(f.model.value, f.dtype.value, f.batch.value, f.context.value, _page_sizes(f),
            f.steps.value, f.repeats.value, f.kv_int8.value)
  except ValueError as e:
    raise CliError(str(e))
  if f.json.value:
    print(json.dumps(r))
    return
  print(f"{r['model']} {r['dtype']} batch {r['batch']} context {r['context']} on {r['cpu']}: "
        f"contiguous {r['contiguous_ms_per_step']:.2f} ms/step (median)")
  for p in r["paged"]:
    print(f"  page {p['page_size']:4d}: {p['ms_per_step']:.2f} ms/step "
          f"({p['x_contiguous']:.3f}x contiguous; best {p['x_contiguous_best']:.3f}x)")
    if "int8_ms_per_step" in p:
      print(f"       int8 KV: {p['int8_ms_per_step']:.2f} ms/step ({p['int8_x_paged']:.3f}x the "
            f"float pool), {p['int8_kv_bytes'] / p['kv_bytes']:.3f}x its bytes")


if __name__ == "__main__":
  cli.run(functools.partial(main, _Flags()))
