"""Paged KV memory on the device: a pool of fixed-size pages per layer, read and written through a
page table per batch slot (the vLLM design). The host-side allocator is ``serving.kv_pages``.

Letters (besides ``models/config.py``'s): P pages in the pool, Z positions per page (page size),
M page-table entries per slot (a slot holds at most M * Z positions).

Contract:
  * ``PagedKV`` (a ``flax.struct`` pytree, a ``models.kv_cache.KVStore``): ``k_pages`` and
    ``v_pages`` ``[L, P, K, Z, H]``, ``page_table [B, M] int32``, ``lengths [B] int32``. Position
    ``p`` of slot ``b`` lives at page ``page_table[b, p // Z]``, offset ``p % Z``, in every
    layer. A table entry outside ``[0, P)`` is the null page (``init_paged`` and the allocator use
    ``P``): nothing is written there and reads of it return zeros. ``max_len = M * Z``.
  * ``write(layer, wpos_BT, k_BTKH, v_BTKH)`` scatters through the table. A write position whose
    page is the null page or that is ``>= max_len`` (padding, routed there by
    ``kv_cache.chunk_positions``) is dropped by the scatter: it never lands on page 0 or on another
    slot's page. That a real token has a page is the allocator's job (``serving.kv_pages``
    refuses to extend a sequence past its capacity); ``unbacked`` counts the tokens of a chunk
    that would be dropped, for a debug check before the step.
  * ``read(layer, attend_len)`` -> ``(k_BKSH, v_BKSH)``, ``S = attend_len``: a gather of the first
    ``ceil(attend_len / Z)`` table entries of every slot into contiguous ``[B, K, S, H]``.
    Cost: it materialises the attended context once per layer and step, i.e. one extra write and
    read of ``2 * B * K * attend_len * H`` elements over the contiguous cache's slice (decode at
    batch 8, context 2048, ``small`` bf16: 4 MiB per layer); ``notes_paged_kv.md`` has the
    measured price. A paged attention kernel that walks the table per key block would remove it.
  * ``attend(layer, q_BTNH, pos_BT, attend_len)``: attention of the queries over the table.
    Decode (``T == 1``) on XLA:CPU runs ``models.cpu_paged_attention`` when it is available and
    takes the shapes: it walks the table itself and reads only each row's visible keys (no
    gather); otherwise ``read`` then ``models.attention.attend``.
  * Pages shared by several slots (a fork) are only ever read: the allocator copies a partly
    filled last page (``copy_pages``) before the child writes.
  * Attention is causal in absolute position, so stale or foreign values past a slot's length are
    never seen; unwritten pages hold zeros (finite), which the masked softmax needs.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models import attention, cpu_paged_attention, kv_cache
from models.config import ModelConfig
from models.kv_cache import KVCache


@flax.struct.dataclass
class PagedKV:
  k_pages: jax.Array  # [L, P, K, Z, H]
  v_pages: jax.Array  # [L, P, K, Z, H]
  page_table: jax.Array  # [B, M] int32; entries outside [0, P) = null page
  lengths: jax.Array  # [B] int32

  @property
  def batch(self) -> int:
    return self.page_table.shape[0]

  @property
  def num_pages(self) -> int:
    return self.k_pages.shape[1]

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[3]

  @property
  def pages_per_seq(self) -> int:
    return self.page_table.shape[1]

  @property
  def max_len(self) -> int:
    return self.pages_per_seq * self.page_size

  def locate(self, wpos_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(page id, offset) of every write position; unbacked or padding positions -> page P."""
    z, m = self.page_size, self.pages_per_seq
    idx_BT = wpos_BT // z
    page_BT = jnp.take_along_axis(self.page_table, jnp.clip(idx_BT, 0, m - 1), axis=1)
    ok_BT = (wpos_BT >= 0) & (idx_BT < m) & (page_BT >= 0) & (page_BT < self.num_pages)
    return jnp.where(ok_BT, page_BT, self.num_pages), wpos_BT % z

  def write(self, layer: int, wpos_BT: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array
            ) -> "PagedKV":
    page_BT, off_BT = self.locate(wpos_BT)
    k = self.k_pages.at[layer, page_BT, :, off_BT, :].set(k_BTKH.astype(self.k_pages.dtype),
                                                          mode="drop")
    v = self.v_pages.at[layer, page_BT, :, off_BT, :].set(v_BTKH.astype(self.v_pages.dtype),
                                                          mode="drop")
    return self.replace(k_pages=k, v_pages=v)

  def read(self, layer: int, attend_len: int) -> tuple[jax.Array, jax.Array]:
    if attend_len > self.max_len:
      raise ValueError(f"attend_len {attend_len} > page capacity {self.max_len}")
    n = -(-attend_len // self.page_size)
    ids_BM = self.page_table[:, :n]
    return _gather(self.k_pages, layer, ids_BM, attend_len), _gather(self.v_pages, layer,
                                                                     ids_BM, attend_len)


  def attend(self, layer: int, q_BTNH: jax.Array, pos_BT: jax.Array, attend_len: int
             ) -> jax.Array:
    b, t, n, h = q_BTNH.shape
    if (t == 1 and cpu_paged_attention.available()
        and cpu_paged_attention.supported(n, self.k_pages.shape[2], h, self.k_pages.dtype)):
      if attend_len > self.max_len:
        raise ValueError(f"attend_len {attend_len} > page capacity {self.max_len}")
      q_BNH = (q_BTNH[:, 0].astype(jnp.float32) * (h ** -0.5)).astype(q_BTNH.dtype)
      out_BNH = cpu_paged_attention.decode_attention(q_BNH, self.k_pages, self.v_pages,
                                                     self.page_table, pos_BT[:, 0], layer,
                                                     attend_len)
      return out_BNH[:, None].astype(q_BTNH.dtype)
    return attention.attend(q_BTNH, *self.read(layer, attend_len), pos_BT)


def _gather(pages_LPKZH: jax.Array, layer: int, ids_BM: jax.Array, s: int) -> jax.Array:
  b, m = ids_BM.shape
  _, _, kh, z, h = pages_LPKZH.shape
  x_BMKZH = pages_LPKZH.at[layer, ids_BM].get(mode="fill", fill_value=0)
  x_BKSH = jnp.swapaxes(x_BMKZH, 1, 2).reshape(b, kh, m * z, h)  # a bitcast when K == 1
  return x_BKSH if m * z == s else x_BKSH[:, :, :s]


def init_paged(cfg: ModelConfig, batch: int, num_pages: int, page_size: int,
               pages_per_seq: int, dtype=jnp.float32) -> PagedKV:
  """An empty pool (zeros) with every table entry the null page."""
  shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
  return PagedKV(k_pages=jnp.zeros(shape, dtype), v_pages=jnp.zeros(shape, dtype),
                 page_table=jnp.full((batch, pages_per_seq), num_pages, jnp.int32),
                 lengths=jnp.zeros((batch,), jnp.int32))


def page_bytes(cfg: ModelConfig, page_size: int, dtype: str | np.dtype | type) -> int:
  """Bytes of one page: K and V of every layer, ``page_size`` positions."""
  itemsize = jnp.dtype(dtype).itemsize
  return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * cfg.head_dim * itemsize


def copy_pages(kv: PagedKV, src_C: jax.Array, dst_C: jax.Array) -> PagedKV:
  """Copies page ``src_C[c]`` to ``dst_C[c]`` in every layer (fork copy-on-write). A ``dst``
  outside ``[0, P)`` is padding and copies nothing."""
  dst_C = jnp.where((dst_C >= 0) & (dst_C < kv.num_pages), dst_C, kv.num_pages)
  src_C = jnp.clip(src_C, 0, kv.num_pages - 1)
  k = kv.k_pages.at[:, dst_C].set(kv.k_pages[:, src_C], mode="drop")
  v = kv.v_pages.at[:, dst_C].set(kv.v_pages[:, src_C], mode="drop")
  return kv.replace(k_pages=k, v_pages=v)


def unbacked(kv: PagedKV, start_B: jax.Array | None, lens_B: jax.Array, t: int) -> jax.Array:
  """[B] int32: how many of a chunk's real tokens (``lens_B``, from ``start_B``; None = from
  ``lengths``) have no page and would be dropped. Zero everywhere when the allocator did its
  job; the engine may check it before a step."""
  c = kv_cache.chunk_positions(kv.lengths, start_B, lens_B, t, kv.max_len)
  valid_BT = jnp.arange(t, dtype=jnp.int32)[None, :] < lens_B[:, None]
  pos_BT = jnp.where(valid_BT, c.pos_BT, 0)
  page_BT, _ = kv.locate(pos_BT)
  lost_BT = valid_BT & (page_BT >= kv.num_pages)  # also past capacity: locate -> page P
  return jnp.sum(lost_BT, axis=1, dtype=jnp.int32)


def to_cache(kv: PagedKV, max_len: int | None = None) -> KVCache:
  """The contiguous ``KVCache`` ``[L, B, K, S, H]`` (S = ``max_len``, default M * Z) holding the
  same positions (unbacked positions read as zeros)."""
  s = max_len or kv.max_len
  layers = range(kv.k_pages.shape[0])
  k = jnp.stack([kv.read(l, s)[0] for l in layers])
  v = jnp.stack([kv.read(l, s)[1] for l in layers])
  return KVCache(k=k, v=v, lengths=kv.lengths)


__all__ = ["PagedKV", "init_paged", "page_bytes", "copy_pages", "unbacked", "to_cache"]
