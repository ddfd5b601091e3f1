"""Multiquery / grouped-query attention of a chunk of queries over a KV cache.

Contract: ``attend(q_BTNH, k_BKSH, v_BKSH, q_pos_BT)`` computes causal attention in absolute
positions: query (b, t) sees key s iff ``s <= q_pos_BT[b, t]``. N query heads share K kv heads
(N = K * G; K = 1 is multiquery). Softmax in float32; result in the query dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30


def attend(q_BTNH: jax.Array, k_BKSH: jax.Array, v_BKSH: jax.Array, q_pos_BT: jax.Array
           ) -> jax.Array:
  b, t, n, h = q_BTNH.shape
  k = k_BKSH.shape[1]
  s = k_BKSH.shape[2]
  q_BTKGH = q_BTNH.reshape(b, t, k, n // k, h)
  logits_BKGTS = jnp.einsum("btkgh,bksh->bkgts", q_BTKGH, k_BKSH.astype(q_BTNH.dtype),
                            preferred_element_type=jnp.float32) * (h ** -0.5)
  mask_BTS = jnp.arange(s)[None, None, :] <= q_pos_BT[:, :, None]
  logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, _NEG)
  probs = jax.nn.softmax(logits_BKGTS, axis=-1)
  out_BTKGH = jnp.einsum("bkgts,bksh->btkgh", probs.astype(q_BTNH.dtype),
                         v_BKSH.astype(q_BTNH.dtype), preferred_element_type=jnp.float32)
  return out_BTKGH.reshape(b, t, n, h).astype(q_BTNH.dtype)
