"""Native XLA:CPU kernels for the few-row matmuls of decode (FFI targets ``phaseserve_*``).

Contract:
  * ``available()`` / ``amx_available()``: the library is loaded (``models.cpu.build.load``:
    CPU backend, AVX-512 BW + VBMI + VNNI, resp. AMX tiles granted by the OS); builds on the
    first call. Callers choose through ``models.cpu.backend.CpuBackend``, never at trace time.
  * ``matmul_s8(x_MK, w_KN)``: exact int32 ``x @ w`` (bit-identical to XLA's int8 dot).
  * ``matmul_w8a8`` / ``matmul_w8a8_nk``: f32 ``[M, N]``, bit-identical to the W8A8 formula of
    ``models.quant.einsum`` for ``[K, N]`` / ``[N, K]`` weights, in one call.
  * ``matmul_float`` / ``matmul_float_nk``: f32 ``x`` times f32, bf16 or int8 (raw values)
    weights, f32 products and accumulation (XLA's result up to summation order).
  * ``matmul_float_group`` / ``matmul_w8a8_group``: the list of products of one activation with
    several weights of one dtype in ONE call (W8A8 bit-identical to separate calls).
  * ``matmul_amx_group`` / ``matmul_amx_nk``: bf16 activations times bf16 or int8 weights on
    AMX tiles, f32 results (XLA's bf16 dot up to summation order).
  * ``dpbf16_available()`` / ``matmul_dpbf16_group`` / ``matmul_dpbf16_nk``: the same contract
    on AVX512-BF16 dot products (``vdpbf16ps``: AMD Zen 4 / Zen 5, Intel since Cooper Lake).
  * ``tiled_available()`` / ``tile_weight(w_KN)`` / ``matmul_tiled_group(x_MK, tiles, ns)``: the
    same products from a copy of each weight in column tiles of row pairs (the decode rows are
    the vector lanes: one broadcast weight pair a dot product, no shuffles).
  * ``lora_available()`` / ``lora_group(x_MI, slot_M, layer, pairs, slots)``: each row's own
    LoRA adapter's terms at one layer, f32 ``[(x @ a[l]_s) @ b[l]_s ...]`` for stacked pairs
    ``(a [L, I, A E], b [L, A E, O])`` sharing ``x`` (``models.lora``; punica's SGMV: only the
    row's slot is read, the stacked weights in place).
Inside ``shard_map`` the kernels run on each shard's local block; under GSPMD a custom call is
not partitioned, so the ``partitioning`` layouts use ``shard_map``.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.cpu import build as native_build

_TARGET = "phaseserve_int8_matmul"
_FLOAT_TARGET = "phaseserve_float_matmul"
_FLOAT_NK_TARGET = "phaseserve_float_nk_matmul"
_W8A8_TARGET = "phaseserve_w8a8_matmul"
_W8A8_NK_TARGET = "phaseserve_w8a8_nk_matmul"
_FLOAT_GROUP_TARGET = "phaseserve_float_matmul_group"
_W8A8_GROUP_TARGET = "phaseserve_w8a8_matmul_group"
_FLAGS = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
          "-mavx512vnni", "-mavx512vbmi"]


def available() -> bool:
  """True when the kernels are loaded in this process (see the module contract); builds and
  registers them on the first call (start-up: ``models.cpu.backend.resolve``)."""
  return native_build.load(
      "matmul_kernels", tuple(_FLAGS),
      frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi"}),
      ((_TARGET, "PhaseserveInt8Matmul"), (_FLOAT_TARGET, "PhaseserveFloatMatmul"),
       (_FLOAT_NK_TARGET, "PhaseserveFloatNKMatmul"), (_W8A8_TARGET, "PhaseserveW8A8Matmul"),
       (_W8A8_NK_TARGET, "PhaseserveW8A8NKMatmul"),
       (_FLOAT_GROUP_TARGET, "PhaseserveFloatMatmulGroup"),
       (_W8A8_GROUP_TARGET, "PhaseserveW8A8MatmulGroup"))) is not None


def matmul_s8(x_MK: jax.Array, w_KN: jax.Array) -> jax.Array:
  """int32 ``x_MK @ w_KN`` for int8 operands (call only when ``available()``)."""
  m, k = x_MK.shape
  k2, n = w_KN.shape
  if k != k2 or x_MK.dtype != jnp.int8 or w_KN.dtype != jnp.int8:
    raise ValueError(f"matmul_s8 wants int8 [M, K] x [K, N], got {x_MK.shape} {x_MK.dtype} "
                     f"and {w_KN.shape} {w_KN.dtype}")
  call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((m, n), jnp.int32),
                          vmap_method="sequential")
  return call(x_MK, w_KN)


FLOAT_WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int8))


def matmul_float(x_MK: jax.Array, w_KN: jax.Array) -> jax.Array:
  """f32 ``x_MK @ w_KN`` for f32 ``x`` and an f32, bf16 or int8 ``w`` (int8: the raw integer
  values; the caller applies the scales), f32 products and accumulation (call only when
  ``available()``)."""
  m, k = x_MK.shape
  k2, n = w_KN.shape
  if k != k2 or x_MK.dtype != jnp.float32 or w_KN.dtype not in FLOAT_WEIGHT_DTYPES:
    raise ValueError(f"matmul_float wants f32 [M, K] x f32|bf16|int8 [K, N], got {x_MK.shape} "
                     f"{x_MK.dtype} and {w_KN.shape} {w_KN.dtype}")
  call = jax.ffi.ffi_call(_FLOAT_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32),
                          vmap_method="sequential")
  return call(x_MK, w_KN)


def matmul_float_group(x_MK: jax.Array, ws_KN: Sequence[jax.Array]) -> list[jax.Array]:
  """``[matmul_float(x_MK, w) for w in ws_KN]`` in one native call (weights of one dtype): one
  task per thread streams its share of every weight, instead of a fan-out and a join per
  weight. Same products and f32 sums; only the split of K over threads (the summation order)
  may differ from separate calls."""
  return _group_call(_FLOAT_GROUP_TARGET, "matmul_float_group", x_MK, ws_KN, jnp.float32,
                     FLOAT_WEIGHT_DTYPES)


def _group_call(target: str, name: str, x_MK: jax.Array, ws_KN: Sequence[jax.Array], x_dtype,
                w_dtypes: tuple) -> list[jax.Array]:
  """One call of a grouped FFI target: ``x_MK`` (of ``x_dtype``) times ``[K, N]`` weights of one
  dtype among ``w_dtypes``; f32 ``[M, N]`` results. Bad operands raise ``ValueError``."""
  m, k = x_MK.shape
  dtype = ws_KN[0].dtype if ws_KN else None
  if (not ws_KN or x_MK.dtype != x_dtype or dtype not in w_dtypes
      or any(w.ndim != 2 or w.shape[0] != k or w.dtype != dtype for w in ws_KN)):
    raise ValueError(f"{name} wants {jnp.dtype(x_dtype).name} [M, K] and "
                     f"{'|'.join(jnp.dtype(d).name for d in w_dtypes)} [K, N] weights of one "
                     f"dtype, got {x_MK.shape} {x_MK.dtype} and "
                     f"{[(w.shape, str(w.dtype)) for w in ws_KN]}")
  call = jax.ffi.ffi_call(target,
                          [jax.ShapeDtypeStruct((m, w.shape[1]), jnp.float32) for w in ws_KN],
                          vmap_method="sequential")
  return list(call(x_MK, *ws_KN))


def matmul_float_nk(x_MK: jax.Array, w_NK: jax.Array) -> jax.Array:
  """``matmul_float`` for a weight laid out ``[N, K]`` (contracted on its trailing axis, e.g. a
  tied ``[V, D]`` unembedding): f32 ``x_MK @ w_NK.T``."""
  m, k = x_MK.shape
  n, k2 = w_NK.shape
  if k != k2 or x_MK.dtype != jnp.float32 or w_NK.dtype not in FLOAT_WEIGHT_DTYPES:
    raise ValueError(f"matmul_float_nk wants f32 [M, K] x f32|bf16|int8 [N, K], got "
                     f"{x_MK.shape} {x_MK.dtype} and {w_NK.shape} {w_NK.dtype}")
  call = jax.ffi.ffi_call(_FLOAT_NK_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32),
                          vmap_method="sequential")
  return call(x_MK, w_NK)


def matmul_w8a8(x_MK: jax.Array, w_KN: jax.Array, w_scale_N: jax.Array,
                prefetch_l1: bool = False) -> jax.Array:
  """f32 ``[M, N]``: per-row int8 quantization of f32 ``x`` fused with ``matmul_s8`` and both
  scales, computing exactly what ``models.quant.einsum`` computes for ``act_quant=True``
  (call only when ``available()``). ``prefetch_l1``: prefetch the next weight block into L1
  instead of L2 (same result; speed depends on the machine)."""
  m, k = x_MK.shape
  k2, n = w_KN.shape
  if (k != k2 or x_MK.dtype != jnp.float32 or w_KN.dtype != jnp.int8
      or w_scale_N.shape != (n,) or w_scale_N.dtype != jnp.float32):
    raise ValueError(f"matmul_w8a8 wants f32 [M, K], int8 [K, N], f32 [N]; got {x_MK.shape} "
                     f"{x_MK.dtype}, {w_KN.shape} {w_KN.dtype}, {w_scale_N.shape} "
                     f"{w_scale_N.dtype}")
  call = jax.ffi.ffi_call(_W8A8_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32),
                          vmap_method="sequential")
  return call(x_MK, w_KN, w_scale_N, prefetch_l1=np.int32(1 if prefetch_l1 else 0))


def matmul_w8a8_group(x_MK: jax.Array, ws_KN: Sequence[jax.Array],
                      w_scales_N: Sequence[jax.Array], prefetch_l1: bool = False
                      ) -> list[jax.Array]:
  """``[matmul_w8a8(x_MK, w, s) for w, s in zip(ws_KN, w_scales_N)]`` in one native call: ``x``
  is quantized once and every weight streamed by one task per thread. Bit-identical to the
  separate calls (exact int32 sums, the same scaling)."""
  m, k = x_MK.shape
  if (not ws_KN or len(ws_KN) != len(w_scales_N) or x_MK.dtype != jnp.float32
      or any(w.ndim != 2 or w.shape[0] != k or w.dtype != jnp.int8 for w in ws_KN)
      or any(s.shape != (w.shape[1],) or s.dtype != jnp.float32
             for w, s in zip(ws_KN, w_scales_N))):
    raise ValueError(f"matmul_w8a8_group wants f32 [M, K], int8 [K, N] weights and f32 [N] "
                     f"scales, got {x_MK.shape} {x_MK.dtype}, "
                     f"{[(w.shape, str(w.dtype)) for w in ws_KN]}, "
                     f"{[(s.shape, str(s.dtype)) for s in w_scales_N]}")
  call = jax.ffi.ffi_call(_W8A8_GROUP_TARGET,
                          [jax.ShapeDtypeStruct((m, w.shape[1]), jnp.float32) for w in ws_KN],
                          vmap_method="sequential")
  return list(call(x_MK, *ws_KN, *w_scales_N, prefetch_l1=np.int32(1 if prefetch_l1 else 0)))


def matmul_w8a8_nk(x_MK: jax.Array, w_NK: jax.Array, w_scale_N: jax.Array) -> jax.Array:
  """``matmul_w8a8`` for a weight laid out ``[N, K]`` (each output's K weights contiguous, e.g.
  a tied ``[V, D]`` embedding as the unembedding): f32 ``[M, N]``, bit-identical to the W8A8
  formula of ``models.quant.einsum`` contracting ``w``'s trailing axis (call only when
  ``available()``)."""
  m, k = x_MK.shape
  n, k2 = w_NK.shape
  if (k != k2 or x_MK.dtype != jnp.float32 or w_NK.dtype != jnp.int8
      or w_scale_N.shape != (n,) or w_scale_N.dtype != jnp.float32):
    raise ValueError(f"matmul_w8a8_nk wants f32 [M, K], int8 [N, K], f32 [N]; got {x_MK.shape} "
                     f"{x_MK.dtype}, {w_NK.shape} {w_NK.dtype}, {w_scale_N.shape} "
                     f"{w_scale_N.dtype}")
  call = jax.ffi.ffi_call(_W8A8_NK_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32),
                          vmap_method="sequential")
  return call(x_MK, w_NK, w_scale_N)


# ---- AMX (Intel Sapphire Rapids and later): bf16 tiles for decode batches of tens of rows ----

_AMX_GROUP_TARGET = "phaseserve_amx_matmul_group"
_AMX_NK_TARGET = "phaseserve_amx_matmul_nk"
_AMX_TILED_TARGET = "phaseserve_amx_tiled_group"
_AMX_W8_TARGET = "phaseserve_amx_w8_group"
_AMX_FLAGS = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512fp16",
              "-mamx-tile", "-mamx-bf16", "-mamx-int8"]
AMX_WEIGHT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int8))


def amx_available() -> bool:
  """True when the AMX kernel is loaded: the CPU lists ``amx_tile`` / ``amx_bf16`` /
  ``avx512_fp16``, Linux granted the AMX tile state (``phaseserve_amx_init``) and
  ``models/cpu/native/amx_matmul.cc`` compiled and registered. Builds on the first call."""
  return native_build.load(
      "amx_matmul", tuple(_AMX_FLAGS),
      frozenset({"amx_tile", "amx_bf16", "amx_int8", "avx512bw", "avx512vl", "avx512_fp16"}),
      ((_AMX_GROUP_TARGET, "PhaseserveAmxMatmulGroup"), (_AMX_NK_TARGET, "PhaseserveAmxMatmulNK"),
       (_AMX_TILED_TARGET, "PhaseserveAmxTiledGroup"), (_AMX_W8_TARGET, "PhaseserveAmxW8Group")),
      init="phaseserve_amx_init", optional=True) is not None


def matmul_amx_group(x_MK: jax.Array, ws_KN: Sequence[jax.Array]) -> list[jax.Array]:
  """``[x_MK @ w for w in ws_KN]`` in f32 for a bf16 ``x`` and ``[K, N]`` weights of one dtype,
  bf16 or int8 (raw values, exact in bf16; the caller applies the scales), on AMX tiles: bf16
  products (exact in f32), f32 accumulation, so the result is XLA's bf16 dot with
  ``preferred_element_type=f32`` up to summation order (call only when ``amx_available()``)."""
  return _group_call(_AMX_GROUP_TARGET, "matmul_amx_group", x_MK, ws_KN, jnp.bfloat16,
                     AMX_WEIGHT_DTYPES)


def matmul_amx_tiled_group(x_MK: jax.Array, tiles: Sequence[jax.Array], ns: Sequence[int]
                           ) -> list[jax.Array]:
  """``matmul_amx_group`` on bf16 weights given as ``tile_weight(w)`` (``quant.TiledArray``'s
  copy, which for ``K % 32 == 0`` is a sequence of AMX B tiles: nothing re-laid per call), with
  ``w``'s column counts ``ns`` (call only when ``amx_available()``)."""
  return _tiled_call(_AMX_TILED_TARGET, "matmul_amx_tiled_group", x_MK, tiles, ns,
                     (jnp.dtype(jnp.bfloat16),), 32)


def tile_weight_quads(wq_KN: jax.Array) -> jax.Array:
  """A weight-only int8 ``[K, N]`` weight as ``matmul_amx_w8_group`` reads it: ``[T, Q, 64]``
  int8 with ``T = ceil(N / 16)`` column tiles and ``Q = ceil(K / 4)`` row quads,
  ``[t, q, 4c + j] = w[4q + j, 16t + c]`` (zeros past ``w``); for ``K % 64 == 0`` a sequence of
  AMX int8 B tiles."""
  k, n = wq_KN.shape
  if wq_KN.dtype != jnp.int8:
    raise ValueError(f"tile_weight_quads wants int8 values, got {wq_KN.dtype}")
  q, t = -(-k // 4), -(-n // TILE_COLUMNS)
  w = jnp.pad(wq_KN, ((0, 4 * q - k), (0, TILE_COLUMNS * t - n)))
  return w.reshape(q, 4, t, TILE_COLUMNS).transpose(2, 0, 3, 1).reshape(t, q, 4 * TILE_COLUMNS)


def matmul_amx_w8_group(x_MK: jax.Array, tiles: Sequence[jax.Array], ns: Sequence[int]
                        ) -> list[jax.Array]:
  """f32 ``[x_MK @ w for w in ...]`` for bf16 ``x`` and weight-only int8 weights given as
  ``tile_weight_quads(w)`` (the raw values: the caller applies the scales) with ``w``'s column
  counts ``ns``, ``K % 64 == 0``, on AMX's int8 products (call only when ``amx_available()``):
  each row of x quantized to 16 bits (``rint(x * 32767 / max|x|)``) and split into two int8
  halves, each product exact in int32, so the result is that quantized x times w up to f32
  rounding."""
  m, k = x_MK.shape
  if (x_MK.dtype != jnp.bfloat16 or k % 64 or not tiles or len(tiles) != len(ns)
      or any(t.dtype != jnp.int8 or t.shape != (-(-n // TILE_COLUMNS), k // 4, 4 * TILE_COLUMNS)
             for t, n in zip(tiles, ns))):
    raise ValueError(f"matmul_amx_w8_group wants bf16 [M, K] (K % 64 == 0) and int8 "
                     f"[ceil(N/16), K/4, 64] tiles, got {x_MK.shape} {x_MK.dtype}, "
                     f"{[(t.shape, str(t.dtype)) for t in tiles]} for N {list(ns)}")
  call = jax.ffi.ffi_call(_AMX_W8_TARGET, [jax.ShapeDtypeStruct((m, n), jnp.float32) for n in ns],
                          vmap_method="sequential")
  return list(call(x_MK, *tiles))


def matmul_amx_nk(x_MK: jax.Array, w_NK: jax.Array) -> jax.Array:
  """``matmul_amx_group`` for one weight laid out ``[N, K]`` (a tied ``[V, D]`` unembedding):
  f32 ``x_MK @ w_NK.T`` (call only when ``amx_available()``)."""
  m, k = x_MK.shape
  if (x_MK.dtype != jnp.bfloat16 or w_NK.dtype not in AMX_WEIGHT_DTYPES or w_NK.ndim != 2
      or w_NK.shape[1] != k):
    raise ValueError(f"matmul_amx_nk wants bf16 [M, K] and a bf16|int8 [N, K] weight, got "
                     f"{x_MK.shape} {x_MK.dtype} and {w_NK.shape} {w_NK.dtype}")
  call = jax.ffi.ffi_call(_AMX_NK_TARGET, jax.ShapeDtypeStruct((m, w_NK.shape[0]), jnp.float32),
                          vmap_method="sequential")
  return call(x_MK, w_NK)

# ---- AVX512-BF16 (AMD Zen 4 / Zen 5, Intel Cooper Lake and later): vdpbf16ps for decode rows ----

_DPBF16_GROUP_TARGET = "phaseserve_dpbf16_matmul_group"
_DPBF16_NK_TARGET = "phaseserve_dpbf16_matmul_nk"
_DPBF16_FLAGS = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                 "-mavx512bf16"]


def dpbf16_available() -> bool:
  """True when the AVX512-BF16 kernel is loaded: the CPU lists ``avx512_bf16`` and
  ``models/cpu/native/dpbf16_matmul.cc`` compiled and registered. Builds on the first call."""
  return native_build.load(
      "dpbf16_matmul", tuple(_DPBF16_FLAGS),
      frozenset({"avx512_bf16", "avx512bw", "avx512vl", "avx512dq"}),
      ((_DPBF16_GROUP_TARGET, "PhaseserveDpbf16MatmulGroup"),
       (_DPBF16_NK_TARGET, "PhaseserveDpbf16MatmulNK")), optional=True) is not None


def matmul_dpbf16_group(x_MK: jax.Array, ws_KN: Sequence[jax.Array]) -> list[jax.Array]:
  """``matmul_amx_group``'s contract on AVX512-BF16 dot products (bf16 pairs multiplied exactly,
  f32 sums): f32 ``[x_MK @ w for w in ws_KN]`` for a bf16 ``x`` and ``[K, N]`` bf16 or int8
  weights of one dtype (call only when ``dpbf16_available()``)."""
  return _group_call(_DPBF16_GROUP_TARGET, "matmul_dpbf16_group", x_MK, ws_KN, jnp.bfloat16,
                     AMX_WEIGHT_DTYPES)


def matmul_dpbf16_nk(x_MK: jax.Array, w_NK: jax.Array) -> jax.Array:
  """``matmul_dpbf16_group`` for one weight laid out ``[N, K]`` (a tied ``[V, D]``
  unembedding): f32 ``x_MK @ w_NK.T`` (call only when ``dpbf16_available()``)."""
  m, k = x_MK.shape
  if (x_MK.dtype != jnp.bfloat16 or w_NK.dtype not in AMX_WEIGHT_DTYPES or w_NK.ndim != 2
      or w_NK.shape[1] != k):
    raise ValueError(f"matmul_dpbf16_nk wants bf16 [M, K] and a bf16|int8 [N, K] weight, got "
                     f"{x_MK.shape} {x_MK.dtype} and {w_NK.shape} {w_NK.dtype}")
  call = jax.ffi.ffi_call(_DPBF16_NK_TARGET,
                          jax.ShapeDtypeStruct((m, w_NK.shape[0]), jnp.float32),
                          vmap_method="sequential")
  return call(x_MK, w_NK)

# ---- Column tiles of K pairs (AVX512-BF16): decode rows as vector lanes ----

_TILED_GROUP_TARGET = "phaseserve_tiled_matmul_group"
TILE_COLUMNS = 16


def tiled_available() -> bool:
  """True when ``models/cpu/native/tiled_matmul.cc`` is loaded (the CPU lists ``avx512_bf16``);
  builds on the first call."""
  return native_build.load(
      "tiled_matmul", tuple(_DPBF16_FLAGS),
      frozenset({"avx512_bf16", "avx512bw", "avx512vl", "avx512dq"}),
      ((_TILED_GROUP_TARGET, "PhaseserveTiledMatmulGroup"),), optional=True) is not None


def tile_weight(w_KN: jax.Array) -> jax.Array:
  """A ``[K, N]`` weight as the tiled kernel reads it: ``[T, P, 32]`` (int8 stays int8, any
  float becomes bf16) with ``T = ceil(N / 16)`` column tiles and ``P = ceil(K / 2)`` row pairs,
  ``[t, p, 2c + j] = w[2p + j, 16t + c]`` (zeros past ``w``)."""
  k, n = w_KN.shape
  p, t = -(-k // 2), -(-n // TILE_COLUMNS)
  dtype = jnp.int8 if w_KN.dtype == jnp.int8 else jnp.bfloat16
  w = jnp.pad(w_KN.astype(dtype), ((0, 2 * p - k), (0, TILE_COLUMNS * t - n)))
  return w.reshape(p, 2, t, TILE_COLUMNS).transpose(2, 0, 3, 1).reshape(t, p, 2 * TILE_COLUMNS)


def matmul_tiled_group(x_MK: jax.Array, tiles: Sequence[jax.Array], ns: Sequence[int]
                       ) -> list[jax.Array]:
  """f32 ``[x_MK @ w for w in ...]`` for a bf16 ``x`` and weights of one dtype given as
  ``tile_weight(w)`` with ``w``'s column counts ``ns``, in one call (call only when
  ``tiled_available()``; int8: the raw values, the caller applies the scales): bf16 products
  (exact in f32), f32 sums, so XLA's bf16 dot with ``preferred_element_type=f32`` up to
  summation order."""
  return _tiled_call(_TILED_GROUP_TARGET, "matmul_tiled_group", x_MK, tiles, ns,
                     AMX_WEIGHT_DTYPES, 1)


def _tiled_call(target: str, name: str, x_MK: jax.Array, tiles: Sequence[jax.Array],
                ns: Sequence[int], dtypes: tuple, k_multiple: int) -> list[jax.Array]:
  """One call of a tiled-weight FFI target: bf16 ``x_MK`` times ``tile_weight`` copies of one
  dtype among ``dtypes`` (``[ceil(N/16), ceil(K/2), 32]`` for the column counts ``ns``), K a
  multiple of ``k_multiple``; f32 ``[M, N]`` results. Bad operands raise ``ValueError``."""
  m, k = x_MK.shape
  p = -(-k // 2)
  if (x_MK.dtype != jnp.bfloat16 or k % k_multiple or not tiles or len(tiles) != len(ns)
      or tiles[0].dtype not in dtypes
      or any(t.dtype != tiles[0].dtype
             or t.shape != (-(-n // TILE_COLUMNS), p, 2 * TILE_COLUMNS)
             for t, n in zip(tiles, ns))):
    raise ValueError(f"{name} wants bf16 [M, K] (K % {k_multiple} == 0) and "
                     f"[ceil(N/16), ceil(K/2), 32] tiles of one dtype "
                     f"({'|'.join(jnp.dtype(d).name for d in dtypes)}), got {x_MK.shape} "
                     f"{x_MK.dtype}, {[(t.shape, str(t.dtype)) for t in tiles]} for N {list(ns)}")
  call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct((m, n), jnp.float32) for n in ns],
                          vmap_method="sequential")
  return list(call(x_MK, *tiles))

# ---- W8A8 in column tiles of K quads (AVX512-VNNI): decode rows as vector lanes ----

_TILED_W8A8_TARGET = "phaseserve_tiled_w8a8_group"
_VNNI_FLAGS = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
               "-mavx512vnni"]


def tiled_w8a8_available() -> bool:
  """True when ``models/cpu/native/tiled_w8a8.cc`` is loaded (the CPU lists ``avx512_vnni``);
  builds on the first call."""
  return native_build.load(
      "tiled_w8a8", tuple(_VNNI_FLAGS),
      frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}),
      ((_TILED_W8A8_TARGET, "PhaseserveTiledW8A8Group"),), optional=True) is not None


def tile_weight_w8a8(wq_KN: jax.Array) -> jax.Array:
  """An int8 ``[K, N]`` weight as the W8A8 tiled kernel reads it: ``[T, Q, 64]`` uint8 (the
  value + 128) with ``T = ceil(N / 16)`` column tiles and ``Q = ceil(K / 4)`` row quads,
  ``[t, q, 4c + j] = w[4q + j, 16t + c] + 128`` (128 past ``w``)."""
  k, n = wq_KN.shape
  if wq_KN.dtype != jnp.int8:
    raise ValueError(f"tile_weight_w8a8 wants int8 values, got {wq_KN.dtype}")
  q, t = -(-k // 4), -(-n // TILE_COLUMNS)
  w = (jnp.pad(wq_KN, ((0, 4 * q - k), (0, TILE_COLUMNS * t - n))).astype(jnp.int32) + 128
       ).astype(jnp.uint8)
  return w.reshape(q, 4, t, TILE_COLUMNS).transpose(2, 0, 3, 1).reshape(t, q, 4 * TILE_COLUMNS)


def matmul_tiled_w8a8_group(x_MK: jax.Array, tiles: Sequence[jax.Array], ns: Sequence[int]
                            ) -> list[jax.Array]:
  """f32 ``[quant(x_MK) @ w * x_scale for w in ...]`` for a bf16 or f32 ``x`` quantized per row
  (``models.cpu.lowering.quantize_activations``) and int8 weights given as
  ``tile_weight_w8a8(w)`` with ``w``'s column counts ``ns``, in one call (call only when
  ``tiled_w8a8_available()``; the caller applies the weights' scales). Integer sums are exact."""
  m, k = x_MK.shape
  q = -(-k // 4)
  if (x_MK.dtype not in (jnp.bfloat16, jnp.float32) or not tiles or len(tiles) != len(ns)
      or any(t.dtype != jnp.uint8 or t.shape != (-(-n // TILE_COLUMNS), q, 4 * TILE_COLUMNS)
             for t, n in zip(tiles, ns))):
    raise ValueError(f"matmul_tiled_w8a8_group wants bf16|f32 [M, K] and uint8 [ceil(N/16), "
                     f"ceil(K/4), 64] tiles, got {x_MK.shape} {x_MK.dtype}, "
                     f"{[(t.shape, str(t.dtype)) for t in tiles]} for N {list(ns)}")
  call = jax.ffi.ffi_call(_TILED_W8A8_TARGET,
                          [jax.ShapeDtypeStruct((m, n), jnp.float32) for n in ns],
                          vmap_method="sequential")
  return list(call(x_MK, *tiles))


# ---- Multi-LoRA: each row's own adapter (models/cpu/native/lora_matmul.cc) ----

_LORA_TARGET = "phaseserve_lora_group"


def lora_available() -> bool:
  """True when the LoRA kernel is loaded (AVX-512 F / BW / VL). Builds on the first call."""
  return native_build.load(
      "lora_matmul", tuple(_FLAGS[:6]), frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
      ((_LORA_TARGET, "PhaseserveLoraGroup"),), optional=True) is not None


def lora_group(x_MI: jax.Array, slot_M: jax.Array, layer: jax.Array | int,
               pairs: Sequence[tuple[jax.Array, jax.Array]], slots: int) -> list[jax.Array]:
  """f32 ``[M, O]`` per pair: row m's ``(x @ a[l, :, s E:(s+1) E]) @ b[l, s E:(s+1) E]`` for its
  slot ``s = slot_M[m]`` (out of ``[0, slots)``: zeros) at layer ``l = layer``; ``x`` and the
  weights bf16 or f32, one dtype, ``E % 16 == 0`` (call only when ``lora_available()``)."""
  m = x_MI.shape[0]
  call = jax.ffi.ffi_call(_LORA_TARGET, [jax.ShapeDtypeStruct((m, b.shape[2]), jnp.float32)
                                         for _, b in pairs])
  flat = [w for pair in pairs for w in pair]
  return list(call(x_MI, slot_M.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32),
                   *flat, slots=np.int64(slots)))
