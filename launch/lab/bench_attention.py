"""A paged decode attention alone: every layer's call of one decode step, timed.

  python -m launch.lab.bench_attention --json   # SmolLM2's shapes, bf16, 16 and 64 rows, 200 keys
  python -m launch.lab.bench_attention --model tiny --rows 2 --context 32 --rounds 1 --json
  python -m launch.lab.bench_attention --kernel pallas_gpu --model palm-8b --rows 64 --context 8192

``--kernel``: ``native`` (the CPU kernel, ``models.cpu.paged_attention``), ``pallas_gpu`` (the
Pallas GPU kernel, ``models.gpu.paged_attention``; ``--interpret`` runs it in Pallas's
interpreter, for a smoke run off a GPU) or ``gather`` (``models.paged_kv.PagedKV.attend`` on the
XLA-only backend: the pages gathered into a contiguous buffer, then ``models.attention``). With
``--hardware`` (a ``partitioning.hardware`` preset) the JSON gives each call's achieved fraction
of its HBM bandwidth (``hbm_fraction``). One jitted call runs the kernel once per layer of
``--model`` (its heads, kv heads and head size; random pages, not its weights) for ``--rows``
rows that each see ``--context`` keys in pages of ``--page_size``, the rows' pages spread over
the pool by a random permutation (as a long-running pool's free list gives; ``--noscatter``: in
order, each row's pages adjacent, as a fresh pool gives; ``--noprefetch_l2``: the next page
prefetched into L1, the other choice of the start-up race). Per row count: a warm-up call, then
``--rounds`` calls; the figures are the median and the best call, and the K and V bytes a call
reads over the best time. ``--json`` prints one JSON object {"model", "dtype", "context",
"page_size", "scatter", "prefetch_l2", "kernel", "date", "machine", "rows": [{"rows", "ms",
"best_ms", "kv_bytes", "gb_s"[, "hbm_fraction"]}], "wall_s"}. The native kernel must be available
(AVX-512 F; bf16 pages take its AVX-512 BF16 loops where the CPU has them); otherwise the run is
a one-line error (exit 2). ``run(model, dtype_name, rows, context, page_size, rounds,
scatter=True, prefetch_l2=True, kernel="native", interpret=False, hardware=None)``
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


KERNELS = ("native", "pallas_gpu", "gather")


def _layer_call(kernel: str, cfg, dtype, pages: int, page_size: int, m: int, bf16_dot: bool,
                prefetch_l2: bool, interpret: bool):
  """``call(q_BNH, k_pages, v_pages, table_BM, pos_B, layer) -> [B, N, H]`` for ``kernel``."""
  import jax.numpy as jnp
  from models.cpu import paged_attention
  from models.gpu import paged_attention as gpu_attention
  from models.paged_kv import init_paged
  if kernel == "native":
    return lambda q, k, v, t, pos, layer: paged_attention.decode_attention(
        q, k, v, t, pos, layer, m * page_size, bf16_dot, prefetch_l2)
  if kernel == "pallas_gpu":
    return lambda q, k, v, t, pos, layer: gpu_attention.decode_attention(
        q, k, v, t, pos + 1, layer, interpret=interpret)
  # gather: the engine's XLA path over the same pool (q unscaled: ``attend`` scales it)
  def gather(q, k, v, t, pos, layer):
    kv = init_paged(cfg, t.shape[0], pages, page_size, m, dtype).replace(
        k_pages=k, v_pages=v, page_table=t)
    out = kv.attend(layer, (q.astype(jnp.float32) * q.shape[-1] ** 0.5).astype(q.dtype)[:, None],
                    pos[:, None], m * page_size)
    return out[:, 0]
  return gather


def run(model: str, dtype_name: str, rows: tuple[int, ...], context: int, page_size: int,
        rounds: int, scatter: bool = True, prefetch_l2: bool = True, kernel: str = "native",
        interpret: bool = False, hardware: str | None = None) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from models.config import get_preset
  from models.cpu import paged_attention

  t0 = time.perf_counter()
  cfg = get_preset(model)
  if kernel not in KERNELS:
    raise ValueError(f"--kernel must be one of {', '.join(KERNELS)}")
  if kernel == "native" and not paged_attention.available():
    raise ValueError("the native paged attention is not available on this CPU (AVX-512 F)")
  hbm = None
  if hardware:
    from partitioning.hardware import get_hardware
    hbm = get_hardware(hardware).hbm_bandwidth
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
    call = _layer_call(kernel, cfg, dtype, pages, page_size, m, bf16_dot, prefetch_l2, interpret)

    @jax.jit
    def step(q_BNH, k_pages, v_pages, table_BM, pos_B):
      acc_BNH = jnp.zeros(q_BNH.shape, jnp.float32)
      for layer in range(layers):
        acc_BNH += call(q_BNH, k_pages, v_pages, table_BM, pos_B, layer).astype(jnp.float32)
      return acc_BNH

    args = (q_BNH, k_pages, v_pages, table_BM, pos_B)
    step(*args).block_until_ready()
    times = []
    for _ in range(rounds):
      t = time.perf_counter()
      step(*args).block_until_ready()
      times.append(time.perf_counter() - t)
    kv_bytes = 2 * layers * b * context * k * h * jnp.dtype(dtype).itemsize
    row = {"rows": b, "ms": 1e3 * statistics.median(times), "best_ms": 1e3 * min(times),
           "kv_bytes": kv_bytes, "gb_s": kv_bytes / min(times) / 1e9}
    if hbm:
      row["hbm_fraction"] = kv_bytes / min(times) / hbm
    out.append(row)
  return {"model": model, "dtype": dtype_name, "context": context, "page_size": page_size,
          "scatter": scatter, "prefetch_l2": prefetch_l2, "kernel": kernel,
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
    self.kernel = flags.DEFINE_enum("kernel", "native", list(KERNELS), "which attention")
    self.interpret = flags.DEFINE_bool("interpret", False, "pallas_gpu: Pallas's interpreter")
    self.hardware = flags.DEFINE_string("hardware", None, "a hardware preset: report the "
                                        "fraction of its HBM bandwidth")
    self.json = flags.DEFINE_bool("json", False, "print one JSON object instead of a table")


def main(f: _Flags, argv: list[str]) -> None:
  cli.start(argv)
  rows = cli.positive_ints("rows", f.rows.value)
  try:
    r = run(cli.preset(f.model.value), f.dtype.value, rows, f.context.value, f.page_size.value,
            f.rounds.value, f.scatter.value, f.prefetch_l2.value, f.kernel.value,
            f.interpret.value, f.hardware.value)
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
