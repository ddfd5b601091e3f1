"""Multiquery / grouped-query attention of a chunk of queries over a KV cache.

Contract: ``attend(q_BTNH, k_BKSH, v_BKSH, q_pos_BT)`` computes causal attention in absolute
positions: query (b, t) sees key s iff ``s <= q_pos_BT[b, t]``. N query heads share K kv heads
(N = K * G; K = 1 is multiquery). Softmax in float32; result in the query dtype.

How (internals, free to change):
  * The G query heads of a kv head and the T queries are folded into one row axis R = T * G, so
    each kv head is one plain ``[R, H] x [S, H]`` product (K and V are never broadcast over G).
  * Short key ranges (decode; chunks over at most ``KEY_BLOCK`` keys) take one block: logits
    ``[R, S]``, masked softmax, ``[R, S] x [S, H]``.
  * Longer ranges (prefill) cut the queries into blocks of ``QUERY_BLOCK`` positions and run a
    ``while`` loop over key blocks of ``KEY_BLOCK`` positions with an online softmax (running max
    and sum, as FlashAttention), stopping at the block holding the block's last visible key. Only
    keys at or before a query's position are ever read, so a causal prefill does about half the
    work of the full ``[T, S]`` product, and the f32 logits of one step stay in cache.
  * Softmax normalisation is applied to the ``[R, H]`` output rather than to ``[R, S]`` weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_NEG = -1e30
QUERY_BLOCK = 256  # query positions per block (x G rows)
KEY_BLOCK = 512  # key positions per online-softmax step


def _rows_mask(pos_BT: jax.Array, g: int, key_pos_S: jax.Array) -> jax.Array:
  """[B, 1, R, S] mask for rows R = (t, g): key s visible to query t."""
  b, t = pos_BT.shape
  s = key_pos_S.shape[0]
  m = key_pos_S[None, None, :] <= pos_BT[:, :, None]  # [B, T, S]
  return jnp.broadcast_to(m[:, :, None, :], (b, t, g, s)).reshape(b, 1, t * g, s)


def _one_block(q_BKRH, k_BKSH, v_BKSH, pos_BT, g, dtype):
  s = k_BKSH.shape[2]
  logits = jnp.einsum("bkrh,bksh->bkrs", q_BKRH, k_BKSH.astype(dtype),
                      preferred_element_type=jnp.float32)
  logits = jnp.where(_rows_mask(pos_BT, g, jnp.arange(s, dtype=jnp.int32)), logits, _NEG)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - m)
  out = jnp.einsum("bkrs,bksh->bkrh", p.astype(dtype), v_BKSH.astype(dtype),
                   preferred_element_type=jnp.float32)
  return out / jnp.sum(p, axis=-1, keepdims=True)


def _flash_block(q_BKRH, k_BKSH, v_BKSH, pos_BT, g, dtype, key_block):
  """Online softmax over key blocks [0, last visible key of these queries]."""
  b, kh, r, h = q_BKRH.shape
  s = k_BKSH.shape[2]
  n_blocks = (s + key_block - 1) // key_block
  if n_blocks * key_block != s:  # pad the key axis to whole blocks (padding is never visible)
    pad = n_blocks * key_block - s
    k_BKSH = jnp.pad(k_BKSH, ((0, 0), (0, 0), (0, pad), (0, 0)))
    v_BKSH = jnp.pad(v_BKSH, ((0, 0), (0, 0), (0, pad), (0, 0)))
  last = jnp.minimum(jnp.max(pos_BT), s - 1)
  steps = last // key_block + 1

  def body(j, carry):
    m, l, acc = carry
    start = j * key_block
    kb = lax.dynamic_slice_in_dim(k_BKSH, start, key_block, axis=2).astype(dtype)
    vb = lax.dynamic_slice_in_dim(v_BKSH, start, key_block, axis=2).astype(dtype)
    logits = jnp.einsum("bkrh,bksh->bkrs", q_BKRH, kb, preferred_element_type=jnp.float32)
    key_pos = start + jnp.arange(key_block, dtype=jnp.int32)
    logits = jnp.where(_rows_mask(pos_BT, g, key_pos), logits, _NEG)
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1, keepdims=True))
    p = jnp.exp(logits - m_new)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=-1, keepdims=True)
    acc = acc * corr + jnp.einsum("bkrs,bksh->bkrh", p.astype(dtype), vb,
                                  preferred_element_type=jnp.float32)
    return m_new, l, acc

  init = (jnp.full((b, kh, r, 1), _NEG, jnp.float32), jnp.zeros((b, kh, r, 1), jnp.float32),
          jnp.zeros((b, kh, r, h), jnp.float32))
  _, l, acc = lax.fori_loop(0, steps, body, init)
  return acc / l


def attend(q_BTNH: jax.Array, k_BKSH: jax.Array, v_BKSH: jax.Array, q_pos_BT: jax.Array
           ) -> jax.Array:
  b, t, n, h = q_BTNH.shape
  kh = k_BKSH.shape[1]
  s = k_BKSH.shape[2]
  g = n // kh
  dtype = q_BTNH.dtype
  # Scale q (T*N*H values) rather than the logits (T*N*S values).
  q = (q_BTNH.astype(jnp.float32) * (h ** -0.5)).astype(dtype)
  # [B, T, K, G, H] -> [B, K, T, G, H] -> rows R = (t, g): a bitcast when K == 1.
  q_BKRH = jnp.transpose(q.reshape(b, t, kh, g, h), (0, 2, 1, 3, 4)).reshape(b, kh, t * g, h)
  pos = q_pos_BT.astype(jnp.int32)
  if s <= KEY_BLOCK:
    out_BKRH = _one_block(q_BKRH, k_BKSH, v_BKSH, pos, g, dtype)
  else:
    outs = []
    for lo in range(0, t, QUERY_BLOCK):
      hi = min(t, lo + QUERY_BLOCK)
      outs.append(_flash_block(q_BKRH[:, :, lo * g:hi * g], k_BKSH, v_BKSH, pos[:, lo:hi], g,
                               dtype, KEY_BLOCK))
    out_BKRH = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
  out = jnp.transpose(out_BKRH.reshape(b, kh, t, g, h), (0, 2, 1, 3, 4)).reshape(b, t, n, h)
  return out.astype(dtype)
