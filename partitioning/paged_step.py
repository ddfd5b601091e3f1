"""The partitioned step over paged KV memory: ``models.step.Step`` for a (mesh, FFN layout,
attention layout), and the pair of steps for two phases (one mesh or two sub-meshes).

Contract:
  * ``PagedShardedStep(cfg, mesh, ffn, attn, backend, collective_matmul)``:
    ``partitioning.collectives``' forward (``collective_matmul``: ws_*'s FFN collectives looped
    into its einsums, ``partitioning.collective_matmul``)
    (one ``shard_map``) over a ``models.paged_kv.PagedKV``; ``backend`` (static, a
    ``models.cpu.backend.CpuBackend``) is part of every jit key and of the pools it makes.
  * Pool sharding: the page axis is sharded over ``kv_axes`` (the layout's attention batch
    axes; ``kv_shards`` their size): shard ``s`` owns page ids ``[s * P_s, (s + 1) * P_s)``,
    the sub-pools of ``serving.kv_pages``. Row ``r`` of a call runs on shard
    ``r // (R / kv_shards)`` and its pages must be there (``misplaced`` counts the others).
  * ``place_params`` / ``param_sharding``: the FFN layout's resident copy; ``init_kv``: the pool
    in ``kv_sharding()``; ``describe()``: JSON-able plan, reasons and KV sharding.
  * ``phase_steps(cfg, mesh, prefill=, decode=, on_mismatch=, backend=)``: the (prefill,
    decode) pair, one params copy when their stored layouts agree (else decode in the prefill
    family, or two copies); ``relayout`` re-lays a whole pool, ``transfer_pages`` copies given
    pages between pools (ids outside ``[0, P_dst)`` are padding).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models import kv_cache
from models.kv_cache import KVStore
from models.config import ModelConfig
from models.cpu.backend import CpuBackend
from models.lora import LoraBatch
from models.paged_kv import PagedKV, Pages, init_paged, is_int8, pages_dtype
from models.quant import QuantArray
from models.weights import Params, abstract_params
from partitioning import comm
from partitioning.collectives import shard_params, sharded_forward
from partitioning.layouts import (
    AttnLayout, Axes, FfnLayout, LayoutPlan, axes_size, get_attn_layout, get_ffn_layout,
    make_plan, param_fallbacks, param_shardings, spec_entry)
from partitioning.mesh import mesh_shape
from partitioning.planner import Candidate


def _no_lora(lora: LoraBatch | None) -> None:
  if lora is not None:
    raise ValueError("LoRA adapters run on the unsharded step (one device), not a mesh layout")


@dataclasses.dataclass(frozen=True)
class PagedShardedStep:
  """``models.step.Step`` under (ffn, attn) on ``mesh`` over a page-sharded ``PagedKV``."""
  cfg: ModelConfig
  mesh: Mesh
  ffn: FfnLayout
  attn: AttnLayout
  backend: CpuBackend = CpuBackend()  # static: part of the jit key (models.cpu.backend)
  collective_matmul: bool = False  # the FFN's collectives looped into its einsums (ws_*)

  @classmethod
  def make(cls, cfg: ModelConfig, mesh: Mesh, ffn: str | FfnLayout,
           attn: str | AttnLayout, backend: CpuBackend = CpuBackend(),
           collective_matmul: bool = False) -> "PagedShardedStep":
    return cls(cfg, mesh, get_ffn_layout(ffn), get_attn_layout(attn), backend,
               collective_matmul)

  # -- the pool's sharding ------------------------------------------------------------------

  def plan(self, batch: int) -> LayoutPlan:
    return make_plan(self.cfg, self.mesh, self.ffn, self.attn, batch, self.collective_matmul)

  @property
  def kv_axes(self) -> Axes:
    """The attention batch axes with nothing falling back (a batch of mesh.size rows)."""
    return self.plan(self.mesh.devices.size).ab

  @property
  def kv_shards(self) -> int:
    return axes_size(self.mesh, self.kv_axes)

  def pool_spec(self, dtype=None) -> PagedKV:
    """``PagedKV`` of ``PartitionSpec`` (``dtype`` int8: the pages are ``QuantArray`` specs,
    values and scales sharded alike)."""
    pages = _pages_spec(P(None, spec_entry(self.kv_axes)), dtype)  # [L, P.ab, K, Z, H]
    return PagedKV(k_pages=pages, v_pages=pages, page_table=P(), lengths=P(),  # type: ignore[arg-type]  # specs
                   backend=self.backend)

  def kv_sharding(self, dtype=None) -> PagedKV:
    """``PagedKV`` of ``NamedSharding``: pages ``[L, P.ab, K, Z, H]`` (int8: and their scales
    ``[L, P.ab, K, Z, 1]``), table and lengths replicated."""
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.pool_spec(dtype))

  # -- the Step protocol --------------------------------------------------------------------

  def prefill(self, params: Params, tokens_BT: jax.Array, kv: PagedKV, start_B: jax.Array,
              lens_B: jax.Array, *, attend_len: int, logits_at: jax.Array | None = None,
              lora: LoraBatch | None = None) -> tuple[jax.Array, PagedKV]:
    _no_lora(lora)
    logits_BV, kv = self._forward(params, tokens_BT, kv, start_B, lens_B, attend_len)
    # Computed with rows sharded over the kv axes: every row's logits, then the rows asked for.
    return self._replicated(logits_BV if logits_at is None else logits_BV[logits_at]), kv

  def decode(self, params: Params, tokens_B: jax.Array, kv: PagedKV, active_B: jax.Array, *,
             attend_len: int, lora: LoraBatch | None = None) -> tuple[jax.Array, PagedKV]:
    _no_lora(lora)
    ones = jnp.ones_like(kv.lengths) if active_B is None else active_B.astype(jnp.int32)
    logits_BV, kv = self._forward(params, tokens_B[:, None], kv, None, ones, attend_len)
    return self._replicated(logits_BV), kv

  def _replicated(self, logits_BV: jax.Array) -> jax.Array:
    # logits [B, V]: P() (every device holds every row). The sampling program (top-k, penalties,
    # per-row scatters) then needs no cross-device row moves; on row-sharded logits XLA gave it
    # collective-permutes between processes, which hung under jax 0.12.1's gloo.
    return jax.lax.with_sharding_constraint(logits_BV, NamedSharding(self.mesh, P()))

  def place_params(self, params: Params) -> Params:
    return shard_params(params, self.cfg, self.mesh, self.ffn)

  stacked_params = False  # the sharded forward loops over per-layer weights

  def param_sharding(self, path: str, sds: jax.ShapeDtypeStruct) -> NamedSharding:
    """The resident sharding of the param at ``path`` (float or int8 tree): the
    ``models.io.placement.Target`` loaders make params straight into (then ``place_params`` is a
    no-op)."""
    del sds
    return _param_sharding_table(self.cfg, self.mesh, self.ffn)[path]

  def init_kv(self, batch: int, num_pages: int, page_size: int, pages_per_seq: int,
              dtype: jnp.dtype, sink_pool: bool = False) -> PagedKV:
    if sink_pool:
      raise ValueError("attention sinks (a sink pool) run on the unsharded step only")
    self._check_pages(num_pages)
    make = functools.partial(init_paged, self.cfg, batch, num_pages, page_size, pages_per_seq,
                             dtype, backend=self.backend)
    return jax.jit(make, out_shardings=self.kv_sharding(dtype))()

  def describe(self) -> dict[str, object]:
    plan = self.plan(self.mesh.devices.size)
    ab = "".join(self.kv_axes)
    rest = "".join(a for a in self.mesh.axis_names
                   if a not in self.kv_axes and self.mesh.shape[a] > 1)
    return {
        "kind": "paged_sharded", "model": self.cfg.name, "ffn": self.ffn.name,
        "attn": self.attn.name, "mesh": dict(zip(self.mesh.axis_names, mesh_shape(self.mesh))),
        "plan": plan.describe(), "reasons": list(plan.reasons),
        "collective_matmul": plan.looped,
        "param_fallbacks": param_fallbacks(self.cfg, self.mesh, self.ffn),
        "kv_axes": list(self.kv_axes), "kv_shards": self.kv_shards,
        "kv": (f"pages [L, P{'_' + ab if ab else ''}, K, Z, H]: {self.kv_shards} sub-pool(s), "
               + (f"replicated over {rest} (the head-sharding chips)" if rest
                  else "never replicated")),
        "rows": f"row r of a call on kv shard r // (R / {self.kv_shards})"}

  # -- internals ----------------------------------------------------------------------------

  def _check_pages(self, num_pages: int) -> None:
    if num_pages % self.kv_shards:
      raise ValueError(f"{self.ffn.name}+{self.attn.name}: {num_pages} pages do not split into "
                       f"{self.kv_shards} sub-pools")

  def _forward(self, params, tokens_BT, kv: PagedKV, start_B, lens_B, attend_len: int):
    b, t = tokens_BT.shape
    n = self.kv_shards
    if kv.sink_pool:
      raise ValueError("attention sinks (a sink pool) run on the unsharded step only")
    self._check_pages(kv.num_pages)
    if b % n:
      raise ValueError(f"{self.ffn.name}+{self.attn.name}: a call's {b} rows must be a multiple "
                       f"of the {n} kv shards (row r runs on shard r // (R / {n}))")
    plan = self.plan(b)
    if plan.ab != self.kv_axes:  # cannot happen for b % n == 0; guards the derivation
      raise ValueError(f"{b} rows run attention over {plan.ab}, the pool is over {self.kv_axes}")
    c = kv_cache.chunk_positions(kv.lengths, start_B, lens_B, t, kv.max_len)
    ab = spec_entry(self.kv_axes)
    pages = _pages_spec(P(None, ab), pages_dtype(kv.k_pages))  # [L, P.ab, K, Z, H]
    # A tree of PartitionSpecs in the arrays' places (lengths unread inside: positions are).
    specs: dict[str, Any] = dict(k_pages=pages, v_pages=pages, page_table=P(ab),  # [B.ab, M]
                                 lengths=P())
    spec = PagedKV(**specs, backend=kv.backend)
    axes = self.kv_axes

    def localize(block: PagedKV) -> PagedKV:
      p_s = block.num_pages
      local_BM = block.page_table - comm.linear_index(axes) * p_s
      ok_BM = (local_BM >= 0) & (local_BM < p_s)
      return block.replace(page_table=jnp.where(ok_BM, local_BM, p_s))

    def merge(block: PagedKV, local: KVStore) -> PagedKV:
      assert isinstance(local, PagedKV)
      return block.replace(k_pages=local.k_pages, v_pages=local.v_pages)

    logits, out = sharded_forward(params, tokens_BT, kv, c, cfg=self.cfg, mesh=self.mesh,
                                  ffn=self.ffn, plan=plan, attend_len=attend_len,
                                  all_logits=False, store_spec=spec, localize=localize,
                                  merge=merge, backend=self.backend)
    return logits, kv.replace(k_pages=out.k_pages, v_pages=out.v_pages, lengths=c.lengths_B)


@functools.lru_cache(maxsize=8)
def _param_sharding_table(cfg: ModelConfig, mesh: Mesh, ffn: FfnLayout
                          ) -> dict[str, NamedSharding]:
  """keystr path -> resident sharding, for the float and the int8 params trees at once."""
  table: dict[str, NamedSharding] = {}
  for quantized in (False, True):
    tree = param_shardings(cfg, mesh, ffn, quantized)
    for k, s in jax.tree_util.tree_flatten_with_path(tree)[0]:
      table[jax.tree_util.keystr(k)] = s
  return table


def _pages_spec(spec: P, dtype) -> P | QuantArray:
  """The spec tree of a pool's pages: ``spec`` itself, or for int8 ``QuantArray(spec, spec)``."""
  if dtype is not None and is_int8(dtype):
    return QuantArray(quant=spec, scale=spec)  # type: ignore[arg-type]  # specs in the arrays' places
  return spec


def misplaced(kv: PagedKV, kv_shards: int) -> jax.Array:
  """Table entries (real pages) of row r outside kv shard ``r // (R / kv_shards)``'s range:
  0 when the rows are arranged as the step's contract says."""
  b, _ = kv.page_table.shape
  p_s = kv.num_pages // kv_shards
  real = (kv.page_table >= 0) & (kv.page_table < kv.num_pages)
  shard_B = jnp.arange(b) // (b // kv_shards)
  return jnp.sum(real & (kv.page_table // p_s != shard_B[:, None]), dtype=jnp.int32)


# ---------------------------------------------------------------------------------------------
# Two phases, two layouts.

Mismatch = Literal["family", "two_copies"]
LayoutChoice = tuple[str, str] | Candidate


def _names(choice: LayoutChoice) -> tuple[str, str, str | None]:
  if isinstance(choice, Candidate):
    return choice.layout, choice.attention, f"planner: {choice.layout}+{choice.attention} on " \
        f"mesh {choice.mesh}"
  ffn, attn = choice
  return ffn, attn, None


def param_bytes(cfg: ModelConfig, mesh: Mesh, ffn: FfnLayout, quantized: bool) -> int:
  """Bytes of one resident params copy summed over the mesh's chips (replication counted)."""
  shapes = jax.tree.leaves(abstract_params(cfg, quantized=quantized))
  shards = jax.tree.leaves(param_shardings(cfg, mesh, ffn, quantized))
  total = 0
  for sds, sh in zip(shapes, shards, strict=True):
    per_chip = int(np.prod(sh.shard_shape(sds.shape))) * jnp.dtype(sds.dtype).itemsize
    total += per_chip * mesh.devices.size
  return total


@dataclasses.dataclass(frozen=True)
class PhaseSteps:
  """The (prefill, decode) steps of one deployment and how they share params and KV."""
  prefill: PagedShardedStep
  decode: PagedShardedStep
  shared_params: bool  # one resident copy serves both
  relayout: bool  # the pools' shardings differ: insert must re-lay the KV
  notes: tuple[str, ...]

  def place_params(self, params: Params) -> tuple[Params, Params]:
    """(prefill params, decode params): the same arrays when ``shared_params``."""
    pre = self.prefill.place_params(params)
    return pre, pre if self.shared_params else self.decode.place_params(params)

  def kv_shards(self) -> int:
    """Sub-pools for the host allocator: the least common multiple of the two phases' shard
    counts, so each sub-pool (a contiguous page range) lies inside one shard of each pool and a
    sequence's pages never straddle a shard of either (3 prefill and 2 decode shards: 6)."""
    return math.lcm(self.prefill.kv_shards, self.decode.kv_shards)

  def describe(self, quantized: bool = False) -> dict[str, object]:
    copies = 1 if self.shared_params else 2
    nbytes = param_bytes(self.prefill.cfg, self.prefill.mesh, self.prefill.ffn, quantized)
    if not self.shared_params:
      nbytes += param_bytes(self.decode.cfg, self.decode.mesh, self.decode.ffn, quantized)
    return {"prefill": self.prefill.describe(), "decode": self.decode.describe(),
            "param_copies": copies, "param_bytes": nbytes, "kv_relayout": self.relayout,
            "kv_relayout_cost": ("none: one pool sharding" if not self.relayout else
                                 "relayout: the whole pool re-laid per insert; transfer_pages: "
                                 "the inserted pages sent to every decode chip"),
            "notes": list(self.notes)}


def phase_steps(cfg: ModelConfig, mesh: Mesh, prefill: LayoutChoice, decode: LayoutChoice, *,
                decode_mesh: Mesh | None = None, on_mismatch: Mismatch = "family",
                backend: CpuBackend = CpuBackend(), collective_matmul: bool = False
                ) -> PhaseSteps:
  """The (prefill, decode) pair on ``mesh`` (or decode on its own ``decode_mesh``:
  disaggregated, always its own params copy and pool)."""
  p_ffn, p_attn, p_note = _names(prefill)
  d_ffn, d_attn, d_note = _names(decode)
  notes = [n for n in (p_note, d_note) if n]
  cm = collective_matmul
  pre = PagedShardedStep.make(cfg, mesh, p_ffn, p_attn, backend, cm)
  if decode_mesh is not None:
    dec = PagedShardedStep.make(cfg, decode_mesh, d_ffn, d_attn, backend, cm)
    notes.append("disaggregated: decode on its own sub-mesh with its own params copy and pool; "
                 "KV moves by transfer_pages")
    return PhaseSteps(pre, dec, shared_params=False, relayout=True, notes=tuple(notes))
  dec = PagedShardedStep.make(cfg, mesh, d_ffn, d_attn, backend, cm)
  shared = pre.ffn.stored == dec.ffn.stored
  if not shared:
    if on_mismatch == "family":
      notes.append(f"{pre.ffn.name} and {dec.ffn.name} store different weight layouts: decode "
                   f"kept in the prefill layout's family ({pre.ffn.name}+{dec.attn.name}), one "
                   "params copy")
      dec = PagedShardedStep(cfg, mesh, pre.ffn, dec.attn, backend, cm)
      shared = True
    elif on_mismatch == "two_copies":
      notes.append(f"{pre.ffn.name} and {dec.ffn.name} store different weight layouts: two "
                   "resident params copies (see param_bytes)")
    else:
      raise ValueError(f"on_mismatch must be 'family' or 'two_copies', got {on_mismatch!r}")
  else:
    notes.append(f"{pre.ffn.name} and {dec.ffn.name} share the stored layout: one params copy")
  relay = pre.kv_axes != dec.kv_axes
  return PhaseSteps(pre, dec, shared_params=shared, relayout=relay, notes=tuple(notes))


def relayout(kv: PagedKV, dst: PagedShardedStep) -> PagedKV:
  """The whole pool in ``dst``'s sharding (same page ids). Cost: see the module contract."""
  return jax.device_put(kv, dst.kv_sharding(pages_dtype(kv.k_pages)))


@functools.partial(jax.jit, donate_argnames=("pages",))
def _scatter_pages(pages: Pages, ids_C: jax.Array, x_LCKZH: Pages) -> Pages:
  def put(a, x):
    ids = jnp.where((ids_C >= 0) & (ids_C < a.shape[1]), ids_C, a.shape[1])
    return a.at[:, ids].set(x.astype(a.dtype), mode="drop")
  return jax.tree.map(put, pages, x_LCKZH)


@jax.jit
def _gather_pages(pages: Pages, ids_C: jax.Array) -> Pages:
  # [L, C, K, Z, H] (int8: and the scales [L, C, K, Z, 1])
  return jax.tree.map(lambda a: a.at[:, ids_C].get(mode="fill", fill_value=0), pages)


def transfer_pages(src: PagedKV, dst: PagedKV, src_ids: Sequence[int] | np.ndarray | jax.Array,
                   dst_ids: Sequence[int] | np.ndarray | jax.Array) -> PagedKV:
  """Copies pages ``src_ids[c]`` of ``src`` into ``dst_ids[c]`` of ``dst`` (any two meshes);
  returns the new ``dst`` (its pages donated) in ``dst``'s sharding. Tables and lengths are
  the caller's (the destination's host allocator)."""
  dst_sharding = jax.tree.leaves(dst.k_pages)[0].sharding
  if not isinstance(dst_sharding, NamedSharding):
    raise ValueError("transfer_pages: the destination pool must have a NamedSharding")
  src_sharding = jax.tree.leaves(src.k_pages)[0].sharding
  src_mesh = src_sharding.mesh if isinstance(src_sharding, NamedSharding) else None
  ids_s = np.asarray(src_ids, np.int32)
  ids_d = np.asarray(dst_ids, np.int32)
  if ids_s.shape != ids_d.shape or ids_s.ndim != 1:
    raise ValueError(f"src_ids {ids_s.shape} and dst_ids {ids_d.shape} must be equal 1-D shapes")
  rep_src = NamedSharding(src_mesh, P()) if src_mesh is not None else None
  rep_dst = NamedSharding(dst_sharding.mesh, P())
  src_idx = jax.device_put(ids_s, rep_src) if rep_src is not None else jnp.asarray(ids_s)
  dst_idx = jax.device_put(ids_d, rep_dst)
  out = {}
  for name in ("k_pages", "v_pages"):
    chunk = _gather_pages(getattr(src, name), src_idx)  # [L, C, K, Z, H] on the source mesh
    chunk = jax.device_put(chunk, rep_dst)  # whole on every destination chip
    out[name] = _scatter_pages(getattr(dst, name), dst_idx, chunk)  # [L, P.ab, K, Z, H]
  return dst.replace(**out)


__all__ = ["PagedShardedStep", "misplaced", "PhaseSteps", "phase_steps", "relayout",
           "transfer_pages", "param_bytes"]
