"""The KV cache pytree: one slot per batch row, each row at its own length (ragged batch).

Contract: ``k`` and ``v`` are ``[L, B, K, S, H]`` (layers, batch slots, kv heads, cache positions,
head dim); ``lengths[b]`` counts the valid positions of row ``b``. Positions ``>= lengths[b]`` may
hold stale values: attention is causal in absolute position, so a query never reads a position
that its own sequence has not written.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from models.config import ModelConfig

CACHE_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")


@flax.struct.dataclass
class KVCache:
  k: jax.Array  # [L, B, K, S, H]
  v: jax.Array  # [L, B, K, S, H]
  lengths: jax.Array  # [B] int32

  @property
  def batch(self) -> int:
    return self.k.shape[1]

  @property
  def max_len(self) -> int:
    return self.k.shape[3]

  @staticmethod
  def logical_axes() -> "KVCache":
    return KVCache(k=CACHE_AXES, v=CACHE_AXES, lengths=("batch",))  # type: ignore[arg-type]


def init_cache(cfg: ModelConfig, batch: int, max_len: int | None = None,
               dtype=jnp.float32) -> KVCache:
  s = max_len or cfg.max_seq_len
  shape = (cfg.num_layers, batch, cfg.num_kv_heads, s, cfg.head_dim)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                 lengths=jnp.zeros((batch,), jnp.int32))


def write(k_cache: jax.Array, v_cache: jax.Array, layer: int, wpos_BT: jax.Array,
          k_BTKH: jax.Array, v_BTKH: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Scatters a chunk's K/V into layer ``layer`` at positions ``wpos_BT`` (row b of the chunk to
  slot b); positions ``>= max_len`` (padding) are dropped."""
  b_B1 = jnp.arange(wpos_BT.shape[0])[:, None]
  k_cache = k_cache.at[layer, b_B1, :, wpos_BT, :].set(k_BTKH.astype(k_cache.dtype), mode="drop")
  v_cache = v_cache.at[layer, b_B1, :, wpos_BT, :].set(v_BTKH.astype(v_cache.dtype), mode="drop")
  return k_cache, v_cache
