"""Paged KV memory on the device: a pool of fixed-size pages per layer, read and written through
a page table per batch slot (vLLM's design; the host allocator is ``serving.kv_pages``).
Letters: P pages in the pool, Z positions per page, M table entries per slot.

Contract:
  * ``PagedKV`` (a ``models.kv_cache.KVStore``): ``k_pages`` / ``v_pages`` ``[L, P, K, Z, H]``
    (int8 pools: ``QuantArray`` with per-token, per-head scales ``[L, P, K, Z, 1]``),
    ``page_table [B, M]``, ``lengths [B]``, and the static ``backend`` the pool was made for.
    Position ``p`` of slot ``b`` lives at page ``page_table[b, p // Z]``, offset ``p % Z``; a
    table entry outside ``[0, P)`` is the null page: never written, read as zeros.
  * ``write`` scatters through the table and drops padding, null-page and out-of-table writes;
    ``read`` gathers ``attend_len`` positions into ``[B, K, S, H]``; ``attend`` runs
    ``models.cpu.paged_attention`` where ``native_attention`` (the backend allows it), a decode
    step ``models.gpu.paged_attention`` where the backend's ``pallas_attention`` is ``"gpu"``,
    else ``read`` + ``models.attention.attend``. Shared (forked) pages are only read.
  * Attention sinks (StreamingLLM, ``init_paged(sink_pool=True)``): per row ``sinks`` first and
    ``window`` last positions kept, the window in a ring of ``ring_entries(window, Z)`` table
    entries; keys re-rotated to their in-cache positions (``rope_positions``); a chunk of more
    than one query must not pass ``sinks + window``; ``rings_only``: decode's ``attend_len``
    need cover only the rings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models import attention, kv_cache, quant
from models.cpu import paged_attention as cpu_paged_attention
from models.gpu import paged_attention as gpu_paged_attention
from models.cpu.backend import CpuBackend
from models.config import ModelConfig
from models.kv_cache import KVCache
from models.layers import rotate, rotation
from models.quant import QuantArray

Pages = jax.Array | QuantArray  # [L, P, K, Z, H]; int8: + scales [L, P, K, Z, 1] float32


def ring_entries(window: int, page_size: int) -> int:
  """Page-table entries of a window row: the sink page (entry 0) and a ring of every page a
  window of ``window`` positions can touch, ``(window - 1) // Z + 2`` (``PagedKV.ring_B``)."""
  if window < 1:
    raise ValueError(f"window must be >= 1, got {window}")
  return 3 + (window - 1) // page_size


def is_int8(dtype: str | np.dtype | type) -> bool:
  return jnp.dtype(dtype) == jnp.dtype(jnp.int8)


def pages_dtype(pages: Pages) -> np.dtype:
  """The stored value dtype (int8 for a quantized pool)."""
  return (pages.quant if isinstance(pages, QuantArray) else pages).dtype


def _store(pages: Pages, layer: int, page_BT: jax.Array, off_BT: jax.Array, x_BTKH: jax.Array
           ) -> Pages:
  if isinstance(pages, QuantArray):
    qx = quant.quantize_array(x_BTKH, (3,))  # quant [B, T, K, H], scale [B, T, K, 1]
    return pages.replace(
        quant=pages.quant.at[layer, page_BT, :, off_BT, :].set(qx.quant, mode="drop"),
        scale=pages.scale.at[layer, page_BT, :, off_BT, :].set(qx.scale, mode="drop"))
  return pages.at[layer, page_BT, :, off_BT, :].set(x_BTKH.astype(pages.dtype), mode="drop")


@flax.struct.dataclass
class PagedKV:
  k_pages: Pages  # [L, P, K, Z, H]
  v_pages: Pages  # [L, P, K, Z, H]
  page_table: jax.Array  # [B, M] int32; entries outside [0, P) = null page
  lengths: jax.Array  # [B] int32
  # A sink pool (``rope_theta`` set): the per-row cache policy, see "Attention sinks".
  sinks: jax.Array | None = None  # [B] int32 first positions kept (with a window)
  window: jax.Array | None = None  # [B] int32 most recent positions kept; 0: all of them
  rope_theta: float | None = flax.struct.field(pytree_node=False, default=None)
  # The backend this pool was made for (static: part of every jit key; says whether ``attend``
  # may run the native paged attention).
  backend: CpuBackend = flax.struct.field(pytree_node=False, default=CpuBackend())

  if TYPE_CHECKING:  # flax.struct.dataclass adds it at run time; declared for the type checker
    def replace(self, **fields: Any) -> PagedKV: ...

  @property
  def sink_pool(self) -> bool:
    return self.rope_theta is not None

  def _policy(self) -> tuple[jax.Array, jax.Array]:
    zeros = jnp.zeros_like(self.lengths)
    return (zeros if self.sinks is None else self.sinks,
            zeros if self.window is None else self.window)

  def _shift(self, pos_BT: jax.Array) -> jax.Array:
    """How far a query's in-cache position is below its absolute one (0 until the sinks and
    the window are full)."""
    sinks_B, window_B = self._policy()
    over = pos_BT - (sinks_B + window_B - 1)[:, None]
    return jnp.where(window_B[:, None] > 0, jnp.maximum(over, 0), 0)

  def rope_positions(self, pos_BT: jax.Array) -> jax.Array:
    return pos_BT - self._shift(pos_BT) if self.sink_pool else pos_BT

  def ring_B(self) -> jax.Array:
    """[B] table entries each row uses: ``ring_entries(window)`` for a window row (at most M),
    else M."""
    m = self.pages_per_seq
    if self.window is None:
      return jnp.full((self.batch,), m, jnp.int32)
    w = self.window
    return jnp.where(w > 0, jnp.minimum(3 + (jnp.maximum(w, 1) - 1) // self.page_size, m), m)

  def key_positions(self, t_B: jax.Array, s: int) -> jax.Array:
    """[B, S] absolute position held by each of a row's first ``s`` cache positions when its
    latest position is ``t_B`` (< 0: never written). Entry 0 holds positions [0, Z); a window
    row's later pages are a ring over entries [1, R) (``R = ring_B()``): logical page q >= R
    reuses entry ``1 + (q - 1) % (R - 1)``, whose latest q <= t is the position's."""
    z = self.page_size
    r1_B1 = jnp.maximum(self.ring_B() - 1, 1)[:, None]
    s_S = jnp.arange(s, dtype=jnp.int32)
    j_S, o_S = s_S // z, s_S % z
    qq_BS = (t_B[:, None] - o_S[None, :]) // z  # the latest logical page with offset o <= t
    k_BS = (qq_BS - j_S[None, :]) // r1_B1
    p_BS = (j_S[None, :] + k_BS * r1_B1) * z + o_S[None, :]
    p_BS = jnp.where(j_S[None, :] == 0, o_S[None, :], p_BS)
    ok_BS = jnp.where(j_S[None, :] == 0, o_S[None, :] <= t_B[:, None],
                      (k_BS >= 0) & (j_S[None, :] <= r1_B1))
    return jnp.where(ok_BS, p_BS, -1)

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
    """(page id, offset) of every write position; unbacked or padding positions -> page P. A
    window row's positions past the table wrap onto its ring (``key_positions``)."""
    z, m = self.page_size, self.pages_per_seq
    idx_BT = wpos_BT // z
    if self.sink_pool and self.window is not None:
      r_B1 = self.ring_B()[:, None]
      ring_BT = (self.window[:, None] > 0) & (idx_BT >= r_B1) & (wpos_BT < kv_cache.PAD_POS)
      idx_BT = jnp.where(ring_BT, 1 + (idx_BT - 1) % jnp.maximum(r_B1 - 1, 1), idx_BT)
    page_BT = jnp.take_along_axis(self.page_table, jnp.clip(idx_BT, 0, m - 1), axis=1)
    ok_BT = (wpos_BT >= 0) & (idx_BT < m) & (page_BT >= 0) & (page_BT < self.num_pages)
    return jnp.where(ok_BT, page_BT, self.num_pages), wpos_BT % z

  def write(self, layer: int, wpos_BT: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array
            ) -> "PagedKV":
    page_BT, off_BT = self.locate(wpos_BT)
    return self.replace(k_pages=_store(self.k_pages, layer, page_BT, off_BT, k_BTKH),
                        v_pages=_store(self.v_pages, layer, page_BT, off_BT, v_BTKH))

  def read(self, layer: int, attend_len: int, dtype=None) -> tuple[jax.Array, jax.Array]:
    if attend_len > self.max_len:
      raise ValueError(f"attend_len {attend_len} > page capacity {self.max_len}")
    n = -(-attend_len // self.page_size)
    ids_BM = self.page_table[:, :n]
    return (_gather(self.k_pages, layer, ids_BM, attend_len, dtype),
            _gather(self.v_pages, layer, ids_BM, attend_len, dtype))

  def native_attention(self, n_heads: int, t: int) -> bool:
    """Whether ``attend`` runs ``models.cpu.paged_attention`` for chunks of ``t`` queries of
    ``n_heads`` heads (not a sink pool's decode; the kernel available and taking the shapes).
    Its cost follows each query's position, not ``attend_len``, so a caller may pass
    ``max_len`` rather than bucketing."""
    return (t > 1 or not self.sink_pool) and self._kernel(n_heads)

  def rings_only(self, n_heads: int) -> bool:
    """Whether a decode ``attend_len`` need cover only the rows with a window (their rings): a
    sink pool's rows without one run the native kernel over all their keys."""
    return self.sink_pool and self._kernel(n_heads)

  def _kernel(self, n_heads: int) -> bool:
    return (self.backend.paged_attention
            and cpu_paged_attention.supported(n_heads, self.k_pages.shape[2],
                                              self.k_pages.shape[4], pages_dtype(self.k_pages)))

  def attend(self, layer: int, q_BTNH: jax.Array, pos_BT: jax.Array, attend_len: int,
             end_B: jax.Array | None = None) -> jax.Array:
    b, t, n, h = q_BTNH.shape
    end_B = kv_cache.written_end(pos_BT, pos_BT) if end_B is None else end_B
    k, v = self.k_pages, self.v_pages
    if (t == 1 and self.backend.pallas_attention == "gpu" and not self.sink_pool
        and isinstance(k, jax.Array) and isinstance(v, jax.Array)
        and gpu_paged_attention.supported(k)):
      if attend_len > self.max_len:
        raise ValueError(f"attend_len {attend_len} > page capacity {self.max_len}")
      return gpu_paged_attention.attend_paged(q_BTNH, k, v, self.page_table, pos_BT, layer,
                                              attend_len, self.backend.pallas_interpret)
    if self.native_attention(n, t):
      if attend_len > self.max_len:
        raise ValueError(f"attend_len {attend_len} > page capacity {self.max_len}")
      return cpu_paged_attention.attend_paged(q_BTNH, self.k_pages, self.v_pages,
                                              self.page_table, pos_BT, layer, attend_len,
                                              self.backend.paged_bf16_dot,
                                              self.backend.policy.attention_prefetch_l2,
                                              self.backend.amx
                                              and self.backend.policy.attention_amx_blocks)
    if self.sink_pool:
      out_BTNH = self._attend_sinks(layer, q_BTNH, pos_BT, attend_len, end_B)
      if self.rings_only(n):  # decode: rows without a window through the kernel, all keys
        ring_B = self._policy()[1] > 0
        full_BTNH = cpu_paged_attention.attend_paged(
            q_BTNH, self.k_pages, self.v_pages, self.page_table,
            jnp.where(ring_B[:, None], -1, pos_BT), layer, self.max_len,  # -1: no work
            self.backend.paged_bf16_dot, self.backend.policy.attention_prefetch_l2)
        out_BTNH = jnp.where(ring_B[:, None, None, None], out_BTNH, full_BTNH)
      return out_BTNH
    k_BKSH, v_BKSH = self.read(layer, attend_len, q_BTNH.dtype)
    seen_BS = attention.written_seen(end_B, attend_len)
    return attention.attend(q_BTNH, k_BKSH, attention.zero_unseen(v_BKSH, seen_BS), pos_BT)

  def _attend_sinks(self, layer: int, q_BTNH: jax.Array, pos_BT: jax.Array, attend_len: int,
                    end_B: jax.Array) -> jax.Array:
    """The gather path of a sink pool: each key turned from its absolute position to its
    in-cache one (a sink: its own, no turn; a window key: its absolute position less the row's
    shift), causal and window masks on absolute positions. A chunk (T > 1) must not wrap nor
    shift (see "Attention sinks")."""
    k_BKSH, v_BKSH = self.read(layer, attend_len, q_BTNH.dtype)
    sinks_B, window_B = self._policy()
    if q_BTNH.shape[1] == 1:
      t_B = pos_BT[:, 0]
      kpos_BS = self.key_positions(t_B, attend_len)
      shift_B = self._shift(t_B[:, None])
    else:
      kpos_BS = jnp.broadcast_to(jnp.arange(attend_len, dtype=jnp.int32), (self.batch,
                                                                            attend_len))
      shift_B = jnp.zeros((self.batch, 1), jnp.int32)
    turn_BS = jnp.where(kpos_BS < sinks_B[:, None], 0, -shift_B)  # in-cache less absolute
    assert self.rope_theta is not None  # a sink pool
    rot = rotation(turn_BS, k_BKSH.shape[-1], self.rope_theta)  # [B, S, 1, H/2]
    k_BKSH = jnp.swapaxes(rotate(jnp.swapaxes(k_BKSH, 1, 2), rot), 1, 2)
    keys = attention.KeyPositions(kpos_BS, sinks_B, window_B)
    seen_BS = (kpos_BS >= 0) & (kpos_BS < end_B[:, None])
    return attention.attend(q_BTNH, k_BKSH, attention.zero_unseen(v_BKSH, seen_BS), pos_BT,
                            keys)


def _gather(pages: Pages, layer: int, ids_BM: jax.Array, s: int, dtype=None) -> jax.Array:
  if isinstance(pages, QuantArray):
    q_BKSH = _gather_one(pages.quant, layer, ids_BM, s)
    scale_BKS1 = _gather_one(pages.scale, layer, ids_BM, s)
    return (q_BKSH.astype(jnp.float32) * scale_BKS1).astype(dtype or jnp.float32)
  x_BKSH = _gather_one(pages, layer, ids_BM, s)
  return x_BKSH if dtype is None else x_BKSH.astype(dtype)


def _gather_one(pages_LPKZH: jax.Array, layer: int, ids_BM: jax.Array, s: int) -> jax.Array:
  b, m = ids_BM.shape
  _, p, kh, z, h = pages_LPKZH.shape
  ids_BM = jnp.where((ids_BM >= 0) & (ids_BM < p), ids_BM, p)  # negative too: JAX would wrap it
  x_BMKZH = pages_LPKZH.at[layer, ids_BM].get(mode="fill", fill_value=0)
  x_BKSH = jnp.swapaxes(x_BMKZH, 1, 2).reshape(b, kh, m * z, h)  # a bitcast when K == 1
  return x_BKSH if m * z == s else x_BKSH[:, :, :s]


def init_paged(cfg: ModelConfig, batch: int, num_pages: int, page_size: int,
               pages_per_seq: int, dtype=jnp.float32, sink_pool: bool = False,
               backend: CpuBackend = CpuBackend()) -> PagedKV:
  """An empty pool (zeros) with every table entry the null page; ``dtype`` int8: quantized;
  ``backend``: the one the pool's attention runs on."""
  shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)

  def empty() -> Pages:
    if is_int8(dtype):
      return QuantArray(quant=jnp.zeros(shape, jnp.int8),
                        scale=jnp.zeros(shape[:-1] + (1,), jnp.float32))
    return jnp.zeros(shape, dtype)

  return PagedKV(k_pages=empty(), v_pages=empty(),
                 page_table=jnp.full((batch, pages_per_seq), num_pages, jnp.int32),
                 lengths=jnp.zeros((batch,), jnp.int32),
                 sinks=jnp.zeros((batch,), jnp.int32) if sink_pool else None,
                 window=jnp.zeros((batch,), jnp.int32) if sink_pool else None,
                 rope_theta=cfg.rope_theta if sink_pool else None, backend=backend)


def page_bytes(cfg: ModelConfig, page_size: int, dtype: str | np.dtype | type) -> int:
  """Bytes of one page: K and V of every layer, ``page_size`` positions (int8: with the
  float32 scale of every token and kv head)."""
  per_token_head = cfg.head_dim * jnp.dtype(dtype).itemsize + (4 if is_int8(dtype) else 0)
  return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * per_token_head


def copy_pages(kv: PagedKV, src_C: jax.Array, dst_C: jax.Array) -> PagedKV:
  """Copies page ``src_C[c]`` to ``dst_C[c]`` in every layer (fork copy-on-write). A ``dst``
  outside ``[0, P)`` is padding and copies nothing."""
  dst_C = jnp.where((dst_C >= 0) & (dst_C < kv.num_pages), dst_C, kv.num_pages)
  src_C = jnp.clip(src_C, 0, kv.num_pages - 1)
  copy = lambda a: a.at[:, dst_C].set(a[:, src_C], mode="drop")
  return kv.replace(k_pages=jax.tree.map(copy, kv.k_pages),
                    v_pages=jax.tree.map(copy, kv.v_pages))


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
  return KVCache(k=k, v=v, lengths=kv.lengths, backend=kv.backend)


__all__ = ["PagedKV", "Pages", "ring_entries", "is_int8", "pages_dtype", "init_paged",
           "page_bytes", "copy_pages", "unbacked", "to_cache"]
