"""The native kernels' share of ``models.cpu.lowering.measure``: each bf16-activation kernel
(AMX, AVX512-BF16, tiled) raced against the path its rows would otherwise take, per weight
format, at start-up only.

Contract: ``measure_amx_nk(meas, rounds, k, n, stream_bytes, float_prefill, float_max, dp)``
-> (min, max) rows of AMX on a bf16 ``[N, K]`` weight; ``measure_amx_tiled(..., dp, amx)`` the
same for AMX on tiled copies; ``measure_amx_w8(...)`` for AMX's int8 products on weight-only int8
quad copies; ``measure_amx`` / ``measure_dpbf16`` / ``measure_tiled(meas, rounds, k, n,
stream_bytes, float_prefill, float_max, int8_max, ...)`` -> ((min, max) rows for bf16 weights,
(min, max) for weight-only int8), each recording its best times in ``meas``; ``measure_kernel``
the shared race of a kernel given as ``(x, w) -> y``; ``measure_attention(meas, rounds)`` -> the
paged attention's prefetch target (True: L2); ``measure_attention_blocks(meas, rounds)`` -> whether
its AMX blocks take prefill chunks; ``measure_tiled_w8a8`` -> the W8A8 tiled kernel's
(min, max) rows.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from models.cpu import kernels as cpu_kernels, paged_attention
from models.cpu.lowering import (DEFAULT, MARGIN, chain, float_dot, race, w8a8_xla,
                                  weight_stack, win_range)


def measure_amx(meas: dict, rounds: int, k: int, n: int, stream_bytes: int, float_prefill: str,
                 float_max: int, int8_max: int,
                 rows: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)
                 ) -> tuple[tuple[int, int], tuple[int, int]]:
  """AMX vs the incumbent at each of ``rows``: ``measure_kernel`` of
  ``cpu_kernels.matmul_amx_group``."""
  return measure_kernel("amx", lambda y, w: cpu_kernels.matmul_amx_group(y, [w])[0], meas,
                         rounds, k, n, stream_bytes, float_prefill, float_max, int8_max, rows)


def _bf16_incumbent(m: int, float_max: int, float_prefill: str, dp: tuple[int, int],
                    amx: tuple[int, int] = (0, 0), w_kn: bool = True
                    ) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """The product the router gives ``m`` rows of bf16 activations and a bf16 (or weight-only
  int8: the raw values) weight (``[K, N]`` where ``w_kn``, else ``[N, K]``) without the kernel
  being raced: AMX re-laying the weight in its range ``amx``, else AVX512-BF16 in ``dp``, else
  the native float kernel up to ``float_max`` rows, else XLA's dot (of the weight as bf16)
  lowered as ``float_prefill``."""
  if amx[1] and amx[0] <= m <= amx[1]:
    return (lambda y, w: cpu_kernels.matmul_amx_group(y, [w])[0]) if w_kn else (
        cpu_kernels.matmul_amx_nk)
  if dp[1] and dp[0] <= m <= dp[1]:
    return (lambda y, w: cpu_kernels.matmul_dpbf16_group(y, [w])[0]) if w_kn else (
        cpu_kernels.matmul_dpbf16_nk)
  if m <= float_max:
    fn = cpu_kernels.matmul_float if w_kn else cpu_kernels.matmul_float_nk
    return lambda y, w: fn(y.astype(jnp.float32), w)
  return lambda y, w: float_dot(y, w.astype(jnp.bfloat16), w_kn, float_prefill)


def measure_amx_nk(meas: dict, rounds: int, k: int, n: int, stream_bytes: int,
                   float_prefill: str, float_max: int, dp: tuple[int, int],
                   rows: tuple[int, ...] = (1, 4, 8, 16, 32, 64, 128, 256, 512)
                   ) -> tuple[int, int]:
  """AMX on a bf16 ``[N, K]`` weight (``[4n, k]``: the tied unembedding's shape class) vs the
  router's path without it at each of ``rows``: the AVX512-BF16 ``[N, K]`` kernel in its range
  ``dp``, else the native float kernel up to ``float_max`` rows, else XLA's dot. Returns the
  (min, max) rows (``win_range``)."""
  key = jax.random.key(0)
  ws = weight_stack(lambda kk: jax.random.normal(kk, (4 * n, k), jnp.bfloat16), stream_bytes,
                    4 * n * k * 2)
  fa = jax.jit(lambda x, ws: chain(cpu_kernels.matmul_amx_nk, x, ws))
  new, other = {}, {}
  for m in rows:
    xm = jax.random.normal(key, (m, k), jnp.bfloat16)
    inc = _bf16_incumbent(m, float_max, float_prefill, dp, w_kn=False)
    fo = jax.jit(lambda x, ws, inc=inc: chain(inc, x, ws))
    r = race({"amx": lambda: fa(xm, ws), "incumbent": lambda: fo(xm, ws)}, rounds)
    new[m], other[m] = r["amx"], r["incumbent"]
    meas[f"amx_nk_bf16_{m}rows"] = r
  return win_range(new, other)


def measure_amx_tiled(meas: dict, rounds: int, k: int, n: int, stream_bytes: int,
                      float_prefill: str, float_max: int, dp: tuple[int, int],
                      amx: tuple[int, int],
                      rows: tuple[int, ...] = (1, 4, 8, 16, 32, 64, 128, 256, 512)
                      ) -> tuple[int, int]:
  """AMX straight from bf16 tiled copies (``matmul_amx_tiled_group``; ``k % 32 == 0``) vs the
  router's path without them at each of ``rows``: AMX re-laying the stored weight in its range
  ``amx``, else the AVX512-BF16 kernel in ``dp``, else the native float kernel up to
  ``float_max`` rows, else XLA's dot. Returns the (min, max) rows (``win_range``)."""
  ws = weight_stack(lambda kk: jax.random.normal(kk, (k, n), jnp.bfloat16), stream_bytes,
                    k * n * 2)
  return _race_copies(
      meas, rounds, "amx_tiled", "amx_tiled_bf16", k, ws, cpu_kernels.tile_weight,
      lambda y, t: cpu_kernels.matmul_amx_tiled_group(y, [t], [n])[0],
      lambda m: _bf16_incumbent(m, float_max, float_prefill, dp, amx), rows)


def measure_amx_w8(meas: dict, rounds: int, k: int, n: int, stream_bytes: int, int8_max: int,
                   dp: tuple[int, int], amx: tuple[int, int],
                   rows: tuple[int, ...] = (1, 4, 8, 16, 32, 64, 128, 256, 512)
                   ) -> tuple[int, int]:
  """AMX's int8 products on weight-only int8 quad copies (``matmul_amx_w8_group``; ``k % 64 ==
  0``) vs the router's path for such a weight without them at each of ``rows``: AMX widening
  the stored weight in its range ``amx``, else the AVX512-BF16 kernel in ``dp``, else the native
  float kernel on the int8 values up to ``int8_max`` rows, else XLA's dot of the converted
  weight. Returns the (min, max) rows (``win_range``)."""
  ws = weight_stack(lambda kk: jax.random.randint(kk, (k, n), -127, 128, jnp.int8),
                    stream_bytes, k * n)
  return _race_copies(
      meas, rounds, "amx_w8", "amx_w8_int8", k, ws, cpu_kernels.tile_weight_quads,
      lambda y, t: cpu_kernels.matmul_amx_w8_group(y, [t], [n])[0],
      lambda m: _bf16_incumbent(m, int8_max, "xw", dp, amx), rows)


def _race_copies(meas: dict, rounds: int, name: str, key: str, k: int, ws: list,
                 tile: Callable[[jax.Array], jax.Array],
                 kernel: Callable[[jax.Array, jax.Array], jax.Array],
                 incumbent: Callable[[int], Callable[[jax.Array, jax.Array], jax.Array]],
                 rows: tuple[int, ...]) -> tuple[int, int]:
  """A kernel on copies ``tile(w)`` of the weights ``ws`` against ``incumbent(m)`` on the
  stored weights at each of ``rows`` (``meas[f"{key}_{m}rows"]``); the (min, max) rows."""
  tiles = [tile(w) for w in ws]
  ft = jax.jit(lambda x, ts: chain(kernel, x, ts))
  new, other = {}, {}
  for m in rows:
    xm = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    fo = jax.jit(lambda x, ws, inc=incumbent(m): chain(inc, x, ws))
    r = race({name: lambda: ft(xm, tiles), "incumbent": lambda: fo(xm, ws)}, rounds)
    new[m], other[m] = r[name], r["incumbent"]
    meas[f"{key}_{m}rows"] = r
  del tiles
  return win_range(new, other)


def measure_dpbf16(meas: dict, rounds: int, k: int, n: int, stream_bytes: int,
                    float_prefill: str, float_max: int, int8_max: int,
                    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
                    ) -> tuple[tuple[int, int], tuple[int, int]]:
  """AVX512-BF16 vs the incumbent at each of ``rows``: ``measure_kernel`` of
  ``cpu_kernels.matmul_dpbf16_group``."""
  return measure_kernel("dpbf16", lambda y, w: cpu_kernels.matmul_dpbf16_group(y, [w])[0],
                         meas, rounds, k, n, stream_bytes, float_prefill, float_max, int8_max,
                         rows)


def measure_kernel(name: str, kernel: Callable[[jax.Array, jax.Array], jax.Array], meas: dict,
                    rounds: int, k: int, n: int, stream_bytes: int, float_prefill: str,
                    float_max: int, int8_max: int, rows: tuple[int, ...]
                    ) -> tuple[tuple[int, int], tuple[int, int]]:
  """A bf16-activation kernel vs the incumbent at each of ``rows`` (bf16 weights: the native
  float kernel up to ``float_max`` rows, else XLA's dot lowered as ``float_prefill``; weight-only
  int8: the native float kernel on the int8 values up to ``int8_max``, else XLA's dot of the
  converted weight), over ``stream_bytes`` of weights per call. Returns the (min, max) rows for
  bf16 and for int8 weights (``win_range``)."""
  key = jax.random.key(0)
  out = []
  for wname, wdt, nat_max in (("bf16", jnp.bfloat16, float_max), ("int8", jnp.int8, int8_max)):
    if wdt == jnp.int8:
      ws = weight_stack(lambda kk: jax.random.randint(kk, (k, n), -127, 128, jnp.int8),
                        stream_bytes, k * n)
    else:
      ws = weight_stack(lambda kk: jax.random.normal(kk, (k, n), wdt), stream_bytes, k * n * 2)
    new, other = {}, {}
    fa = jax.jit(lambda x, ws: chain(kernel, x, ws))
    for m in rows:
      xm = jax.random.normal(key, (m, k), jnp.bfloat16)
      if m <= nat_max:
        fo = jax.jit(lambda x, ws: chain(
            lambda y, w: cpu_kernels.matmul_float(y.astype(jnp.float32), w), x, ws))
      else:
        method = float_prefill if wdt == jnp.bfloat16 else "xw"  # as models.quant lowers them
        fo = jax.jit(lambda x, ws, method=method: chain(
            lambda y, w: float_dot(y, w.astype(jnp.bfloat16), True, method), x, ws))
      r = race({name: lambda: fa(xm, ws), "incumbent": lambda: fo(xm, ws)}, rounds)
      new[m], other[m] = r[name], r["incumbent"]
      meas[f"{name}_{wname}_{m}rows"] = r
    out.append(win_range(new, other))
    del ws
  return out[0], out[1]


def measure_tiled(meas: dict, rounds: int, k: int, n: int, stream_bytes: int,
                   float_prefill: str, float_max: int, int8_max: int,
                   dp: tuple[tuple[int, int], tuple[int, int]],
                   amx: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0)),
                   rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
                   ) -> tuple[tuple[int, int], tuple[int, int]]:
  """The tiled kernel vs the incumbent at each of ``rows``, per weight format (bf16 / int8 raw
  values), in the router's order: the AMX kernel in its range ``amx``, else the AVX512-BF16
  kernel in its range ``dp``, else the native float kernel up to ``float_max`` / ``int8_max``,
  else XLA's dot (as ``models.quant`` lowers it). Returns the (min, max) rows for bf16 and for
  int8 (``win_range``)."""
  key = jax.random.key(0)
  out = []
  for (wname, wdt, nat_max), (dlo, dhi), (alo, ahi) in zip(
      (("bf16", jnp.bfloat16, float_max), ("int8", jnp.int8, int8_max)), dp, amx):
    if wdt == jnp.int8:
      ws = weight_stack(lambda kk: jax.random.randint(kk, (k, n), -127, 128, jnp.int8),
                        stream_bytes, k * n)
    else:
      ws = weight_stack(lambda kk: jax.random.normal(kk, (k, n), wdt), stream_bytes, k * n * 2)
    tiles = [cpu_kernels.tile_weight(w) for w in ws]
    ft = jax.jit(lambda x, ts: chain(
        lambda y, t: cpu_kernels.matmul_tiled_group(y, [t], [n])[0], x, ts))
    method = float_prefill if wdt == jnp.bfloat16 else "xw"
    new, other = {}, {}
    for m in rows:
      xm = jax.random.normal(key, (m, k), jnp.bfloat16)
      if alo <= m <= ahi and ahi:
        inc = lambda y, w: cpu_kernels.matmul_amx_group(y, [w])[0]
      elif dlo <= m <= dhi and dhi:
        inc = lambda y, w: cpu_kernels.matmul_dpbf16_group(y, [w])[0]
      elif m <= nat_max:
        inc = lambda y, w: cpu_kernels.matmul_float(y.astype(jnp.float32), w)
      else:
        inc = lambda y, w: float_dot(y, w.astype(jnp.bfloat16), True, method)
      fo = jax.jit(lambda x, ws, inc=inc: chain(inc, x, ws))
      r = race({"tiled": lambda: ft(xm, tiles), "incumbent": lambda: fo(xm, ws)}, rounds)
      new[m], other[m] = r["tiled"], r["incumbent"]
      meas[f"tiled_{wname}_{m}rows"] = r
    out.append(win_range(new, other))
    del ws, tiles
  return out[0], out[1]


def measure_tiled_w8a8(meas: dict, rounds: int, k: int, n: int, stream_bytes: int,
                       int8_max: int, prefetch_l1: bool, row_multiple: int,
                       rows: tuple[int, ...] = (1, 4, 16, 64, 256)
                       ) -> tuple[int, int]:
  """The W8A8 tiled kernel vs the W8A8 incumbent at each of ``rows`` (the native ``[K, N]``
  W8A8 kernel up to ``int8_max`` rows, else XLA's int8 dot with rows padded to
  ``row_multiple``), f32 activations. Returns its (min, max) rows (``win_range``)."""
  ws = weight_stack(lambda kk: jax.random.randint(kk, (k, n), -127, 128, jnp.int8),
                    stream_bytes, k * n)
  tiles = [cpu_kernels.tile_weight_w8a8(w) for w in ws]
  scale = jnp.full((n,), 0.01, jnp.float32)
  ft = jax.jit(lambda x, ts: chain(
      lambda y, t: cpu_kernels.matmul_tiled_w8a8_group(y, [t], [n])[0] * scale, x, ts))
  new, other = {}, {}
  for m in rows:
    xm = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    if m <= int8_max:
      inc = lambda y, w: cpu_kernels.matmul_w8a8(y, w, scale, prefetch_l1)
    else:
      inc = lambda y, w: w8a8_xla(y, w, scale[None], True, row_multiple)
    fo = jax.jit(lambda x, ws, inc=inc: chain(inc, x, ws))
    r = race({"tiled": lambda: ft(xm, tiles), "incumbent": lambda: fo(xm, ws)}, rounds)
    new[m], other[m] = r["tiled"], r["incumbent"]
    meas[f"tiled_w8a8_{m}rows"] = r
  return win_range(new, other)


def measure_attention(meas: dict, rounds: int, rows: int = 16, keys: int = 200,
                      layers: int = 8) -> bool:
  """The native paged attention with the next page prefetched into L2 against L1, on decode
  rows of SmolLM2's attention shape (9 heads on 3 kv heads, H 64, bf16 pages of 64 spread over
  the pool) at ``keys`` keys a row, ``layers`` calls a timing. L1 replaces ``DEFAULT``'s L2 only
  when faster by ``MARGIN``. Without the kernel: ``DEFAULT``'s choice, nothing timed."""
  if not paged_attention.available():
    return DEFAULT.attention_prefetch_l2
  n, k, h, z = 9, 3, 64, 64
  m = -(-keys // z)
  key = jax.random.key(0)
  shape = (layers, rows * m, k, z, h)
  k_pages = jax.random.normal(key, shape, jnp.bfloat16)
  v_pages = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
  table = jax.random.permutation(key, rows * m).reshape(rows, m).astype(jnp.int32)
  pos = jnp.full((rows,), keys - 1, jnp.int32)
  q = jax.random.normal(key, (rows, n, h), jnp.bfloat16) * h ** -0.5
  dot = paged_attention.bf16_dot_supported()

  calls = lambda l2: _layer_calls(q, k_pages, v_pages, table, pos, layers, m * z,  # noqa: E731
                                   bf16_dot=dot, prefetch_l2=l2)
  r = race({"l2": calls(True), "l1": calls(False)}, 2 * rounds)  # a 10-70% effect
  meas[f"attention_prefetch_{rows}rows_{keys}keys"] = r
  return not r["l1"] * (1 + MARGIN) < r["l2"]


def _layer_calls(q, k_pages, v_pages, table, pos, layers: int, max_keys: int, **kw
                 ) -> Callable[[], jax.Array]:
  """One timing of the paged attention: a jitted call over ``layers`` layers of the pool (the
  kernel's switches in ``kw``)."""
  @jax.jit
  def f(q, k_pages, v_pages):
    out = jnp.zeros(q.shape, jnp.float32)
    for layer in range(layers):
      out += paged_attention.decode_attention(q, k_pages, v_pages, table, pos, layer, max_keys,
                                              **kw)
    return out
  return lambda: f(q, k_pages, v_pages)


def measure_attention_blocks(meas: dict, rounds: int, tokens: int = 128, layers: int = 8
                             ) -> bool:
  """The paged attention's AMX blocks against its row path on one prefill chunk of ``tokens``
  from position 0 (SmolLM2's attention shape, bf16 pages of 64), ``layers`` calls a timing;
  the blocks when faster by ``MARGIN``. Call only where AMX is available; False without the
  kernel's bf16 dot path (the blocks' precondition)."""
  if not (paged_attention.available() and paged_attention.bf16_dot_supported()):
    return False
  n, k, h, z = 9, 3, 64, 64
  m = -(-tokens // z)
  key = jax.random.key(0)
  k_pages = jax.random.normal(key, (layers, m, k, z, h), jnp.bfloat16)
  v_pages = jax.random.normal(jax.random.key(1), (layers, m, k, z, h), jnp.bfloat16)
  table = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (tokens, m))
  pos = jnp.arange(tokens, dtype=jnp.int32)
  q = jax.random.normal(key, (tokens, n, h), jnp.bfloat16) * h ** -0.5

  calls = lambda blocks: _layer_calls(q, k_pages, v_pages, table, pos, layers,  # noqa: E731
                                       m * z, bf16_dot=True, amx_blocks=blocks)
  r = race({"blocks": calls(True), "rows": calls(False)}, rounds)
  meas[f"attention_blocks_{tokens}tokens"] = r
  return r["blocks"] * (1 + MARGIN) < r["rows"]
