"""Multiquery / grouped-query attention of a chunk of queries over a KV cache.

Contract: ``attend(q_BTNH, k_BKSH, v_BKSH, q_pos_BT, keys=None)``: causal attention in absolute
positions (query (b, t) sees key s iff ``s <= q_pos_BT[b, t]``). With ``keys``
(``KeyPositions``: each key's absolute position ``pos_BS`` (< 0: none) and per row ``sinks_B`` /
``window_B``) a key is visible iff ``0 <= pos <= q_pos`` and (``window == 0`` or
``pos < sinks`` or ``pos > q_pos - window``): StreamingLLM's sinks plus window, keys in any
order. N query heads share K kv heads (N = K * G). Softmax in f32, result in the query dtype; a
query that sees no key gets zeros, and a fully hidden block of keys adds nothing.
``zero_unseen(v_BKSH, seen_BS)`` (``seen_BS`` from ``written_seen``, or a caller's own) zeroes
the values of keys past what the row has written: a caller reading reused KV memory (pages,
slots) must, since a masked probability (0) times a stale NaN or Inf is still NaN. The row's end
comes from the call's write positions, not its query positions: a padded chunk's padding
queries sit past the end and would reveal the stale keys to the real ones.
Internals (free to change): the G heads and T queries fold into one row axis per kv head; short
key ranges take one block, long ones an online-softmax loop over key blocks that stops at the
last visible key.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

_NEG = -1e30
_TINY = 1e-30  # a row's softmax sum when it sees no key (its output: 0 / _TINY = 0)
QUERY_BLOCK = 256  # query positions per block (x G rows)
KEY_BLOCK = 512  # key positions per online-softmax step


class KeyPositions(NamedTuple):
  pos_BS: jax.Array  # [B, S] int32 absolute position of each key; < 0: none
  sinks_B: jax.Array  # [B] int32 first positions always visible (with a window)
  window_B: jax.Array  # [B] int32 most recent positions visible; 0: every earlier one


def _visible(q_pos_BT: jax.Array, keys: KeyPositions | None, start: int, s: int) -> jax.Array:
  """[B, T, S] key s (of the block starting at ``start``) visible to query t."""
  if keys is None:
    kp = (start + jnp.arange(s, dtype=jnp.int32))[None, None, :]  # [1, 1, S]
    return kp <= q_pos_BT[:, :, None]
  kp = lax.dynamic_slice_in_dim(keys.pos_BS, start, s, axis=1)[:, None, :]  # [B, 1, S]
  qp = q_pos_BT[:, :, None]
  win = keys.window_B[:, None, None]
  recent = (win == 0) | (kp < keys.sinks_B[:, None, None]) | (kp > qp - win)
  return (kp >= 0) & (kp <= qp) & recent


def _rows_mask(pos_BT: jax.Array, g: int, keys: KeyPositions | None, start: int, s: int
               ) -> jax.Array:
  """[B, 1, R, S] mask for rows R = (t, g)."""
  b, t = pos_BT.shape
  m = _visible(pos_BT, keys, start, s)
  return jnp.broadcast_to(m[:, :, None, :], (b, t, g, s)).reshape(b, 1, t * g, s)


def _one_block(q_BKRH, k_BKSH, v_BKSH, pos_BT, g, dtype, keys):
  s = k_BKSH.shape[2]
  logits = jnp.einsum("bkrh,bksh->bkrs", q_BKRH, k_BKSH.astype(dtype),
                      preferred_element_type=jnp.float32)
  mask = _rows_mask(pos_BT, g, keys, 0, s)
  logits = jnp.where(mask, logits, _NEG)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.where(mask, jnp.exp(logits - m), 0.0)
  out = jnp.einsum("bkrs,bksh->bkrh", p.astype(dtype), v_BKSH.astype(dtype),
                   preferred_element_type=jnp.float32)
  return out / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), _TINY)


def _flash_block(q_BKRH, k_BKSH, v_BKSH, pos_BT, g, dtype, key_block, keys):
  """Online softmax over key blocks [0, last visible key of these queries]."""
  b, kh, r, h = q_BKRH.shape
  s = k_BKSH.shape[2]
  n_blocks = (s + key_block - 1) // key_block
  if n_blocks * key_block != s:  # pad the key axis to whole blocks (padding is never visible)
    pad = n_blocks * key_block - s
    k_BKSH = jnp.pad(k_BKSH, ((0, 0), (0, 0), (0, pad), (0, 0)))
    v_BKSH = jnp.pad(v_BKSH, ((0, 0), (0, 0), (0, pad), (0, 0)))
    if keys is not None:
      keys = keys._replace(pos_BS=jnp.pad(keys.pos_BS, ((0, 0), (0, pad)), constant_values=-1))
  if keys is None:
    last = jnp.minimum(jnp.max(pos_BT), s - 1)
    steps = last // key_block + 1
  else:
    steps = n_blocks

  def body(j, carry):
    m, l, acc = carry
    start = j * key_block
    kb = lax.dynamic_slice_in_dim(k_BKSH, start, key_block, axis=2).astype(dtype)
    vb = lax.dynamic_slice_in_dim(v_BKSH, start, key_block, axis=2).astype(dtype)
    logits = jnp.einsum("bkrh,bksh->bkrs", q_BKRH, kb, preferred_element_type=jnp.float32)
    mask = _rows_mask(pos_BT, g, keys, start, key_block)
    logits = jnp.where(mask, logits, _NEG)
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1, keepdims=True))
    p = jnp.where(mask, jnp.exp(logits - m_new), 0.0)  # a hidden block adds nothing
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=-1, keepdims=True)
    acc = acc * corr + jnp.einsum("bkrs,bksh->bkrh", p.astype(dtype), vb,
                                  preferred_element_type=jnp.float32)
    return m_new, l, acc

  init = (jnp.full((b, kh, r, 1), _NEG, jnp.float32), jnp.zeros((b, kh, r, 1), jnp.float32),
          jnp.zeros((b, kh, r, h), jnp.float32))
  _, l, acc = lax.fori_loop(0, steps, body, init)
  return acc / jnp.maximum(l, _TINY)


def written_seen(end_B: jax.Array, s: int) -> jax.Array:
  """[B, S] whether key position s holds a value of the row: below its written end."""
  return jnp.arange(s, dtype=jnp.int32)[None, :] < end_B[:, None]


def zero_unseen(v_BKSH: jax.Array, seen_BS: jax.Array) -> jax.Array:
  """Values where ``seen_BS`` is false (a row's keys past its written end) zeroed, fused into
  the read's copy."""
  return jnp.where(seen_BS[:, None, :, None], v_BKSH, jnp.zeros((), v_BKSH.dtype))


def attend(q_BTNH: jax.Array, k_BKSH: jax.Array, v_BKSH: jax.Array, q_pos_BT: jax.Array,
           keys: KeyPositions | None = None) -> jax.Array:
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
    out_BKRH = _one_block(q_BKRH, k_BKSH, v_BKSH, pos, g, dtype, keys)
  else:
    outs = []
    for lo in range(0, t, QUERY_BLOCK):
      hi = min(t, lo + QUERY_BLOCK)
      outs.append(_flash_block(q_BKRH[:, :, lo * g:hi * g], k_BKSH, v_BKSH, pos[:, lo:hi], g,
                               dtype, KEY_BLOCK, keys))
    out_BKRH = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
  out = jnp.transpose(out_BKRH.reshape(b, kh, t, g, h), (0, 2, 1, 3, 4)).reshape(b, t, n, h)
  return out.astype(dtype)
