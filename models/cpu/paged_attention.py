"""A native XLA:CPU decode attention that reads the KV page pool through the page table.

Contract:
  * ``available()``: the library is loaded (``models.cpu.build.load``: CPU backend, AVX-512 F,
    ``models/cpu/native/paged_attention.cc`` compiled); ``bf16_dot_supported()``: the CPU has
    AVX-512 BF16. Callers choose through ``models.cpu.backend.CpuBackend``.
  * ``supported(n_heads, kv_heads, head_dim, dtype)``: ``head_dim % 16 == 0``, at most 16 query
    heads per kv head, pages f32, bf16 or int8.
  * ``decode_attention(q_BNH, k_pages, v_pages, table_BM, pos_B, layer, max_keys, bf16_dot,
    prefetch_l2)``
    -> f32 ``[B, N, H]``: softmax attention of each (pre-scaled) query over keys
    ``s < min(pos_B[b] + 1, max_keys)`` of pool ``[L, P, K, Z, H]`` (int8 pools: ``QuantArray``
    with per-token scales), key ``s`` at page ``table_BM[b, s // Z]``; a table entry outside
    ``[0, P)`` reads as zeros; a row with no visible key gives zeros. ``layer`` may be traced.
  * ``attend_paged(q_BTNH, ...)``: the same, called as ``models.attention.attend`` is.
  * ``prefetch_l2``: where the next page is prefetched (L2, else L1; the backend policy's
    ``attention_prefetch_l2``, raced at start-up); the outputs do not depend on it.
  * ``amx_blocks`` (only where AMX is available and granted: ``CpuBackend.amx``): rows of one
    sequence at consecutive positions (a prefill chunk, a token a row) run in blocks of up to 16
    on AMX tiles (``native/attention_blocks.h``), each page read once a block; bf16 pages on
    the ``bf16_dot`` path only, head size and page size multiples of 32; the same numerics as
    that path (q and the probabilities rounded to bf16), up to summation order.
  * Numerics: f32 products and sums, online softmax: the gather path up to summation order;
    ``bf16_dot`` (int8 pools, or bf16 pools with a bf16 query) rounds q and the probabilities
    to bf16 (relative error ~1e-3).
"""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np

from models.cpu import build as native_build, cpuinfo
from models.quant import QuantArray

Pages = jax.Array | QuantArray  # as models.paged_kv.Pages (int8 values + float32 scales)

_TARGET = "phaseserve_paged_decode_attention"
_FLAGS = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
          "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]  # AMX only runs under amx_blocks
MAX_GROUP = 16


def _lib():
  return native_build.load("paged_attention", tuple(_FLAGS), frozenset({"avx512f"}),
                           ((_TARGET, "PhaseservePagedDecodeAttention"),))


def available() -> bool:
  """True when the kernel is loaded (see the module contract); builds on the first call."""
  return _lib() is not None


def block_rows(pos_R: np.ndarray, table_RM: np.ndarray) -> np.ndarray:
  """The ``amx_blocks`` path's plan for rows at ``pos_R`` through ``table_RM`` (the kernel's own
  function): ``[R]`` int64, the rows of the unit starting at each row (1: the row path), 0
  inside a block. Call only when ``available()``."""
  pos = np.ascontiguousarray(pos_R, np.int32)
  table = np.ascontiguousarray(table_RM, np.int32)
  out = np.zeros(pos.shape[0], np.int64)
  lib = _lib()
  assert lib is not None, "block_rows needs the native kernel"
  ptr = lambda a, t: a.ctypes.data_as(ctypes.POINTER(t))  # noqa: E731
  lib.phaseserve_attention_blocks(ptr(pos, ctypes.c_int32), ptr(table, ctypes.c_int32),
                                  ctypes.c_int64(pos.shape[0]), ctypes.c_int64(table.shape[1]),
                                  ptr(out, ctypes.c_int64))
  return out


def bf16_dot_supported() -> bool:
  """Whether the CPU has the AVX-512 BF16 dot product the ``bf16_dot`` path needs."""
  return "avx512_bf16" in cpuinfo.flags()


def supported(n_heads: int, kv_heads: int, head_dim: int, dtype) -> bool:
  return (head_dim % 16 == 0 and n_heads % kv_heads == 0 and n_heads // kv_heads <= MAX_GROUP
          and jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                                   jnp.dtype(jnp.int8)))


def decode_attention(q_BNH: jax.Array, k_pages: Pages, v_pages: Pages, table_BM: jax.Array,
                     pos_B: jax.Array, layer: int | jax.Array, max_keys: int,
                     bf16_dot: bool = False, prefetch_l2: bool = True,
                     amx_blocks: bool = False) -> jax.Array:
  """See the module contract (call only when ``available()`` and ``supported(...)``)."""
  b, n, h = q_BNH.shape
  if isinstance(k_pages, QuantArray) and isinstance(v_pages, QuantArray):
    k_arr, k_scale, v_arr, v_scale = k_pages.quant, k_pages.scale, v_pages.quant, v_pages.scale
  else:
    assert not isinstance(k_pages, QuantArray) and not isinstance(v_pages, QuantArray)
    k_arr, v_arr = k_pages, v_pages
    k_scale = v_scale = jnp.zeros((1,), jnp.float32)
  if (k_arr.ndim != 5 or k_arr.shape != v_arr.shape or k_arr.dtype != v_arr.dtype
      or not supported(n, k_arr.shape[2], h, k_arr.dtype) or k_arr.shape[4] != h
      or table_BM.shape[0] != b or pos_B.shape != (b,)):
    raise ValueError(f"decode_attention: unsupported shapes q {q_BNH.shape}, pages "
                     f"{k_arr.shape} {k_arr.dtype}, table {table_BM.shape}, pos {pos_B.shape}")
  call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((b, n, h), jnp.float32),
                          vmap_method="sequential")
  return call(q_BNH.astype(jnp.float32), k_arr, v_arr, k_scale.astype(jnp.float32),
              v_scale.astype(jnp.float32), table_BM.astype(jnp.int32),
              pos_B.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(()),
              max_keys=np.int64(max_keys),
              bf16_dot=np.int32(1 if _dot_path(bf16_dot, q_BNH.dtype, k_arr.dtype) else 0),
              prefetch_l2=np.int32(1 if prefetch_l2 else 0),
              amx_blocks=np.int32(1 if amx_blocks else 0))


def attend_paged(q_BTNH: jax.Array, k_pages: Pages, v_pages: Pages, table_BM: jax.Array,
                 pos_BT: jax.Array, layer: int | jax.Array, max_keys: int,
                 bf16_dot: bool = False, prefetch_l2: bool = True,
                 amx_blocks: bool = False) -> jax.Array:
  """``models.attention.attend`` of every query of a chunk over a pool read through
  ``table_BM`` (``[B, T, N, H]`` in q's dtype; q scaled by ``H ** -0.5`` and rounded to its
  dtype as ``attend`` does): query t of row b is one row of ``decode_attention`` at position
  ``pos_BT[b, t]`` with row b's table, so it reads keys ``s <= pos_BT[b, t]`` (causal within
  the chunk once the chunk's keys are written). The work follows the positions, not
  ``max_keys`` (only a bound), so callers need not bucket the attended length.
  Call only when ``available()`` and ``supported``."""
  b, t, n, h = q_BTNH.shape
  q_RNH = (q_BTNH.reshape(b * t, n, h).astype(jnp.float32) * (h ** -0.5)).astype(q_BTNH.dtype)
  table_RM = table_BM if t == 1 else jnp.repeat(table_BM, t, axis=0)  # R = B * T rows
  out_RNH = decode_attention(q_RNH, k_pages, v_pages, table_RM, pos_BT.reshape(b * t), layer,
                             max_keys, bf16_dot, prefetch_l2, amx_blocks)
  return out_RNH.reshape(b, t, n, h).astype(q_BTNH.dtype)


def _dot_path(bf16_dot: bool, q_dtype, pages_dtype) -> bool:
  """The BF16 dot-product loops (when ``bf16_dot``) round q to bf16: exact for a bf16 query, so
  bf16 pools take them only then; int8 pools take them for any query (within the int8 KV's own
  error)."""
  if not bf16_dot:
    return False
  return jnp.dtype(pages_dtype) == jnp.dtype(jnp.int8) or (
      jnp.dtype(q_dtype) == jnp.dtype(jnp.bfloat16))


__all__ = ["available", "block_rows", "bf16_dot_supported", "supported", "decode_attention", "attend_paged",
           "MAX_GROUP"]
