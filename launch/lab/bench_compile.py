"""Start-up compile time of deep models, layers unrolled against one ``lax.scan`` over them, and
what the scan costs a decode step.

  python -m launch.lab.bench_compile --json          # 32 and 80 layers (tiny widths), small decode
  python -m launch.lab.bench_compile --layers '' --speed_model smollm2-135m --quantize int8 \
      --dtype float32 --batch 1,4,8,32 --repeats 8 --json     # the real model's steps only

For each ``--layers`` depth, the ``--model`` preset's widths with that many layers (random
weights) are served by the engine (``serving.stack``: ``--max_slots``, ``--max_context``,
``--max_chunk``, page size 16) and ``stack.warmup`` compiles every bucketed program, once with
the layers unrolled (a Python loop: the default) and once with ``--scan_layers`` (params
stacked, ``models.transformer`` scans them); the wall time of the warm-up is the start-up cost.
Then the steps of ``--speed_model`` (default ``small``; ``smollm2-135m`` loads the real
weights) in ``--dtype`` / ``--quantize``, both ways: decode over a paged pool at each
``--batch`` row count and context ``--context`` (``--steps`` greedy steps per timed call in a
jitted loop) and one prefill chunk of ``--prefill`` tokens, median of ``--repeats`` rounds, the
two modes alternating order each round. ``--json`` prints {"compile": [{"layers", "mode",
"warmup_s", "programs"}], "steps": {"model", "dtype", "quantize", "context", "steps": [{"case",
"rows", "unrolled_ms", "scan_ms", "unrolled_min_ms", "scan_min_ms", "scan_x_unrolled"}]},
"date", "cpu", "load_avg_1m"}. Bad flags exit 2. JAX's persistent
compilation cache is switched off (a cache hit is not a compile).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time

from absl import flags

from launch import cli
from launch import machine
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "tiny", "preset whose widths the deep configs use")
_LAYERS = flags.DEFINE_list("layers", ["32", "80"], "depths to compile ('' none)")
_SLOTS = flags.DEFINE_integer("max_slots", 8, "decode rows (buckets)", lower_bound=1)
_CONTEXT_MAX = flags.DEFINE_integer("max_context", 512, "context (attention buckets)",
                                    lower_bound=16)
_CHUNK = flags.DEFINE_integer("max_chunk", 128, "prefill chunk (buckets)", lower_bound=16)
_SPEED = flags.DEFINE_string("speed_model", "small", "preset timed for decode ('' skips it)")
_BATCH = flags.DEFINE_list("batch", ["8"], "decode row counts timed")
_PREFILL = flags.DEFINE_integer("prefill", 128, "prefill chunk timed (1 row)", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "timed model's dtype")
_QUANTIZE = flags.DEFINE_enum("quantize", "none", ["none", "int8"], "timed model's weights")
_CONTEXT = flags.DEFINE_integer("context", 512, "decode context timed", lower_bound=16)
_STEPS = flags.DEFINE_integer("steps", 8, "decode steps per timed call", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed rounds", lower_bound=1)
_JSON = flags.DEFINE_bool("json", False, "print one JSON object")


def _warmup_s(cfg, scan: bool) -> tuple[float, int]:
  import jax
  import jax.numpy as jnp
  from models.cpu import backend as cpu_backend
  from models.step import UnshardedStep
  from models.text.tokenizer import ByteTokenizer
  from models.weights import init_params
  from serving import stack
  # Eager: a jitted init of 80 layers takes minutes to compile by itself.
  params = init_params(cfg, jax.random.key(0), jnp.float32)
  loop = stack.build(UnshardedStep(cfg, scan, cpu_backend.resolve().backend), params, ByteTokenizer(), stack.ServingConfig(
      max_slots=_SLOTS.value, page_size=16, kv_pages=_SLOTS.value * _CONTEXT_MAX.value // 16,
      max_chunk=_CHUNK.value, max_prefill_chunks=1, max_context=_CONTEXT_MAX.value,
      prefix_cache=False))
  t = time.perf_counter()
  programs = stack.warmup(loop)
  return time.perf_counter() - t, programs


def _step_ms(name: str) -> dict:
  """Decode at each ``--batch`` and one prefill chunk, unrolled vs scan, interleaved rounds."""
  import functools
  import jax
  import jax.numpy as jnp
  import numpy as np
  from models import paged_kv, transformer
  from models.io.loader import load_model
  from models.weights import stack_layers
  dtype = jnp.float32 if _DTYPE.value == "float32" else jnp.bfloat16
  cfg, params, _ = load_model(name, dtype, quantize=_QUANTIZE.value)
  variants = {"unrolled": params, "scan": stack_layers(params)}
  ctx, z, n = _CONTEXT.value, 16, _STEPS.value
  batches = cli.positive_ints("batch", _BATCH.value)

  @functools.partial(jax.jit, static_argnames=("n",), donate_argnames=("kv",))
  def decode(p, tok, kv, *, n):
    def body(_, carry):
      tok, kv = carry
      logits, kv = transformer.decode_step(p, tok, kv, cfg=cfg, attend_len=ctx)
      return jnp.argmax(logits, -1).astype(jnp.int32), kv
    return jax.lax.fori_loop(0, n, body, (tok, kv))

  @functools.partial(jax.jit, donate_argnames=("kv",))
  def prefill(p, tok, kv):
    b, t = tok.shape
    return transformer.prefill(p, tok, kv, jnp.zeros((b,), jnp.int32),
                               jnp.full((b,), t, jnp.int32), cfg=cfg, attend_len=ctx)

  m = ctx // z
  def pool(b):  # each variant its own buffers: the store is donated
    table = np.random.default_rng(0).permutation(b * m).reshape(b, m).astype(np.int32)
    return paged_kv.init_paged(cfg, b, b * m, z, m, dtype).replace(page_table=jnp.asarray(table))

  cases = [(f"decode_{b}", b) for b in batches] + [(f"prefill_1x{_PREFILL.value}", 1)]
  kvs = {(c, k): pool(b) for c, b in cases for k in variants}
  times = {(c, k): [] for c, _ in cases for k in variants}
  for rnd in range(_REPEATS.value + 1):  # round 0 compiles
    for c, b in cases:
      for k in (variants if rnd % 2 else reversed(list(variants))):  # A B, then B A
        p = variants[k]
        t = time.perf_counter()
        if c.startswith("decode"):
          kv = kvs[c, k].replace(lengths=jnp.full((b,), ctx - n, jnp.int32))
          out, kvs[c, k] = decode(p, jnp.zeros((b,), jnp.int32), kv, n=n)
          per = n
        else:
          out, kvs[c, k] = prefill(p, jnp.zeros((1, _PREFILL.value), jnp.int32), kvs[c, k])
          per = 1
        jax.block_until_ready(out)
        if rnd:
          times[c, k].append((time.perf_counter() - t) / per * 1e3)
  rows = []
  for c, b in cases:
    med = {k: statistics.median(times[c, k]) for k in variants}
    rows.append({"case": c, "rows": b, "unrolled_ms": round(med["unrolled"], 3),
                 "scan_ms": round(med["scan"], 3),
                 "unrolled_min_ms": round(min(times[c, "unrolled"]), 3),
                 "scan_min_ms": round(min(times[c, "scan"]), 3),
                 "scan_x_unrolled": round(med["scan"] / med["unrolled"], 3)})
  return {"model": cfg.name, "dtype": _DTYPE.value, "quantize": _QUANTIZE.value,
          "context": ctx, "steps": rows}


def main(argv: list[str]) -> None:
  cli.start(argv)
  import jax
  # Compile time is what is measured: JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR,
  # which the test suite sets) would turn it into cache reads.
  jax.config.update("jax_compilation_cache_dir", None)
  from models.config import PRESET_NAMES, get_preset
  depths = cli.positive_ints("layers", _LAYERS.value) if _LAYERS.value else []
  for name in (_MODEL.value, _SPEED.value):
    if name and name != "smollm2-135m" and (name not in PRESET_NAMES or name.startswith("palm")):
      raise CliError(f"not an instantiable preset: {name!r}")
  base = get_preset(_MODEL.value)
  rows = []
  for depth in depths:
    cfg = base.replace(name=f"{base.name}-{depth}l", num_layers=depth)
    for scan in (False, True):
      seconds, programs = _warmup_s(cfg, scan)
      rows.append({"layers": depth, "mode": "scan" if scan else "unrolled",
                   "warmup_s": round(seconds, 2), "programs": programs})
  out = {"compile": rows, "steps": _step_ms(_SPEED.value) if _SPEED.value else None,
         "model": base.name,
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "cpu": machine.cpu_model(),
         "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
  if _JSON.value:
    print(json.dumps(out))
    return
  for r in rows:
    print(f"{r['layers']:3d} layers {r['mode']:8s}: warm-up {r['warmup_s']:7.2f} s "
          f"({r['programs']} programs)")
  for d in (out["steps"] or {}).get("steps", []):
    print(f"{d['case']:14s}: unrolled {d['unrolled_ms']:8.2f} ms, scan {d['scan_ms']:8.2f} "
          f"({d['scan_x_unrolled']:.2f}x)")


if __name__ == "__main__":
  cli.run(main)
