"""Start-up compile time of deep models, layers unrolled against one ``lax.scan`` over them, and
what the scan costs a decode step.

  python -m launch.bench_compile --json          # 32 and 80 layers (tiny widths), small decode

For each ``--layers`` depth, the ``--model`` preset's widths with that many layers (random
weights) are served by the engine (``serving.stack``: ``--max_slots``, ``--max_context``,
``--max_chunk``, page size 16) and ``stack.warmup`` compiles every bucketed program, once with
the layers unrolled (a Python loop: the default) and once with ``--scan_layers`` (params
stacked, ``models.transformer`` scans them); the wall time of the warm-up is the start-up cost.
Then the decode step of ``--speed_model`` (default ``small``: 12 layers, 768 wide, bf16) over a
paged pool at ``--batch`` rows and context ``--context``, both ways (``--steps`` greedy steps
per timed call in a jitted loop, median of ``--repeats`` interleaved rounds). ``--json`` prints
{"compile": [{"layers", "mode", "warmup_s", "programs"}], "decode": {"model", "unrolled_ms",
"scan_ms", "scan_x_unrolled"}, "date", "cpu", "load_avg_1m"}. Bad flags exit 2. JAX's persistent
compilation cache is switched off (a cache hit is not a compile).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time

from absl import flags

from launch import cli, machine
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "tiny", "preset whose widths the deep configs use")
_LAYERS = flags.DEFINE_list("layers", ["32", "80"], "depths to compile")
_SLOTS = flags.DEFINE_integer("max_slots", 8, "decode rows (buckets)", lower_bound=1)
_CONTEXT_MAX = flags.DEFINE_integer("max_context", 512, "context (attention buckets)",
                                    lower_bound=16)
_CHUNK = flags.DEFINE_integer("max_chunk", 128, "prefill chunk (buckets)", lower_bound=16)
_SPEED = flags.DEFINE_string("speed_model", "small", "preset timed for decode ('' skips it)")
_BATCH = flags.DEFINE_integer("batch", 8, "decode rows timed", lower_bound=1)
_CONTEXT = flags.DEFINE_integer("context", 512, "decode context timed", lower_bound=16)
_STEPS = flags.DEFINE_integer("steps", 8, "decode steps per timed call", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed rounds", lower_bound=1)
_JSON = flags.DEFINE_bool("json", False, "print one JSON object")


def _warmup_s(cfg, scan: bool) -> tuple[float, int]:
  import jax
  import jax.numpy as jnp
  from models.step import UnshardedStep
  from models.tokenizer import ByteTokenizer
  from models.weights import init_params
  from serving import stack
  # Eager: a jitted init of 80 layers takes minutes to compile by itself.
  params = init_params(cfg, jax.random.key(0), jnp.float32)
  loop = stack.build(UnshardedStep(cfg, scan), params, ByteTokenizer(), stack.ServingConfig(
      max_slots=_SLOTS.value, page_size=16, kv_pages=_SLOTS.value * _CONTEXT_MAX.value // 16,
      max_chunk=_CHUNK.value, max_prefill_chunks=1, max_context=_CONTEXT_MAX.value,
      prefix_cache=False))
  t = time.perf_counter()
  programs = stack.warmup(loop)
  return time.perf_counter() - t, programs


def _decode_ms(name: str) -> dict:
  import functools
  import jax
  import jax.numpy as jnp
  import numpy as np
  from models import paged_kv, transformer
  from models.config import get_preset
  from models.weights import init_params, stack_layers
  cfg = get_preset(name)
  b, ctx, z = _BATCH.value, _CONTEXT.value, 16
  params = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), jnp.bfloat16)
  variants = {"unrolled": params, "scan": jax.jit(stack_layers)(params)}

  @functools.partial(jax.jit, static_argnames=("n",), donate_argnames=("kv",))
  def run(p, tok, kv, *, n):
    def body(_, carry):
      tok, kv = carry
      logits, kv = transformer.decode_step(p, tok, kv, cfg=cfg, attend_len=ctx)
      return jnp.argmax(logits, -1).astype(jnp.int32), kv
    return jax.lax.fori_loop(0, n, body, (tok, kv))

  m = ctx // z
  table = np.random.default_rng(0).permutation(b * m).reshape(b, m).astype(np.int32)
  kvs = {k: paged_kv.init_paged(cfg, b, b * m, z, m, jnp.bfloat16).replace(  # own buffers:
      page_table=jnp.asarray(table)) for k in variants}  # each store is donated
  times: dict[str, list[float]] = {k: [] for k in variants}
  for rnd in range(_REPEATS.value + 1):  # round 0 compiles
    for k, p in variants.items():
      kv = kvs[k].replace(lengths=jnp.full((b,), ctx - _STEPS.value, jnp.int32))
      t = time.perf_counter()
      out, kvs[k] = run(p, jnp.zeros((b,), jnp.int32), kv, n=_STEPS.value)
      jax.block_until_ready(out)
      if rnd:
        times[k].append((time.perf_counter() - t) / _STEPS.value * 1e3)
  ms = {k: statistics.median(v) for k, v in times.items()}
  return {"model": cfg.name, "batch": b, "context": ctx, "unrolled_ms": ms["unrolled"],
          "scan_ms": ms["scan"], "scan_x_unrolled": ms["scan"] / ms["unrolled"]}


def main(argv: list[str]) -> None:
  cli.start(argv)
  import jax
  # Compile time is what is measured: JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR,
  # which the test suite sets) would turn it into cache reads.
  jax.config.update("jax_compilation_cache_dir", None)
  from models.config import PRESET_NAMES, get_preset
  depths = cli.positive_ints("layers", _LAYERS.value)
  for name in (_MODEL.value, _SPEED.value):
    if name and (name not in PRESET_NAMES or name.startswith("palm")):
      raise CliError(f"not an instantiable preset: {name!r}")
  base = get_preset(_MODEL.value)
  rows = []
  for depth in depths:
    cfg = base.replace(name=f"{base.name}-{depth}l", num_layers=depth)
    for scan in (False, True):
      seconds, programs = _warmup_s(cfg, scan)
      rows.append({"layers": depth, "mode": "scan" if scan else "unrolled",
                   "warmup_s": round(seconds, 2), "programs": programs})
  out = {"compile": rows, "decode": _decode_ms(_SPEED.value) if _SPEED.value else None,
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
  if out["decode"]:
    d = out["decode"]
    print(f"decode {d['model']}: unrolled {d['unrolled_ms']:.2f} ms/step, scan "
          f"{d['scan_ms']:.2f} ({d['scan_x_unrolled']:.2f}x)")


if __name__ == "__main__":
  cli.run(main)
