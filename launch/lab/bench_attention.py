"""The native paged decode attention alone: every layer's call of one decode step, timed.

  python -m launch.lab.bench_attention --json   # SmolLM2's shapes, bf16, 16 and 64 rows, 200 keys
  python -m launch.lab.bench_attention --model tiny --rows 2 --context 32 --rounds 1 --json

One jitted call runs ``models.cpu.paged_attention.decode_attention`` once per layer of
``--model`` (its heads, kv heads and head size; random pages, not its weights) for ``--rows``
rows that each see ``--context`` keys in pages of ``--page_size``, the rows' pages spread over
the pool by a random permutation (as a long-running pool's free list gives; ``--noscatter``: in
order, each row's pages adjacent, as a fresh pool gives; ``--noprefetch_l2``: the next page
prefetched into L1, the other choice of the start-up race). Per row count: a warm-up call, then
``--rounds`` calls; the figures are the median and the best call, and the K and V bytes a call
reads over the best time. ``--json`` prints one JSON object {"model", "dtype", "context",
"page_size", "scatter", "prefetch_l2", "date", "machine", "rows": [{"rows", "ms", "best_ms",
"kv_bytes", "gb_s"}], "wall_s"}. The kernel must be available (AVX-512 F; bf16 pages take its
AVX-512 BF16 loops where the CPU has them); otherwise the run is a one-line error (exit 2).
``run(model, dtype_name, rows, context, page_size, rounds, scatter=True, prefetch_l2=True)``
-> dict is the library (a bad argument is a ``ValueError``); the flags exist only when run as a
program (``_Flags``).
"""

from __future__ import annotations

import datetime
import functools
import json
import statistics
import time

from absl import flags

from launch import cli, machine
from launch.cli import CliError


def run(model: str, dtype_name: str, rows: tuple[int, ...], context: int, page_size: int,
        rounds: int, scatter: bool = True, prefetch_l2: bool = True) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from models.config import get_preset
  from models.cpu import paged_attention

  t0 = time.perf_counter()
  cfg = get_preset(model)
  if not paged_attention.available():
    raise ValueError("the native paged attention is not available on this CPU (AVX-512 F)")
  if context < 1 or page_size < 16 or page_size % 16 or min(rows) < 1:
    raise ValueError("--context >= 1, --page_size a multiple of 16, --rows >= 1")
  dtype = jnp.float32 if dtype_name == "float32" else jnp.bfloat16
  n, k, h, layers = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
  bf16_dot = dtype == jnp.bfloat16 and paged_attention.bf16_dot_supported()
  rng = np.random.default_rng(0)
  out = []
  for b in rows:
    m = -(-context // page_size)
    pages = b * m
    shape = (layers, pages, k, page_size, h)
    k_pages = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    v_pages = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    ids = rng.permutation(pages) if scatter else np.arange(pages)
    table_BM = jnp.asarray(ids.reshape(b, m), jnp.int32)
    pos_B = jnp.full((b,), context - 1, jnp.int32)
    q_BNH = jnp.asarray(rng.standard_normal((b, n, h), np.float32) * h ** -0.5, dtype)

    @jax.jit
    def step(q_BNH, k_pages, v_pages, table_BM, pos_B):
      acc_BNH = jnp.zeros(q_BNH.shape, jnp.float32)
      for layer in range(layers):
        acc_BNH += paged_attention.decode_attention(q_BNH, k_pages, v_pages, table_BM, pos_B,
                                                    layer, m * page_size, bf16_dot,
                                                    prefetch_l2)
      return acc_BNH

    args = (q_BNH, k_pages, v_pages, table_BM, pos_B)
    step(*args).block_until_ready()
    times = []
    for _ in range(rounds):
      t = time.perf_counter()
      step(*args).block_until_ready()
      times.append(time.perf_counter() - t)
    kv_bytes = 2 * layers * b * context * k * h * jnp.dtype(dtype).itemsize
    out.append({"rows": b, "ms": 1e3 * statistics.median(times), "best_ms": 1e3 * min(times),
                "kv_bytes": kv_bytes, "gb_s": kv_bytes / min(times) / 1e9})
  return {"model": model, "dtype": dtype_name, "context": context, "page_size": page_size,
          "scatter": scatter, "prefetch_l2": prefetch_l2,
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
          "machine": machine.describe(), "rows": out, "wall_s": time.perf_counter() - t0}


class _Flags:
  """The CLI's flags, defined when the module runs as a program (never on import)."""

  def __init__(self) -> None:
    self.model = flags.DEFINE_string("model", "smollm2-135m", "a preset whose shapes to use")
    self.dtype = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "page dtype")
    self.rows = flags.DEFINE_list("rows", ["16", "64"], "decode rows to time")
    self.context = flags.DEFINE_integer("context", 200, "keys each row sees", lower_bound=1)
    self.page_size = flags.DEFINE_integer("page_size", 64, "KV page size", lower_bound=16)
    self.rounds = flags.DEFINE_integer("rounds", 20, "timed calls per row count", lower_bound=1)
    self.scatter = flags.DEFINE_bool("scatter", True, "rows' pages in a random order (else "
                                     "in order)")
    self.prefetch_l2 = flags.DEFINE_bool("prefetch_l2", True, "prefetch the next page into L2 "
                                         "(else L1)")
    self.json = flags.DEFINE_bool("json", False, "print one JSON object instead of a table")


def main(f: _Flags, argv: list[str]) -> None:
  cli.start(argv)
  rows = cli.positive_ints("rows", f.rows.value)
  try:
    r = run(cli.preset(f.model.value), f.dtype.value, rows, f.context.value, f.page_size.value,
            f.rounds.value, f.scatter.value, f.prefetch_l2.value)
  except ValueError as e:
    raise CliError(str(e))
  if f.json.value:
    print(json.dumps(r))
    return
  cpu = r["machine"].get("cpu", "?")
  for row in r["rows"]:
    print(f"{r['model']} {r['dtype']} {row['rows']} rows x {r['context']} keys on {cpu}: "
          f"{row['ms']:.2f} ms (best {row['best_ms']:.2f}, {row['gb_s']:.1f} GB/s of K and V)")


if __name__ == "__main__":
  cli.run(functools.partial(main, _Flags()))
