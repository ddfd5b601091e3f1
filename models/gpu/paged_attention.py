"""Decode attention over the paged KV pool as a Pallas kernel for GPUs (Triton lowering).

JAX 0.12 ships no Pallas paged attention for GPUs (``jax.experimental.pallas.ops.gpu`` holds
Mosaic-GPU matmuls and a dense flash attention only), so this one is written here: one program
per (query row, kv head), reading the row's pages through the table in place, an online
softmax over them, the G query heads of the kv head together.

Contract:
  * ``decode_attention(q_RNH, k_pages, v_pages, table_RM, end_R, layer, interpret=False)``
    -> f32 ``[R, N, H]``: softmax attention of each (pre-scaled) query row over keys
    ``s < end_R[r]`` of pool ``[L, P, K, Z, H]`` (f32 or bf16 pages), key ``s`` at page
    ``table_RM[r, s // Z]``; a table entry outside ``[0, P)`` reads as zeros (the null page);
    a row with ``end_R <= 0`` gives zeros. Values past ``end_R`` are never read into the sum,
    so a reused page's stale NaN / Inf cannot reach the output. ``layer`` may be traced.
  * ``attend_paged(q_BTNH, k_pages, v_pages, table_BM, pos_BT, layer, max_keys, interpret)``:
    the same called as ``models.attention.attend`` is (query t of row b reads keys
    ``s <= pos_BT[b, t]`` and below ``max_keys``), in q's dtype.
  * ``supported(pages)``: f32 or bf16 pages (int8 pools stay on the gather path).
  * ``interpret=True`` runs the kernel through Pallas's interpreter on any backend (the tests,
    on CPU); the device check runs it compiled on the GPU.
  * Numerics: f32 products and sums, online softmax: the gather path up to summation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

_NEG = -1e30
_TINY = 1e-30


def supported(pages) -> bool:
  return isinstance(pages, jax.Array) and pages.dtype in (jnp.float32, jnp.bfloat16)


def _kernel(layer_ref, end_ref, table_ref, q_ref, k_ref, v_ref, o_ref, *, pages_per_seq: int,
            page_size: int, num_pages: int):
  r, kh = pl.program_id(0), pl.program_id(1)
  layer = layer_ref[0]
  end = end_ref[r]
  q_GH = q_ref[0, 0].astype(jnp.float32)
  g, h = q_GH.shape
  z = page_size

  def body(m, carry):
    mx_G, den_G, acc_GH = carry
    page = table_ref[r, m]
    real = (page >= 0) & (page < num_pages)
    at = jnp.where(real, page, 0)
    k_ZH = jnp.where(real, k_ref[layer, at, kh].astype(jnp.float32), 0.0)
    v_ZH = jnp.where(real, v_ref[layer, at, kh].astype(jnp.float32), 0.0)
    seen_Z = m * z + lax.broadcasted_iota(jnp.int32, (z,), 0) < end
    v_ZH = jnp.where(seen_Z[:, None], v_ZH, 0.0)
    s_GZ = jnp.where(seen_Z[None, :], jnp.dot(q_GH, k_ZH.T), _NEG)
    new_G = jnp.maximum(mx_G, s_GZ.max(axis=1))
    p_GZ = jnp.where(seen_Z[None, :], jnp.exp(s_GZ - new_G[:, None]), 0.0)
    corr_G = jnp.exp(mx_G - new_G)
    return (new_G, den_G * corr_G + p_GZ.sum(axis=1),
            acc_GH * corr_G[:, None] + jnp.dot(p_GZ, v_ZH))

  n = jnp.clip((end + z - 1) // z, 0, pages_per_seq)
  init = (jnp.full((g,), _NEG, jnp.float32), jnp.zeros((g,), jnp.float32),
          jnp.zeros((g, h), jnp.float32))
  _, den_G, acc_GH = lax.fori_loop(0, n, body, init)
  o_ref[0, 0] = acc_GH / jnp.maximum(den_G, _TINY)[:, None]


@functools.partial(jax.jit, static_argnames=("interpret",))
def decode_attention(q_RNH: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                     table_RM: jax.Array, end_R: jax.Array, layer: int | jax.Array,
                     interpret: bool = False) -> jax.Array:
  r, n, h = q_RNH.shape
  _, p, k, z, _ = k_pages.shape
  g = n // k
  m = table_RM.shape[1]
  q_RKGH = q_RNH.reshape(r, k, g, h)
  kernel = functools.partial(_kernel, pages_per_seq=m, page_size=z, num_pages=p)
  whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))  # noqa: E731
  out = pl.pallas_call(
      kernel, grid=(r, k),
      in_specs=[whole((1,)), whole((r,)), whole((r, m)),
                pl.BlockSpec((1, 1, g, h), lambda i, j: (i, j, 0, 0)),
                whole(k_pages.shape), whole(v_pages.shape)],
      out_specs=pl.BlockSpec((1, 1, g, h), lambda i, j: (i, j, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((r, k, g, h), jnp.float32),
      interpret=interpret,
  )(jnp.asarray(layer, jnp.int32).reshape(1), end_R.astype(jnp.int32),
    table_RM.astype(jnp.int32), q_RKGH, k_pages, v_pages)
  return out.reshape(r, n, h)


def attend_paged(q_BTNH: jax.Array, k_pages: jax.Array, v_pages: jax.Array, table_BM: jax.Array,
                 pos_BT: jax.Array, layer: int | jax.Array, max_keys: int,
                 interpret: bool = False) -> jax.Array:
  """See the module contract (q scaled by ``H ** -0.5`` and rounded to its dtype as
  ``models.attention.attend`` does)."""
  b, t, n, h = q_BTNH.shape
  q_RNH = (q_BTNH.reshape(b * t, n, h).astype(jnp.float32) * (h ** -0.5)).astype(q_BTNH.dtype)
  table_RM = table_BM if t == 1 else jnp.repeat(table_BM, t, axis=0)
  end_R = jnp.minimum(pos_BT.reshape(b * t) + 1, max_keys)
  out = decode_attention(q_RNH, k_pages, v_pages, table_RM, end_R, layer, interpret=interpret)
  return out.reshape(b, t, n, h).astype(q_BTNH.dtype)


__all__ = ["decode_attention", "attend_paged", "supported"]
