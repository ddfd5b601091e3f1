"""The transformer forward under a partitioning layout: ``shard_map`` with explicit collectives.

Contract:
  * ``make_sharded_step(cfg, mesh, ffn_layout, attn_layout, phase)``: a jitted step with the
    signature and semantics of ``models.transformer.jit_prefill`` / ``jit_decode_step`` (cache
    donated); ``step.plan(batch)`` is the ``layouts.LayoutPlan`` it runs. Place params with
    ``shard_params`` and the cache with ``shard_cache`` / ``init_sharded_cache``.
  * ``sharded_forward(params, tokens, store, chunk, plan=, store_spec=, backend=)``: the one
    ``shard_map`` forward both KV memories run through, reading and writing KV only through the
    chip's local ``models.kv_cache.KVStore``; ``backend`` (static) is how XLA:CPU computes
    the matmuls.
  * The math is ``models``' own (norms, rope, mlp, attend, ``quant.einsum``); what is added is
    communication (paper Sec. 3.2-3.3: reduce-scatter, all-to-all, all-gather per layer as
    ``LayoutPlan`` names them) and the RMSNorm / GLU split around it.
  * W8A8 int8 quantizes activations over the local contracted slice, so sharded contractions
    round differently from the unsharded model (weight-only int8 is exact up to order).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Literal, TypeVar

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from models import quant
from models.attention import attend, written_seen, zero_unseen
from models.config import ModelConfig
from models.cpu.backend import CpuBackend
from models import kv_cache
from models.kv_cache import KVCache, KVStore, init_cache, written_end
from models.layers import Rotation, glu, mlp, rms_norm, rotate, rotation
from models.quant import QuantArray
from models.transformer import embed as embed_lookup
from models.weights import Params
from partitioning import collective_matmul, comm
from partitioning.layouts import (
    AttnLayout, FfnLayout, LayoutPlan, Resolved, cache_sharding, cache_spec, get_attn_layout,
    get_ffn_layout, make_plan, match_params, param_shardings, param_specs, spec_entry)

Phase = Literal["prefill", "decode"]
_PERMUTABLE = ("mlp", "heads")  # dims every user permutes alike; see comm.gather_weight


def _shard_map(f, mesh: Mesh, in_specs, out_specs):
  # Replication checking is off: its typing rules (all_gather's output type) differ between jax
  # versions; correctness of every layout is checked numerically in tests/partitioning/test_layouts.py.
  if hasattr(jax, "shard_map"):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  from jax.experimental.shard_map import shard_map  # jax < 0.7
  return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def _is_resolved(x) -> bool:
  return isinstance(x, Resolved)


def is_quantized(params: Params) -> bool:
  return any(isinstance(w, QuantArray)
             for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantArray)))


def _gather(tree, stored, gathered):
  """Per-layer weight all-gather: stored -> gathered spec, dimension by dimension."""
  leaves, treedef = jax.tree.flatten(tree)
  specs = zip(jax.tree.leaves(stored, is_leaf=_is_resolved),
              jax.tree.leaves(gathered, is_leaf=_is_resolved))
  out = []
  for w, (rs, rg) in zip(leaves, specs, strict=True):
    for d, (name, src, dst) in enumerate(zip(rs.logical, rs.axes, rg.axes)):
      w = comm.gather_weight(w, d, src, dst, permute=name in _PERMUTABLE)
    out.append(w)
  return jax.tree.unflatten(treedef, out)


# ---------------------------------------------------------------------------------------------
# Local (per-chip) pieces, run inside shard_map.


def _norm(x: jax.Array, w: jax.Array, cfg: ModelConfig, axes: comm.Axes) -> jax.Array:
  """RMSNorm of ``x`` whose embed dimension is sharded over ``axes`` (mean square all-reduced)."""
  psum = (lambda v: comm.psum(v, axes)) if axes else None
  return rms_norm(x, w, cfg.norm_eps, cfg.norm_plus_one, psum=psum, dim=cfg.embed_dim)


def _embed(table, tokens_BT, plan: LayoutPlan, cfg: ModelConfig, dtype) -> jax.Array:
  # table [V.wv, E.we]; tokens [B.rb, T]. Each chip looks up the rows of its vocab shard.
  rows = table.shape[0]
  local_BT = tokens_BT - comm.linear_index(plan.wv) * rows
  x = embed_lookup({"embed": table}, jnp.clip(local_BT, 0, rows - 1), cfg, dtype)
  if plan.wv:
    x = x * ((local_BT >= 0) & (local_BT < rows))[..., None].astype(dtype)
  # [B.rb, T, E.we]{wv} --RS(wv)--> [B.rb, T, E.re]
  return comm.reduce(x, 2, plan.wv, plan.we, plan.re)


QKV = ("btd,dnh->btnh", "btd,dkh->btkh", "btd,dkh->btkh")


def _attention(h, layer, l, store: KVStore, ids, pos_BT, wpos_BT, rot_q: Rotation,
               plan: LayoutPlan,
               cfg: ModelConfig, attend_len: int, backend: CpuBackend):
  # h: [B.rb, T, E.we], normed. q [B.rb, T, N.wh, H]{we}; k, v [B.rb, T, K, H]{we}
  q, k, v = quant.einsums(QKV, h, (layer["q"], layer["k"], layer["v"]), backend)
  out, store = _attend(q, k, v, l, store, ids, pos_BT, wpos_BT, rot_q, plan, cfg, attend_len)
  y = quant.einsum("btnh,nhd->btd", out, layer["o"], backend)  # [B.rb, T, E.we]{wh}
  return y, store


def _attend(q, k, v, l, store: KVStore, ids, pos_BT, wpos_BT, rot_q: Rotation, plan: LayoutPlan,
            cfg: ModelConfig, attend_len: int):
  """Projections (partial over we) -> the attention output [B.rb, T, N.wh, H] before ``o``.
  Heads ids ride along every move of the heads dimension."""
  q = comm.reduce(q, 2, plan.we, plan.wh, plan.wh + plan.q_scatter)  # [B.rb, T, N.wh+qs, H]
  ids = comm.slice_chunk(ids, 0, plan.q_scatter)
  k, v = comm.psum(k, plan.we), comm.psum(v, plan.we)  # [B.rb, T, K, H], same on head shards
  q, k = rotate(q, rot_q), rotate(k, rot_q)  # angles of this chip's rows [B.rb, T]
  # Heads -> batch: [B.rb, T, N.qh, H] --A2A(move)--> [B.ab, T, N.(qh - move), H].
  q = comm.all_to_all(q, plan.move, 0, 2)
  ids = comm.all_gather(ids, 0, plan.move)
  k, v = comm.slice_chunk(k, 0, plan.move), comm.slice_chunk(v, 0, plan.move)  # [B.ab, T, K, H]
  pos_a = comm.slice_chunk(pos_BT, 0, plan.ab)
  wpos_a = comm.slice_chunk(wpos_BT, 0, plan.ab)
  # This chip's store holds rows [B.ab] (cache [L, B.ab, K, S, H], or pages [L, P.ab, K, Z, H]
  # with a [B.ab, M] table): write this chunk (padding positions are dropped), then attend.
  store = store.write(l, wpos_a, k, v)
  end_a = written_end(wpos_a, pos_a)  # [B.ab]: keys below it are the row's
  if cfg.num_kv_heads > 1 and (plan.wh or plan.q_scatter):
    # GQA with sharded query heads: give each local query head its own kv head (K -> N.local).
    k_att, v_att = store.read(l, attend_len)  # [B.ab, K, S, H]
    # A reused page's stale NaN / Inf past the row's end must not meet a masked 0.
    v_att = zero_unseen(v_att, written_seen(end_a, attend_len))
    kv_of_head = ids // cfg.q_per_kv
    k_att, v_att = jnp.take(k_att, kv_of_head, axis=1), jnp.take(v_att, kv_of_head, axis=1)
    out = attend(q, k_att, v_att, pos_a)  # [B.ab, T, N.(qh - move), H]
  else:
    out = store.attend(l, q, pos_a, attend_len, end_a)  # [B.ab, T, N.(qh - move), H]
  out = comm.all_to_all(out, plan.move, 2, 0)  # [B.rb, T, N.wh+qs, H]
  out = comm.reshard(out, 2, plan.wh + plan.q_scatter, plan.wh)  # AG(qs): [B.rb, T, N.wh, H]
  return out, store


def _mlp(h, layer, plan: LayoutPlan, cfg: ModelConfig, backend: CpuBackend) -> jax.Array:
  """[B.rb, T, E.we] -> [B.rb, T, E.we]{wf}."""
  if not plan.we:  # E is whole on every chip: models.layers.mlp on the F shard as is.
    return mlp(h, layer, cfg, backend)
  # [B.rb, T, F.wf]{we} each
  gate, up = quant.einsums(("btd,df->btf",) * 2, h, (layer["gate"], layer["up"]), backend)
  fs = plan.wf + plan.f_scatter
  gate = comm.reduce(gate, 2, plan.we, plan.wf, fs)  # --RS(we)--> [B.rb, T, F.wf+we]
  up = comm.reduce(up, 2, plan.we, plan.wf, fs)
  hid = comm.reshard(glu(gate, up, cfg.activation, h.dtype), 2, fs, plan.wf)  # --AG(we)--> [B.rb, T, F.wf]
  return quant.einsum("btf,fd->btd", hid, layer["down"], backend)  # [B.rb, T, E.we]{wf}


def _block(x, layer, l, store: KVStore, ids, pos_BT, wpos_BT, rot_q: Rotation, plan: LayoutPlan,
           cfg: ModelConfig, attend_len: int, backend: CpuBackend):
  # x: [B.rb, T, E.re]
  if plan.looped and cfg.parallel_block:
    return _parallel_looped(x, layer, l, store, ids, pos_BT, wpos_BT, rot_q, plan, cfg,
                            attend_len, backend)
  h = _norm(comm.reshard(x, 2, plan.re, plan.we), layer["attn_norm"], cfg, plan.we)
  attn, store = _attention(h, layer, l, store, ids, pos_BT, wpos_BT, rot_q, plan, cfg,
                           attend_len, backend)
  if cfg.parallel_block:
    ffn = _mlp(h, layer, plan, cfg, backend)
    if plan.wh == plan.wf:  # one reduce-scatter for both (PaLM's fused collective)
      return x + comm.reduce(attn + ffn, 2, plan.wh, plan.we, plan.re), store
    x = x + comm.reduce(attn, 2, plan.wh, plan.we, plan.re)
    return x + comm.reduce(ffn, 2, plan.wf, plan.we, plan.re), store
  x = x + comm.reduce(attn, 2, plan.wh, plan.we, plan.re)  # [B.rb, T, E.re]
  if plan.looped:  # the AG(re - we) and RS(wf) inside the FFN's first and last einsums
    return x + _mlp_looped(x, layer, plan, cfg, backend), store
  h = _norm(comm.reshard(x, 2, plan.re, plan.we), layer["mlp_norm"], cfg, plan.we)
  x = x + comm.reduce(_mlp(h, layer, plan, cfg, backend), 2, plan.wf, plan.we, plan.re)
  return x, store


def _mlp_looped(x, layer, plan: LayoutPlan, cfg: ModelConfig, backend: CpuBackend) -> jax.Array:
  """[B.rb, T, E.re] -> [B.rb, T, E.re], the normed FFN with ws_*'s activation collectives
  looped into its einsums (``partitioning.collective_matmul``; re = we + wf)."""
  # The norm on this chip's E.re chunk: mean square all-reduced over re, weight E.we sliced.
  h = _norm(x, comm.slice_chunk(layer["mlp_norm"], 0, plan.wf), cfg, plan.re)
  # [B.rb, T, E.re] --looped AG(wf) x W_in [E.we, F.wf]--> [B.rb, T, F.wf]{we}
  gate, up = collective_matmul.ag_einsums(("btd,df->btf",) * 2, h,
                                          (layer["gate"], layer["up"]), plan.wf, backend)
  hid = _hidden(gate, up, plan, cfg, h.dtype)
  # [B.rb, T, F.wf] x W_out [F.wf, E.we] --looped RS(wf)--> [B.rb, T, E.re]
  return collective_matmul.einsums_rs(("btf,fd->btd",), (hid,), (layer["down"],), plan.wf,
                                      backend)


def _hidden(gate, up, plan: LayoutPlan, cfg: ModelConfig, dtype) -> jax.Array:
  """gate, up [B.rb, T, F.wf]{we} -> the GLU's hidden [B.rb, T, F.wf]."""
  fs = plan.wf + plan.f_scatter
  gate = comm.reduce(gate, 2, plan.we, plan.wf, fs)  # --RS(we)--> [B.rb, T, F.wf+we]
  up = comm.reduce(up, 2, plan.we, plan.wf, fs)
  return comm.reshard(glu(gate, up, cfg.activation, dtype), 2, fs, plan.wf)  # --AG(we)-->


def _parallel_looped(x, layer, l, store: KVStore, ids, pos_BT, wpos_BT, rot_q: Rotation,
                     plan: LayoutPlan, cfg: ModelConfig, attend_len: int, backend: CpuBackend):
  """A parallel block (PaLM) with ws_*'s one all-gather looped into all five input einsums
  (q, k, v, gate, up) and its one reduce-scatter into both output einsums (o, down; wh = wf)."""
  h = _norm(x, comm.slice_chunk(layer["attn_norm"], 0, plan.wf), cfg, plan.re)
  q, k, v, gate, up = collective_matmul.ag_einsums(
      QKV + ("btd,df->btf",) * 2, h,
      (layer["q"], layer["k"], layer["v"], layer["gate"], layer["up"]), plan.wf, backend)
  out, store = _attend(q, k, v, l, store, ids, pos_BT, wpos_BT, rot_q, plan, cfg, attend_len)
  hid = _hidden(gate, up, plan, cfg, h.dtype)
  # [B.rb, T, N.wh, H] x o [N.wh, H, E.we] + [B.rb, T, F.wf] x down --looped RS(wf)--> E.re
  return x + collective_matmul.einsums_rs(("btnh,nhd->btd", "btf,fd->btd"), (out, hid),
                                          (layer["o"], layer["down"]), plan.wf, backend), store


def _unembed(x, top, last_B, plan: LayoutPlan, cfg: ModelConfig, all_logits: bool,
             backend: CpuBackend) -> jax.Array:
  # x: [B.rb, T, E.re] -> logits [B.ub, T, V.wv] (or [B.ub, V.wv]).
  if not all_logits:
    last = comm.slice_chunk(last_B, 0, plan.rb)
    x = jnp.take_along_axis(x, last[:, None, None], axis=1)
  h = _norm(comm.reshard(x, 2, plan.re, plan.we), top["final_norm"], cfg, plan.we)
  if cfg.tie_embeddings:
    logits = quant.einsum("btd,vd->btv", h, top["embed"], backend)  # [B.rb, T, V.wv]{we}
  else:
    logits = quant.einsum("btd,dv->btv", h, top["unembed"], backend)
  logits = comm.reduce(logits, 0, plan.we, plan.rb, plan.ub).astype(jnp.float32)
  return logits if all_logits else logits[:, 0]


def _local_step(params, ids, tokens_BT, pos_BT, wpos_BT, last_B, store: KVStore, *,
                plan: LayoutPlan, cfg: ModelConfig, stored, gathered, attend_len: int,
                all_logits: bool, backend: CpuBackend):
  top_keys = [k for k in params if k != "layers"]
  top = _gather({k: params[k] for k in top_keys}, {k: stored[k] for k in top_keys},
                {k: gathered[k] for k in top_keys})
  dtype = top["final_norm"].dtype  # activation dtype = float param dtype (never quantized)
  ids = comm.gather_weight(ids, 0, plan.sh, plan.wh, permute=True)
  x = _embed(top["embed"], comm.slice_chunk(tokens_BT, 0, plan.rb), plan, cfg, dtype)
  rot_q = rotation(comm.slice_chunk(pos_BT, 0, plan.rb), cfg.head_dim, cfg.rope_theta)
  for l, layer in enumerate(params["layers"]):
    layer = _gather(layer, stored["layers"][l], gathered["layers"][l])
    x, store = _block(x, layer, l, store, ids, pos_BT, wpos_BT, rot_q, plan, cfg, attend_len,
                      backend)
  return _unembed(x, top, last_B, plan, cfg, all_logits, backend), store


# ---------------------------------------------------------------------------------------------
# Global entry points.


S = TypeVar("S")


def sharded_forward(params: Params, tokens_BT: jax.Array, store: S, c: kv_cache.ChunkPositions,
                    *, cfg: ModelConfig, mesh: Mesh, ffn: FfnLayout, plan: LayoutPlan,
                    attend_len: int, all_logits: bool, store_spec: S,
                    localize: Callable[[S], KVStore] | None = None,
                    merge: Callable[[S, KVStore], S] | None = None,
                    backend: CpuBackend = CpuBackend()) -> tuple[jax.Array, S]:
  """The model under ``plan`` over a KV store, in one ``shard_map``.

  ``store`` is any pytree holding the KV memory, split over the mesh by ``store_spec`` (a
  pytree of ``PartitionSpec`` with the store's structure) so that each chip's block holds the
  KV of its attention-batch rows ``[B.ab]``. Inside, ``localize(block)`` gives the chip's
  ``KVStore`` view (default: the block itself) and ``merge(block, local)`` the block to return
  (default: ``local``). ``backend`` (static): how XLA:CPU computes the matmuls. Returns the logits ``[B.ub, (T,) V.wv]`` and the written store; its
  ``lengths`` are NOT advanced (the caller sets ``c.lengths_B``).
  """
  quantized = is_quantized(params)
  stored = param_specs(cfg, mesh, ffn, quantized)
  gathered = param_specs(cfg, mesh, ffn, quantized, gathered=True)
  p_specs = jax.tree.map(lambda r: r.spec, match_params(stored, params), is_leaf=_is_resolved)
  ub, wv = spec_entry(plan.ub), spec_entry(plan.wv)
  logits_spec = P(ub, None, wv) if all_logits else P(ub, wv)
  local_step = functools.partial(_local_step, plan=plan, cfg=cfg, stored=stored,
                                 gathered=gathered, attend_len=attend_len,
                                 all_logits=all_logits, backend=backend)

  def body(p, ids, toks, pos, wpos, last, block):
    local = localize(block) if localize else block
    logits, local = local_step(p, ids, toks, pos, wpos, last, local)
    return logits, (merge(block, local) if merge else local)

  step = _shard_map(body, mesh, in_specs=(p_specs, P(spec_entry(plan.sh)), P(), P(), P(), P(),
                                          store_spec),
                    out_specs=(logits_spec, store_spec))
  return step(params, jnp.arange(cfg.num_heads, dtype=jnp.int32), tokens_BT, c.pos_BT,
              c.wpos_BT, c.last_B, store)


def _prefill(params: Params, tokens_BT: jax.Array, cache: KVCache, start_B, lens_B, *,
             cfg: ModelConfig, mesh: Mesh, ffn: FfnLayout, attn: AttnLayout,
             attend_len: int | None, all_logits: bool):
  b, t = tokens_BT.shape
  attend_len = attend_len or cache.max_len
  c = kv_cache.chunk_positions(cache.lengths, start_B, lens_B, t, cache.max_len)
  plan = make_plan(cfg, mesh, ffn, attn, b)
  kv = cache_spec(plan)  # [L, B.ab, K, S, H]; lengths are not read inside (positions are)
  spec = KVCache(k=kv, v=kv, lengths=P())  # type: ignore[arg-type]  # specs in the arrays' places
  logits, out = sharded_forward(params, tokens_BT, cache, c, cfg=cfg, mesh=mesh, ffn=ffn,
                                plan=plan, attend_len=attend_len, all_logits=all_logits,
                                store_spec=spec)
  return logits, cache.replace(k=out.k, v=out.v, lengths=c.lengths_B)


def _decode(params: Params, tokens_B: jax.Array, cache: KVCache, active_B, *, attend_len,
            **bound):
  ones = jnp.ones_like(cache.lengths) if active_B is None else active_B.astype(jnp.int32)
  return _prefill(params, tokens_B[:, None], cache, None, ones, attend_len=attend_len,
                  all_logits=False, **bound)


def make_sharded_step(cfg: ModelConfig, mesh: Mesh, ffn_layout: str | FfnLayout,
                      attn_layout: str | AttnLayout, phase: Phase) -> Callable:
  """A jitted prefill or decode step under (ffn_layout, attn_layout) on ``mesh``."""
  ffn, attn = get_ffn_layout(ffn_layout), get_attn_layout(attn_layout)
  bound: dict[str, Any] = dict(cfg=cfg, mesh=mesh, ffn=ffn, attn=attn)

  def check(c):
    if c is not None and c != cfg:
      raise ValueError("cfg differs from the config this sharded step was built for")

  if phase == "prefill":
    jitted = jax.jit(functools.partial(_prefill, **bound),
                     static_argnames=("attend_len", "all_logits"), donate_argnames=("cache",))

    def prefill_step(params, tokens_BT, cache, start_B, lens_B, *, cfg=None, attend_len=None,
                     all_logits=False):
      check(cfg)
      return jitted(params, tokens_BT, cache, start_B, lens_B, attend_len=attend_len,
                    all_logits=all_logits)
    step: Any = prefill_step
  elif phase == "decode":
    jitted = jax.jit(functools.partial(_decode, **bound), static_argnames=("attend_len",),
                     donate_argnames=("cache",))

    def decode_step(params, tokens_B, cache, *, cfg=None, attend_len=None, active_B=None):
      check(cfg)
      return jitted(params, tokens_B, cache, active_B, attend_len=attend_len)
    step = decode_step
  else:
    raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
  step.plan = lambda batch: make_plan(cfg, mesh, ffn, attn, batch)
  step.jitted = jitted
  return step


def shard_params(params: Params, cfg: ModelConfig, mesh: Mesh,
                 layout: str | FfnLayout) -> Params:
  """Places ``params`` in ``layout``'s resident (stored) sharding."""
  shardings = match_params(param_shardings(cfg, mesh, layout, is_quantized(params)), params)
  return jax.device_put(params, shardings)


def shard_cache(cache: KVCache, cfg: ModelConfig, mesh: Mesh, ffn_layout: str | FfnLayout,
                attn_layout: str | AttnLayout) -> KVCache:
  """Places ``cache`` as the (ffn, attn) step expects it: ``[L, B.ab, K, S, H]``."""
  return jax.device_put(cache, cache_sharding(cfg, mesh, ffn_layout, attn_layout, cache.batch))


def init_sharded_cache(cfg: ModelConfig, batch: int, max_len: int | None, mesh: Mesh,
                       ffn_layout: str | FfnLayout, attn_layout: str | AttnLayout,
                       dtype=jnp.float32) -> KVCache:
  """An empty cache created directly in its sharding (never whole on one device)."""
  shardings = cache_sharding(cfg, mesh, ffn_layout, attn_layout, batch)
  return jax.jit(lambda: init_cache(cfg, batch, max_len, dtype), out_shardings=shardings)()


__all__ = ["make_sharded_step", "sharded_forward", "shard_params", "shard_cache", "init_sharded_cache",
           "param_shardings", "is_quantized"]
