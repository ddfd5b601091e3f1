"""A native XLA:CPU decode attention that reads the KV page pool through the page table.

Contract:
  * ``available() -> bool``: the default backend is CPU, the CPU has AVX-512 F, the environment
    does not say ``PHASESERVE_NATIVE_KERNELS=0``, and the C++ in
    ``models/cpu/native/paged_attention.cc`` compiled (``models.cpu.build``) and registered as
    the XLA FFI target ``phaseserve_paged_decode_attention``. Any failure means ``False``
    (logged once); the caller then uses the gather + ``models.attention.attend`` path.
  * ``supported(n_heads, kv_heads, head_dim, dtype) -> bool``: shapes and dtypes the kernel takes
    (``head_dim % 16 == 0``, at most 16 query heads per kv head, pages f32, bf16 or int8).
  * ``decode_attention(q_BNH, k_pages, v_pages, table_BM, pos_B, layer, max_keys) -> [B, N, H]``
    f32 (``k_pages`` / ``v_pages``: arrays, or for int8 pools ``QuantArray`` of int8 values and
    float32 scales ``[L, P, K, Z, 1]``, one per token and kv head): for row b and query head n
    (kv head ``n // G``), softmax attention of ``q_BNH[b, n]`` (f32, already scaled by
    ``H ** -0.5`` and rounded as the caller wants) over keys ``s < min(pos_B[b] + 1,
    max_keys)`` of layer ``layer`` (an int, or a traced int32 scalar such as a ``lax.scan``'s
    layer index: an operand of the call) of the pool ``[L, P, K, Z, H]``,
    key ``s`` read at page ``table_BM[b, s // Z]``, offset ``s % Z``. A table entry outside
    ``[0, P)`` reads as zeros (the null page of ``models.paged_kv``). A row with no visible key
    gives zeros. Only the visible keys are touched: nothing is gathered or materialised.
  * ``attend_paged(q_BTNH, k_pages, v_pages, table_BM, pos_BT, layer, max_keys)``:
    ``decode_attention`` as ``models.attention.attend`` is called, each of the T queries of a
    row one kernel row (``[B, T, N, H]`` in q's dtype; q scaled and rounded as ``attend``
    does). Callers: ``models.paged_kv.PagedKV`` (decode and prefill chunks) and
    ``models.kv_cache.KVCache`` (decode; a contiguous cache ``[L, B, K, S, H]`` is a pool of one
    page of ``S`` positions per row: table ``[[0], [1], ...]``).
  * Numerics: f32 products and accumulation, an online softmax over pages (as FlashAttention)
    with a polynomial ``exp`` (relative error below 1e-6); equal to the gather path up to
    summation order (and, for bf16 pages, up to the gather path's rounding of the probabilities
    to bf16 before the value product: this kernel keeps them f32; for int8 pages, up to the
    order in which the scales are applied: a key's logit times its K scale, each probability
    times its V scale). With AVX-512 BF16, int8 pages also round an f32 query and the
    probabilities to bf16 (relative error ~1e-3, below the int8 KV's own ~1e-2); bf16 pages take
    that path only for a bf16 query, where the rounding is exact.

How: one work item per (row, kv head), handed out to XLA's intra-op threads from an atomic
counter (rows of unequal length balance themselves). Per page: the G query heads' logits
(one row of K per key, dot over H in 16-lane FMAs), the running max / sum update, then the value
product with the G x H accumulators held across the page's keys. int8 pages: with AVX-512 BF16
(and Z % 16 == 0, H % 32 == 0) each page's K and V are widened to bf16 scratch (exact) and run
the bf16 loops, the logits times the K scales and the probabilities times the V scales; without
it, K is widened to f32 (scale folded in) once per page and V in registers. Measured on the
Zen 5 dev VM (SmolLM2 shapes, batch 8, context 2048): BUILD_NOTES.md "int8 KV cache".
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from models.cpu import build as native_build
from models.quant import QuantArray

Pages = jax.Array | QuantArray  # as models.paged_kv.Pages (int8 values + float32 scales)

_TARGET = "phaseserve_paged_decode_attention"
_FLAGS = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
          "-mavx512bf16"]
_lock = threading.Lock()
_state: dict[str, object] = {}
MAX_GROUP = 16


def available() -> bool:
  """True when the kernel may be used (see the module contract); builds on first call."""
  if os.environ.get("PHASESERVE_NATIVE_KERNELS", "1") == "0":
    return False
  if jax.default_backend() != "cpu":
    return False
  with _lock:
    if "ok" not in _state:
      try:
        if "avx512f" not in native_build.cpu_flags():
          raise RuntimeError("CPU lacks avx512f")
        lib = ctypes.cdll.LoadLibrary(native_build.build(
            "paged_attention", native_build.source("paged_attention"), _FLAGS))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.PhaseservePagedDecodeAttention),
                                    platform="cpu")
        _state["ok"] = True
      except Exception as e:  # noqa: BLE001 - any failure means "use the gather path"
        logging.getLogger(__name__).warning("native paged attention unavailable: %s", e)
        _state["ok"] = False
    return bool(_state["ok"])


def supported(n_heads: int, kv_heads: int, head_dim: int, dtype) -> bool:
  return (head_dim % 16 == 0 and n_heads % kv_heads == 0 and n_heads // kv_heads <= MAX_GROUP
          and jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                                   jnp.dtype(jnp.int8)))


def decode_attention(q_BNH: jax.Array, k_pages: Pages, v_pages: Pages, table_BM: jax.Array,
                     pos_B: jax.Array, layer: int | jax.Array, max_keys: int) -> jax.Array:
  """See the module contract (call only when ``available()`` and ``supported(...)``)."""
  if not available():
    raise RuntimeError("the native paged attention is not available in this process")
  b, n, h = q_BNH.shape
  if isinstance(k_pages, QuantArray) and isinstance(v_pages, QuantArray):
    (k_pages, k_scale), (v_pages, v_scale) = ((k_pages.quant, k_pages.scale),
                                              (v_pages.quant, v_pages.scale))
  else:
    k_scale = v_scale = jnp.zeros((1,), jnp.float32)
  if (k_pages.ndim != 5 or k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype
      or not supported(n, k_pages.shape[2], h, k_pages.dtype) or k_pages.shape[4] != h
      or table_BM.shape[0] != b or pos_B.shape != (b,)):
    raise ValueError(f"decode_attention: unsupported shapes q {q_BNH.shape}, pages "
                     f"{k_pages.shape} {k_pages.dtype}, table {table_BM.shape}, pos {pos_B.shape}")
  call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((b, n, h), jnp.float32),
                          vmap_method="sequential")
  return call(q_BNH.astype(jnp.float32), k_pages, v_pages, k_scale.astype(jnp.float32),
              v_scale.astype(jnp.float32), table_BM.astype(jnp.int32),
              pos_B.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(()),
              max_keys=np.int64(max_keys),
              bf16_dot=np.int32(1 if _dot_path(q_BNH.dtype, k_pages.dtype) else 0))


def attend_paged(q_BTNH: jax.Array, k_pages: Pages, v_pages: Pages, table_BM: jax.Array,
                 pos_BT: jax.Array, layer: int | jax.Array, max_keys: int) -> jax.Array:
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
                             max_keys)
  return out_RNH.reshape(b, t, n, h).astype(q_BTNH.dtype)


def _dot_path(q_dtype, pages_dtype) -> bool:
  """The BF16 dot-product loops round q to bf16: exact for a bf16 query, so bf16 pools take them
  only then (an f32 query over bf16 pages takes the f32 loops, equal to the gather path); int8
  pools take them for any query (the documented rounding, within the int8 KV's own error)."""
  if not bf16_dot():
    return False
  return jnp.dtype(pages_dtype) == jnp.dtype(jnp.int8) or (
      jnp.dtype(q_dtype) == jnp.dtype(jnp.bfloat16))


def bf16_dot() -> bool:
  """Whether bf16 pages take the AVX-512 BF16 dot-product path (the CPU has ``avx512_bf16``
  and ``PHASESERVE_PAGED_BF16_DOT`` is not ``0``); read at trace time."""
  return (os.environ.get("PHASESERVE_PAGED_BF16_DOT", "1") != "0"
          and "avx512_bf16" in native_build.cpu_flags())


__all__ = ["available", "supported", "decode_attention", "attend_paged", "MAX_GROUP"]
