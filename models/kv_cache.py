"""The contiguous KV cache and the small KV-store interface the model's block runs over (this
cache or ``models.paged_kv.PagedKV``).

Contract:
  * ``KVCache``: ``k`` / ``v`` ``[L, B, K, S, H]``, ``lengths [B]`` (each row at its own
    length), and the static ``backend`` it was made for (``init_cache(..., backend)``).
    Positions past a row's length may hold stale values: attention is causal in absolute
    position.
  * ``KVStore`` (the Protocol both stores implement): ``lengths``, ``max_len`` (a write at or
    past it is dropped), ``sink_pool``, ``rope_positions(pos_BT)``, ``write(layer, wpos_BT,
    k_BTKH, v_BTKH)``, ``read(layer, attend_len) -> (k_BKSH, v_BKSH)``,
    ``attend(layer, q_BTNH, pos_BT, attend_len, end_B=None) -> [B, T, N, H]``
    (``models.attention.attend`` over the first ``attend_len`` positions, values at or past
    the row's written end ``end_B`` zeroed (``written_end(wpos_BT, pos_BT)``; default: past
    the last query), or the native paged attention where the store's backend allows it) and
    ``replace(**fields)``.
  * ``chunk_positions(lengths_B, start_B, lens_B, t, max_len)``: one chunk's absolute and write
    positions (padding routed to ``PAD_POS``, which every store drops), last valid index and
    new lengths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, Self

import flax.struct
import jax
import jax.numpy as jnp

from models import attention
from models.cpu import paged_attention as cpu_paged_attention
from models.cpu.backend import CpuBackend
from models.config import ModelConfig

CACHE_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")
PAD_POS = 1 << 30  # the write position of a padding token: past every store, always dropped


class KVStore(Protocol):
  """What ``models.transformer`` needs of KV memory."""
  lengths: jax.Array  # [B] int32

  @property
  def max_len(self) -> int: ...

  @property
  def sink_pool(self) -> bool: ...

  def rope_positions(self, pos_BT: jax.Array) -> jax.Array: ...

  def write(self, layer: int, wpos_BT: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array
            ) -> Self: ...

  def read(self, layer: int, attend_len: int) -> tuple[jax.Array, jax.Array]: ...

  def attend(self, layer: int, q_BTNH: jax.Array, pos_BT: jax.Array, attend_len: int,
             end_B: jax.Array | None = None) -> jax.Array: ...

  def replace(self, **changes: jax.Array) -> Self: ...


@flax.struct.dataclass
class KVCache:
  k: jax.Array  # [L, B, K, S, H]
  v: jax.Array  # [L, B, K, S, H]
  lengths: jax.Array  # [B] int32
  # The backend this cache was made for (static: part of every jit key).
  backend: CpuBackend = flax.struct.field(pytree_node=False, default=CpuBackend())

  if TYPE_CHECKING:  # flax.struct.dataclass adds it at run time; declared for the type checker
    def replace(self, **fields: Any) -> KVCache: ...

  @property
  def batch(self) -> int:
    return self.k.shape[1]

  @property
  def max_len(self) -> int:
    return self.k.shape[3]

  @property
  def sink_pool(self) -> bool:
    return False

  def rope_positions(self, pos_BT: jax.Array) -> jax.Array:
    return pos_BT

  @staticmethod
  def logical_axes() -> "KVCache":
    return KVCache(k=CACHE_AXES, v=CACHE_AXES, lengths=("batch",))  # type: ignore[arg-type]  # axis names in the arrays' places

  def write(self, layer: int, wpos_BT: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array
            ) -> "KVCache":
    k, v = write(self.k, self.v, layer, wpos_BT, k_BTKH, v_BTKH)
    return self.replace(k=k, v=v)

  def read(self, layer: int, attend_len: int) -> tuple[jax.Array, jax.Array]:
    return self.k[layer, :, :, :attend_len], self.v[layer, :, :, :attend_len]

  def attend(self, layer: int, q_BTNH: jax.Array, pos_BT: jax.Array, attend_len: int,
             end_B: jax.Array | None = None) -> jax.Array:
    b, t, n, h = q_BTNH.shape
    if (t == 1 and self.k.dtype in (jnp.float32, jnp.bfloat16)
        and self.backend.paged_attention
        and cpu_paged_attention.supported(n, self.k.shape[2], h, self.k.dtype)):
      # Decode on XLA:CPU: [L, B, K, S, H] is a page pool of one S-position page per row, read
      # in place by the native attention (XLA's two small dots per layer cost more to dispatch
      # than to compute).
      table_B1 = jnp.arange(b, dtype=jnp.int32)[:, None]
      return cpu_paged_attention.attend_paged(q_BTNH, self.k, self.v, table_B1, pos_BT, layer,
                                              min(attend_len, self.max_len),
                                              self.backend.paged_bf16_dot,
                                              self.backend.policy.attention_prefetch_l2)
    k_BKSH, v_BKSH = self.read(layer, attend_len)
    end_B = written_end(pos_BT, pos_BT) if end_B is None else end_B
    return attention.attend(q_BTNH, k_BKSH,
                            attention.zero_unseen(v_BKSH, attention.written_seen(end_B,
                                                                                 attend_len)),
                            pos_BT)


def written_end(wpos_BT: jax.Array, pos_BT: jax.Array) -> jax.Array:
  """[B] one past the last position a call writes in each row: positions below it hold the
  row's keys. A row that writes nothing (every token padding: its output is never read) gets
  one past its last query."""
  last_B = jnp.max(jnp.where(wpos_BT < PAD_POS, wpos_BT, -1), axis=1)
  return jnp.where(last_B >= 0, last_B, jnp.max(pos_BT, axis=1)).astype(jnp.int32) + 1


def init_cache(cfg: ModelConfig, batch: int, max_len: int | None = None,
               dtype=jnp.float32, backend: CpuBackend = CpuBackend()) -> KVCache:
  s = max_len or cfg.max_seq_len
  shape = (cfg.num_layers, batch, cfg.num_kv_heads, s, cfg.head_dim)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                 lengths=jnp.zeros((batch,), jnp.int32), backend=backend)


def write(k_cache: jax.Array, v_cache: jax.Array, layer: int, wpos_BT: jax.Array,
          k_BTKH: jax.Array, v_BTKH: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Scatters a chunk's K/V into layer ``layer`` at positions ``wpos_BT`` (row b of the chunk to
  slot b); positions ``>= max_len`` (padding) are dropped."""
  b_B1 = jnp.arange(wpos_BT.shape[0])[:, None]
  k_cache = k_cache.at[layer, b_B1, :, wpos_BT, :].set(k_BTKH.astype(k_cache.dtype), mode="drop")
  v_cache = v_cache.at[layer, b_B1, :, wpos_BT, :].set(v_BTKH.astype(v_cache.dtype), mode="drop")
  return k_cache, v_cache


class ChunkPositions(NamedTuple):
  start_B: jax.Array  # [B] int32 first absolute position of each row's chunk
  pos_BT: jax.Array  # [B, T] int32 absolute position of every query (padding included)
  wpos_BT: jax.Array  # [B, T] int32 write position; padding -> PAD_POS (dropped)
  last_B: jax.Array  # [B] int32 index in the chunk of each row's last valid token
  lengths_B: jax.Array  # [B] int32 lengths after the chunk (rows with lens 0 keep theirs)


def chunk_positions(lengths_B: jax.Array, start_B: jax.Array | None, lens_B: jax.Array, t: int,
                    max_len: int) -> ChunkPositions:
  """Row b's ``lens_B[b]`` tokens run at ``start_B[b] + i`` (``start_B`` None: at
  ``lengths_B``); token i >= lens_B[b] is padding."""
  start_B = (lengths_B if start_B is None else start_B).astype(jnp.int32)
  t_T = jnp.arange(t, dtype=jnp.int32)
  pos_BT = start_B[:, None] + t_T[None, :]
  wpos_BT = jnp.where(t_T[None, :] < lens_B[:, None], pos_BT, PAD_POS)
  last_B = jnp.clip(lens_B - 1, 0, t - 1).astype(jnp.int32)
  new_B = jnp.where(lens_B > 0, start_B + lens_B, lengths_B).astype(jnp.int32)
  return ChunkPositions(start_B, pos_BT, wpos_BT, last_B, new_B)
