"""The engine's ragged batch in the layout of JAX's TPU ragged paged attention kernel.

``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` (the kernel vLLM-TPU runs: prefill
chunks and decode rows in one call over paged KV) takes every sequence's queries end to end
with ``cu_q_lens``, each sequence's KV length and page indices, and a page pool whose K and V
heads are interleaved in one array. This module maps the engine's padded rows onto that and
back; the kernel runs on TPU only (head_dim a multiple of 128, TPU's lanes): JAX 0.12.1's TPU
interpreter stops on it (its pages are read
through reshaped refs, which the interpreter cannot index: ``AttributeError:
'ReshapeTransform' object has no attribute 'indices'``), so off TPU the mapping is checked with
the kernel's own reference function (``ref_ragged_paged_attention``).

Contract:
  * ``pack(q_BTNH, pos_BT, end_B, k_PKZH, v_PKZH, table_BM) -> Ragged``: row b's real queries
    (its first ``end_B[b] - pos_BT[b, 0]`` positions, clipped to ``[0, T]``: the chunk's written
    tokens; a decode row is one) end to end in ``q_JNH`` (J = B * T, the rest zeros), ``kv_lens``
    = ``end_B``, ``page_indices`` = the table with null entries (outside ``[0, P)``) pointing
    at an appended page of zeros (the pool's contract: a null page reads as zeros), the
    combined pool ``[P + 1, Z, 2K, H]`` (K at even heads, V at odd), ``cu_q_lens``, ``num_seqs``.
  * ``unpack(out_JNH, ragged, t) -> [B, T, N, H]``: row b's outputs back at their positions,
    zeros at padding.
  * ``Ragged.args()``: the kernel's positional arguments, in its order.
The combine copies a layer's pages each call; a TPU pool stored in the combined layout would
not (the accelerator path's next step).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Ragged(NamedTuple):
  q_JNH: jax.Array
  kv_pages: jax.Array  # [P + 1, Z, 2K, H]
  kv_lens: jax.Array  # [B]
  page_indices: jax.Array  # [B, M]
  cu_q_lens: jax.Array  # [B + 1]
  num_seqs: jax.Array  # [1]
  q_len_B: jax.Array  # [B] real queries of each row

  def args(self) -> tuple[jax.Array, ...]:
    return (self.q_JNH, self.kv_pages, self.kv_lens, self.page_indices, self.cu_q_lens,
            self.num_seqs)


def pack(q_BTNH: jax.Array, pos_BT: jax.Array, end_B: jax.Array, k_PKZH: jax.Array,
         v_PKZH: jax.Array, table_BM: jax.Array) -> Ragged:
  b, t, n, h = q_BTNH.shape
  p, k, z, _ = k_PKZH.shape
  q_len_B = jnp.clip(end_B - pos_BT[:, 0], 0, t).astype(jnp.int32)
  cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_len_B, dtype=jnp.int32)])
  j_J = jnp.arange(b * t, dtype=jnp.int32)
  row_J = jnp.clip(jnp.searchsorted(cu, j_J, side="right") - 1, 0, b - 1)
  off_J = j_J - cu[row_J]
  real_J = j_J < cu[-1]
  q_JNH = jnp.where(real_J[:, None, None], q_BTNH[row_J, jnp.clip(off_J, 0, t - 1)], 0)
  kv_PZKH = jnp.stack([jnp.swapaxes(k_PKZH, 1, 2), jnp.swapaxes(v_PKZH, 1, 2)], axis=3)
  kv = jnp.concatenate([kv_PZKH.reshape(p, z, 2 * k, h),
                        jnp.zeros((1, z, 2 * k, h), kv_PZKH.dtype)])
  pages = jnp.where((table_BM >= 0) & (table_BM < p), table_BM, p).astype(jnp.int32)
  return Ragged(q_JNH, kv, end_B.astype(jnp.int32), pages, cu,
                jnp.full((1,), b, jnp.int32), q_len_B)


def unpack(out_JNH: jax.Array, ragged: Ragged, t: int) -> jax.Array:
  b = ragged.q_len_B.shape[0]
  t_T = jnp.arange(t, dtype=jnp.int32)
  at_BT = ragged.cu_q_lens[:b, None] + t_T[None, :]
  real_BT = t_T[None, :] < ragged.q_len_B[:, None]
  pad = jnp.zeros((b * t - out_JNH.shape[0],) + out_JNH.shape[1:], out_JNH.dtype)
  out = jnp.concatenate([out_JNH, pad])[jnp.where(real_BT, at_BT, 0)]
  return jnp.where(real_BT[:, :, None, None], out, 0)


__all__ = ["Ragged", "pack", "unpack"]
