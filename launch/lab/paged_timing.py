"""Paged against contiguous KV decode timing, shared by ``launch.lab.bench_pages`` and
``launch.lab.bench_engine`` (no flags here: flags belong to the scripts).

Contract: ``run(model, dtype_name, batch, context, page_sizes, steps, repeats, kv_int8=False)
-> dict`` (the JSON object ``launch.lab.bench_pages`` documents; ``kv_int8`` also times an int8 pool
per page size, the same pages and table); a bad argument is a ``ValueError``.
"""

from __future__ import annotations

import datetime
import functools
import os
import statistics
import time

from launch import machine


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
