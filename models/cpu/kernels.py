"""Native XLA:CPU kernels for the few-row matmuls of decode: int8 x int8 -> int32 (alone or with
the W8A8 activation quantization fused in), and f32 x (f32 | bf16) -> f32.

Contract:
  * ``available()`` says whether the kernels can be used in this process: the default backend is
    CPU, the CPU has AVX-512 BW + VBMI + VNNI, ``PHASESERVE_NATIVE_KERNELS`` is not ``0``, and the
    C++ source ``models/cpu/native/matmul_kernels.cc`` compiled (``c++`` / ``g++``) against
    ``jax.ffi.include_dir()`` and registered as the XLA FFI targets ``phaseserve_int8_matmul``,
    ``phaseserve_w8a8_matmul``, ``phaseserve_w8a8_nk_matmul``, ``phaseserve_float_matmul``,
    ``phaseserve_float_nk_matmul`` and the two ``*_group`` targets below. The shared library is
    cached under ``$PHASESERVE_CACHE_DIR`` (default ``~/.cache/phaseserve``), keyed by the
    source, jax version and compiler flags; any failure means ``False`` (callers fall back to
    XLA's own dot) and is logged once.
  * ``matmul_s8(x_MK, w_KN)`` returns ``x @ w`` as int32 ``[M, N]``: exact integer arithmetic,
    bit-identical to ``lax.dot_general(..., preferred_element_type=jnp.int32)``.
  * ``matmul_w8a8(x_MK, w_KN, w_scale_N)``: f32 ``[M, N]``, bit-identical to the W8A8 formula of
    ``models.quant.einsum`` as XLA compiles it (per-row scale amax * (1 / 127), round-half-even,
    clip to +-127, int32 dot, ``* row_scale * w_scale``), in one call.
  * ``matmul_w8a8_nk(x_MK, w_NK, w_scale_N)``: the same for a weight laid out ``[N, K]`` (the
    tied ``[V, D]`` embedding as the unembedding, contracted on its trailing axis), bit-identical
    to XLA's int8 dot contracting ``w``'s axis 1.
  * ``matmul_float(x_MK, w_KN)``: f32 ``x`` times an f32, bf16 or int8 (raw values) ``w``, f32
    products and f32 accumulation (what XLA computes for ``preferred_element_type=f32``; bf16 x
    bf16 products are exact in f32), up to summation order. ``matmul_float_nk``: the same for
    ``[N, K]``.
  * ``matmul_float_group(x_MK, ws_KN)`` / ``matmul_w8a8_group(x_MK, ws_KN, w_scales_N)``: the
    list of ``matmul_float`` / ``matmul_w8a8`` products of one activation with several weights
    (one dtype), in ONE call (targets ``phaseserve_float_matmul_group`` /
    ``phaseserve_w8a8_matmul_group``, variadic operands): one task per thread streams its K
    share of every weight in turn, so a group pays one fan-out and one join instead of one per
    weight (W8A8: x is quantized once; bit-identical to separate calls).
  * ``amx_available()`` / ``matmul_amx_group(x_MK, ws_KN)`` / ``matmul_amx_nk(x_MK, w_NK)``:
    bf16 activations times bf16 or int8 (raw values) weights on Intel AMX tiles (separate library
    ``models/cpu/native/amx_matmul.cc``, built with AMX flags, loaded only where the CPU lists
    ``amx_tile`` / ``amx_bf16`` / ``avx512_fp16`` and the OS grants the tile state): f32 results,
    bf16 products exact in f32, f32 accumulation, so XLA's bf16 dot up to summation order.
  Callers: ``models.quant.einsum`` / ``einsums`` (for at most the ``models.cpu.lowering`` policy's
  ``*_native_max_rows`` rows, or in its ``amx_*_rows`` ranges) and the measurements of
  ``models.cpu.lowering``.

Why: XLA:CPU reads decode-shaped (few-row) weights at a fraction of memory bandwidth except for
f32 with exactly one row. Its int8 and bf16 dots (YNNPACK) repack the weight on every call (about
3x slower than these kernels for int8 at batch 1 on the 2-core dev machine; see
launch/lab/bench_model.py and the perf notes), and f32 with 2..16 rows is about half as fast as one
row. These kernels stream the ``[K, N]`` row-major weight as stored (no repacking, no transposed
copy; ``weights.py`` layouts unchanged) in blocks of 16 (int8) or 8 (float) rows, prefetching
the next block into L2 (short rows starve the hardware prefetchers), over tiles of 32 columns x
up to 8 activation rows held in registers. int8: per 4 rows x 16 columns one ``vpermb`` makes
the dot-product groups and AVX-512 VNNI ``vpdpbusd`` accumulates ``(w + 128) . x`` (the
``128 * sum(x)`` excess is subtracted at the end). Float: bf16 is widened to f32 in registers,
then FMA. The K range is split over XLA's intra-op thread pool (each part streams a contiguous
slab; partial sums are added at the end). ``[N, K]`` int8: per block of 16 contiguous weight
rows, one accumulator per row (``vpdpbusd`` over 64-byte K steps) and a transpose-reduce of the
16 accumulators into 16 sums; the N range is split over the pool. For many rows (prefill) XLA's
dots are faster (the crossover is measured per machine by ``models.cpu.lowering``).
AMX: with tens of rows the FMA kernels run out of compute (64 FLOPs per cycle per core) and
XLA's bf16 dot re-packs each weight at ~8-10 GB/s; the AMX kernel streams the weight's rows in
long runs, re-lays them into B tiles in L2 (int8 widened to bf16 through fp16 on the way) and
multiplies at ~2 TFLOP/s per core (see amx_matmul.cc and BUILD_NOTES "AMX tiles for decode
batches").
Inside ``shard_map`` the kernels run on each shard's local block like any op; under automatic
(GSPMD) partitioning a custom call is not partitioned, so sharded weights would be gathered: the
``partitioning`` layouts use ``shard_map``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
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
_lock = threading.Lock()
_state: dict[str, object] = {}



_FLAGS = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
          "-mavx512vnni", "-mavx512vbmi"]


def available() -> bool:
  """True when the kernels may be used (see the module contract); builds on first call."""
  if os.environ.get("PHASESERVE_NATIVE_KERNELS", "1") == "0":
    return False
  if jax.default_backend() != "cpu":
    return False
  with _lock:
    if "ok" not in _state:
      try:
        need = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi"}
        missing = need - native_build.cpu_flags()
        if missing:
          raise RuntimeError(f"CPU lacks {sorted(missing)}")
        lib = ctypes.cdll.LoadLibrary(native_build.build(
            "matmul_kernels", native_build.source("matmul_kernels"), _FLAGS))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.PhaseserveInt8Matmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(_FLOAT_TARGET, jax.ffi.pycapsule(lib.PhaseserveFloatMatmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(_FLOAT_NK_TARGET,
                                    jax.ffi.pycapsule(lib.PhaseserveFloatNKMatmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(_W8A8_TARGET, jax.ffi.pycapsule(lib.PhaseserveW8A8Matmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(_W8A8_NK_TARGET,
                                    jax.ffi.pycapsule(lib.PhaseserveW8A8NKMatmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(_FLOAT_GROUP_TARGET,
                                    jax.ffi.pycapsule(lib.PhaseserveFloatMatmulGroup),
                                    platform="cpu")
        jax.ffi.register_ffi_target(_W8A8_GROUP_TARGET,
                                    jax.ffi.pycapsule(lib.PhaseserveW8A8MatmulGroup),
                                    platform="cpu")
        _state["lib"] = lib
        _state["ok"] = True
      except Exception as e:  # noqa: BLE001 - any failure means "use XLA's dot"
        logging.getLogger(__name__).warning("native CPU kernels unavailable: %s", e)
        _state["ok"] = False
    return bool(_state["ok"])


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
_AMX_FLAGS = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512fp16",
              "-mamx-tile", "-mamx-bf16"]
AMX_WEIGHT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int8))


def amx_available() -> bool:
  """True when the AMX kernel may be used: ``available()``'s conditions (backend, env switch),
  the CPU lists ``amx_tile`` and ``amx_bf16``, Linux granted this process the AMX tile state
  (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), and ``models/cpu/native/amx_matmul.cc`` compiled and
  registered as ``phaseserve_amx_matmul_group`` / ``phaseserve_amx_matmul_nk``. Builds on first call; any failure is False
  (logged once)."""
  if os.environ.get("PHASESERVE_NATIVE_KERNELS", "1") == "0" or jax.default_backend() != "cpu":
    return False
  with _lock:
    if "amx_ok" not in _state:
      try:
        missing = ({"amx_tile", "amx_bf16", "avx512bw", "avx512vl", "avx512_fp16"}
                   - native_build.cpu_flags())
        if missing:
          raise RuntimeError(f"CPU lacks {sorted(missing)}")
        lib = ctypes.cdll.LoadLibrary(native_build.build(
            "amx_matmul", native_build.source("amx_matmul"), _AMX_FLAGS))
        if lib.phaseserve_amx_init() != 0:
          raise RuntimeError("the OS refused the AMX tile state (arch_prctl XCOMP_PERM)")
        jax.ffi.register_ffi_target(_AMX_GROUP_TARGET,
                                    jax.ffi.pycapsule(lib.PhaseserveAmxMatmulGroup),
                                    platform="cpu")
        jax.ffi.register_ffi_target(_AMX_NK_TARGET, jax.ffi.pycapsule(lib.PhaseserveAmxMatmulNK),
                                    platform="cpu")
        _state["amx_lib"] = lib
        _state["amx_ok"] = True
      except Exception as e:  # noqa: BLE001 - any failure means "not this kernel"
        logging.getLogger(__name__).info("AMX kernel unavailable: %s", e)
        _state["amx_ok"] = False
    return bool(_state["amx_ok"])


def matmul_amx_group(x_MK: jax.Array, ws_KN: Sequence[jax.Array]) -> list[jax.Array]:
  """``[x_MK @ w for w in ws_KN]`` in f32 for a bf16 ``x`` and ``[K, N]`` weights of one dtype,
  bf16 or int8 (raw values, exact in bf16; the caller applies the scales), on AMX tiles: bf16
  products (exact in f32), f32 accumulation, so the result is XLA's bf16 dot with
  ``preferred_element_type=f32`` up to summation order (call only when ``amx_available()``)."""
  return _group_call(_AMX_GROUP_TARGET, "matmul_amx_group", x_MK, ws_KN, jnp.bfloat16,
                     AMX_WEIGHT_DTYPES)


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
