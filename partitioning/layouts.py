"""Named partitioning layouts: logical axes -> mesh axes, per the paper's Sections 3.2-3.3.

Contract:
  * ``FFN_LAYOUTS`` / ``ATTN_LAYOUTS`` map the names shared with ``partitioning.cost_model``
    (``ws_1d ws_2d wg_x wg_xy wg_xyz`` / ``heads batch_z batch_yz batch_xyz``) to frozen rule
    sets. An ``FfnLayout`` has three ``Rules`` (logical axis -> mesh axes): ``stored`` (the
    resident copy), ``gathered`` (after the per-layer weight all-gather) and ``residual`` (the
    stream between blocks); an ``AttnLayout`` names the mesh axes attention shards the batch over.
  * ``resolve(logical_axes, shape, rules, mesh) -> Resolved`` never fails: a dimension keeps the
    longest prefix of its mesh axes that divides it and records why.
  * ``param_specs`` / ``param_shardings``: the params' specs / ``NamedSharding``s (int8 leaves as
    ``QuantArray`` of specs); ``make_plan(cfg, mesh, ffn, attn, batch) -> LayoutPlan``: the
    effective axes of one step, which ``partitioning.collectives`` follows; ``cache_sharding``:
    the KV cache as ``[L, B.ab, K, S, H]``.
Paper notation: ``E_x F_yz`` = embed sharded over x, mlp over (y, z); letters in
``models/config.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.kv_cache import CACHE_AXES, KVCache
from models.weights import Params, abstract_params, logical_axes

Axes = tuple[str, ...]
LETTERS: Mapping[str, str] = {
    "batch": "B", "time": "T", "cache_seq": "S", "embed": "E", "mlp": "F", "heads": "N",
    "kv_heads": "K", "head_dim": "H", "vocab": "V", "layers": "L"}


@dataclasses.dataclass(frozen=True)
class Rules:
  """Logical axis name -> mesh axes (major to minor). Unnamed logical axes are replicated."""

  pairs: tuple[tuple[str, Axes], ...] = ()

  @classmethod
  def of(cls, **rules: str) -> "Rules":
    return cls(tuple((k, tuple(v)) for k, v in rules.items()))

  def get(self, logical: str | None) -> Axes:
    return dict(self.pairs).get(logical, ()) if logical else ()


@dataclasses.dataclass(frozen=True)
class FfnLayout:
  name: str
  stored: Rules
  gathered: Rules
  residual: Rules
  notation: str  # the paper's picture of it


@dataclasses.dataclass(frozen=True)
class AttnLayout:
  name: str
  batch_axes: Axes
  notation: str


_WS_1D = Rules.of(mlp="xyz", heads="xyz", vocab="xyz")
_E_X_F_YZ = Rules.of(embed="x", mlp="yz", heads="yz", vocab="yz")

FFN_LAYOUTS: Mapping[str, FfnLayout] = {
    "ws_1d": FfnLayout(
        "ws_1d", _WS_1D, _WS_1D, Rules.of(embed="xyz"),
        "W_in E F_xyz, W_out F_xyz E; x [B, T, E_xyz] --AG(xyz)--> [B, T, E] -> [B, T, F_xyz] "
        "-> [B, T, E]{xyz} --RS(xyz)--> [B, T, E_xyz]"),
    "ws_2d": FfnLayout(
        "ws_2d", _E_X_F_YZ, _E_X_F_YZ, Rules.of(embed="xyz"),
        "W_in E_x F_yz, W_out F_yz E_x; x [B, T, E_xyz] --AG(yz)--> [B, T, E_x] -> "
        "[B, T, F_yz]{x} --RS(x)--> [B, T, F_yzx] --AG(x)--> [B, T, F_yz] -> [B, T, E_x]{yz} "
        "--RS(yz)--> [B, T, E_xyz]"),
    "wg_x": FfnLayout(
        "wg_x", _E_X_F_YZ, Rules.of(mlp="yz", heads="yz", vocab="yz"),
        Rules.of(batch="x", embed="yz"),
        "W E_x F_yz --AG(x)--> E F_yz; x [B_x, T, E_yz] --AG(yz)--> [B_x, T, E] -> "
        "[B_x, T, F_yz] -> [B_x, T, E]{yz} --RS(yz)--> [B_x, T, E_yz]"),
    "wg_xy": FfnLayout(
        "wg_xy", _E_X_F_YZ, Rules.of(mlp="z", heads="z", vocab="z"),
        Rules.of(batch="xy", embed="z"),
        "W E_x F_yz --AG(xy)--> E F_z; x [B_xy, T, E_z] --AG(z)--> [B_xy, T, E] -> "
        "[B_xy, T, F_z] -> [B_xy, T, E]{z} --RS(z)--> [B_xy, T, E_z]"),
    "wg_xyz": FfnLayout(
        "wg_xyz", _E_X_F_YZ, Rules(), Rules.of(batch="xyz"),
        "W E_x F_yz --AG(xyz)--> E F; x [B_xyz, T, E] -> [B_xyz, T, F] -> [B_xyz, T, E]"),
}

ATTN_LAYOUTS: Mapping[str, AttnLayout] = {
    "heads": AttnLayout("heads", (), "Q [B, T, N_heads, H]; K/V cache replicated over the "
                        "head-sharding chips (multiquery: K = 1)"),
    "batch_z": AttnLayout("batch_z", ("z",), "Q --A2A(z)--> [B_z, T, N, H]; KV cache B_z"),
    "batch_yz": AttnLayout("batch_yz", ("y", "z"), "Q --A2A(yz)--> [B_yz, T, N, H]; KV cache B_yz"),
    "batch_xyz": AttnLayout("batch_xyz", ("x", "y", "z"),
                            "Q --A2A(xyz)--> [B_xyz, T, N, H]; KV cache B_xyz"),
}


def get_ffn_layout(layout: str | FfnLayout) -> FfnLayout:
  if isinstance(layout, FfnLayout):
    return layout
  try:
    return FFN_LAYOUTS[layout]
  except KeyError:
    raise ValueError(f"unknown ffn layout {layout!r}; known: {', '.join(FFN_LAYOUTS)}") from None


def get_attn_layout(layout: str | AttnLayout) -> AttnLayout:
  if isinstance(layout, AttnLayout):
    return layout
  try:
    return ATTN_LAYOUTS[layout]
  except KeyError:
    raise ValueError(
        f"unknown attention layout {layout!r}; known: {', '.join(ATTN_LAYOUTS)}") from None


def parse_pairs(text: str) -> list[tuple[str, str]]:
  """``"ffn:attn,ffn:attn"`` -> the (ffn, attn) pairs, each name checked (``ValueError``)."""
  pairs = []
  for item in (c for c in text.split(",") if c):
    parts = item.split(":")
    if len(parts) != 2:
      raise ValueError(f"layout pairs are ffn:attn, got {item!r}")
    pairs.append((get_ffn_layout(parts[0]).name, get_attn_layout(parts[1]).name))
  return pairs


# ---------------------------------------------------------------------------------------------
# Resolution: rules + shape + mesh -> per-dimension mesh axes, with fallbacks recorded.


def axes_size(mesh: Mesh, axes: Sequence[str]) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def resolve_dim(size: int, axes: Axes, mesh: Mesh, what: str = "") -> tuple[Axes, str | None]:
  """Longest prefix of ``axes`` (size-1 mesh axes dropped) whose size divides ``size``."""
  axes = tuple(a for a in axes if mesh.shape[a] > 1)
  if size == 1 or not axes:
    return (), None
  keep = axes
  while keep and size % axes_size(mesh, keep):
    keep = keep[:-1]
  if keep == axes:
    return keep, None
  kept = f"{''.join(keep)} (= {axes_size(mesh, keep)})" if keep else "nothing (replicated)"
  reason = (f"{what}: size {size} is not divisible by mesh axes {''.join(axes)} "
            f"(= {axes_size(mesh, axes)}); sharded over {kept}")
  return keep, reason


def spec_entry(axes: Axes):
  """One PartitionSpec entry for a dimension sharded over ``axes``."""
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


@dataclasses.dataclass(frozen=True)
class Resolved:
  """One array's sharding: mesh axes per dimension, and why any were dropped."""

  logical: tuple[str | None, ...]
  shape: tuple[int, ...]
  axes: tuple[Axes, ...]
  reasons: tuple[str, ...] = ()

  @property
  def spec(self) -> PartitionSpec:
    return PartitionSpec(*(spec_entry(a) for a in self.axes))

  def sharding(self, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, self.spec)

  @property
  def notation(self) -> str:
    """E.g. ``E_x F_yz``."""
    parts = []
    for name, ax in zip(self.logical, self.axes):
      letter = LETTERS.get(name or "", name or "?")
      parts.append(letter + ("_" + "".join(ax) if ax else ""))
    return " ".join(parts)


def resolve(logical: Sequence[str | None], shape: Sequence[int], rules: Rules, mesh: Mesh,
            what: str = "") -> Resolved:
  """Logical axes + shape -> ``Resolved`` under ``rules`` (falls back, never raises)."""
  if len(logical) != len(shape):
    raise ValueError(f"{what}: {len(logical)} logical axes for shape {tuple(shape)}")
  axes, reasons, used = [], [], set[str]()
  for d, (name, size) in enumerate(zip(logical, shape)):
    wanted = tuple(a for a in rules.get(name) if a not in used)  # a mesh axis shards one dim
    ax, reason = resolve_dim(size, wanted, mesh, f"{what} dim {d} ({name})")
    used.update(ax)
    axes.append(ax)
    if reason:
      reasons.append(reason)
  return Resolved(tuple(logical), tuple(shape), tuple(axes), tuple(reasons))


def logical_to_spec(logical: Sequence[str | None], shape: Sequence[int], rules: Rules,
                    mesh: Mesh) -> PartitionSpec:
  return resolve(logical, shape, rules, mesh).spec


def logical_to_sharding(logical: Sequence[str | None], shape: Sequence[int], rules: Rules,
                        mesh: Mesh) -> NamedSharding:
  return resolve(logical, shape, rules, mesh).sharding(mesh)


def _gathered(stored: Resolved, rules: Rules) -> Resolved:
  """What a chip holds after the weight all-gather: the stored axes the gathered rules keep."""
  axes = tuple(tuple(a for a in ax if a in rules.get(name))
               for name, ax in zip(stored.logical, stored.axes))
  return dataclasses.replace(stored, axes=axes)


def _path_name(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator=".")


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


@functools.lru_cache(maxsize=64)
def _param_specs(cfg: ModelConfig, mesh: Mesh, layout: FfnLayout, quantized: bool,
                 gathered: bool) -> Params:
  names = logical_axes(cfg, quantized)
  shapes = abstract_params(cfg, quantized=quantized)

  def one(path, ax, sds):
    r = resolve(ax, sds.shape, layout.stored, mesh, _path_name(path))
    return _gathered(r, layout.gathered) if gathered else r

  return jax.tree_util.tree_map_with_path(one, names, shapes, is_leaf=_is_axes)


def param_specs(cfg: ModelConfig, mesh: Mesh, layout: str | FfnLayout, quantized: bool = False,
                gathered: bool = False) -> Params:
  """Params pytree of ``Resolved`` (stored, or after the per-layer weight all-gather)."""
  return _param_specs(cfg, mesh, get_ffn_layout(layout), quantized, gathered)


def _is_resolved(x) -> bool:
  return isinstance(x, Resolved)


def param_shardings(cfg: ModelConfig, mesh: Mesh, layout: str | FfnLayout,
                    quantized: bool = False) -> Params:
  """Params pytree of ``NamedSharding`` (resident copy), e.g. for orbax restore."""
  return jax.tree.map(lambda r: r.sharding(mesh), param_specs(cfg, mesh, layout, quantized),
                      is_leaf=_is_resolved)


def param_fallbacks(cfg: ModelConfig, mesh: Mesh, layout: str | FfnLayout,
                    quantized: bool = False) -> list[str]:
  """Every recorded fallback of the stored params (empty when all dimensions divide)."""
  leaves = jax.tree.leaves(param_specs(cfg, mesh, layout, quantized), is_leaf=_is_resolved)
  return [reason for r in leaves for reason in r.reasons]


def match_params(tree: Params, params: Params) -> Params:
  """Re-shapes a specs / shardings tree to ``params``' exact treedef (``QuantArray.act_quant``
  is static, so the tree built from ``logical_axes`` may differ from the params in it)."""
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, (Resolved, NamedSharding)))
  treedef = jax.tree.structure(params)
  if treedef.num_leaves != len(leaves):
    raise ValueError(f"params have {treedef.num_leaves} arrays, the layout describes "
                     f"{len(leaves)}: wrong config or quantized flag?")
  return jax.tree.unflatten(treedef, leaves)


# ---------------------------------------------------------------------------------------------
# One step's effective plan.


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
  """Effective mesh axes of every sharded dimension of one step, after fallbacks.

  Weights (after the per-layer gather): ``[E.we]``, heads ``N.wh``, mlp ``F.wf``, vocab ``V.wv``;
  stored heads ``N.sh``. Residual stream ``[B.rb, T, E.re]``. Q after its projection is reduced
  over ``we`` by a reduce-scatter onto heads (``q_scatter``, the 2D layout) or an all-reduce;
  ``move`` are the axes the all-to-all moves from heads to batch, so attention and the KV cache
  run as ``[B.ab, T, N, H]`` with ``ab = rb + move``. The FFN hidden is reduce-scattered over
  ``f_scatter`` (2D). Logits come out ``[B.ub, (T,) V.wv]``.
  """

  ffn: str
  attn: str
  batch: int
  rb: Axes
  re: Axes
  we: Axes
  wh: Axes
  wf: Axes
  wv: Axes
  sh: Axes
  q_scatter: Axes
  f_scatter: Axes
  move: Axes
  ab: Axes
  ub: Axes
  reasons: tuple[str, ...] = ()
  # The FFN's activation all-gather (over re less we) and its reduce-scatter (over wf) looped
  # into its first and last einsums (``partitioning.collective_matmul``; a parallel block: into
  # the attention's projections too): ws_1d / ws_2d, when asked for.
  looped: bool = False

  def key(self) -> tuple:
    """Equal for two (ffn, attn) names that run exactly the same collectives."""
    return tuple(getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name not in ("ffn", "attn", "reasons"))

  def describe(self) -> str:
    def s(letter, axes):
      return letter + ("_" + "".join(axes) if axes else "")
    return (f"{self.ffn}+{self.attn}: residual [{s('B', self.rb)}, T, {s('E', self.re)}]; "
            f"weights {s('E', self.we)} {s('F', self.wf)} {s('N', self.wh)} {s('V', self.wv)}; "
            f"attention [{s('B', self.ab)}, T, N, H] (all-to-all over "
            f"{''.join(self.move) or 'nothing'}); KV cache [L, {s('B', self.ab)}, K, S, H]")


@functools.lru_cache(maxsize=256)
def _make_plan(cfg: ModelConfig, mesh: Mesh, ffn: FfnLayout, attn: AttnLayout,
               batch: int, collective_matmul: bool = False) -> LayoutPlan:
  reasons: list[str] = []

  def fit(size, axes, what):
    ax, reason = resolve_dim(size, axes, mesh, what)
    if reason:
      reasons.append(reason)
    return ax

  def weight(size, logical):
    stored = fit(size, ffn.stored.get(logical), f"weights {logical}")
    return stored, tuple(a for a in stored if a in ffn.gathered.get(logical))

  def size(axes):
    return axes_size(mesh, axes)

  _, we = weight(cfg.embed_dim, "embed")
  sh, wh = weight(cfg.num_heads, "heads")
  _, wf = weight(cfg.mlp_dim, "mlp")
  _, wv = weight(cfg.vocab_size, "vocab")
  rb = fit(batch, ffn.residual.get("batch"), "residual batch")
  re = fit(cfg.embed_dim, ffn.residual.get("embed"), "residual embed")
  clash = set(rb) & set(we + wh + wf + wv)
  if clash:
    raise ValueError(f"layout {ffn.name}: mesh axes {sorted(clash)} shard both the batch and a "
                     "weight dimension")
  for name, other in (("heads", wh), ("mlp", wf), ("vocab", wv)):
    if set(we) & set(other):  # they share a weight (q, gate, unembed): one axis per dim
      raise ValueError(f"layout {ffn.name}: embed and {name} are sharded over the same axes")
  local_b = batch // size(rb)
  q_scatter = f_scatter = ()
  if we:
    if (cfg.num_heads // size(wh)) % size(we) == 0:
      q_scatter = we
    else:
      reasons.append(f"q projection: {cfg.num_heads // size(wh)} heads per chip not divisible by "
                     f"{''.join(we)} (= {size(we)}); all-reduce instead of reduce-scatter")
    if (cfg.mlp_dim // size(wf)) % size(we) == 0:
      f_scatter = we
    else:
      reasons.append(f"ffn hidden: {cfg.mlp_dim // size(wf)} per chip not divisible by "
                     f"{''.join(we)}; all-reduce instead of reduce-scatter")
  qh = wh + q_scatter
  move = tuple(a for a in attn.batch_axes if a in qh and mesh.shape[a] > 1)
  idle = [a for a in attn.batch_axes if mesh.shape[a] > 1 and a not in qh + rb]
  if idle:
    reasons.append(f"attention {attn.name}: {''.join(idle)} shards neither the query heads "
                   f"(over {''.join(qh) or 'nothing'}) nor the batch; nothing to move there")
  wanted = move
  while move and local_b % size(move):
    move = move[:-1]
  if move != wanted:
    reasons.append(f"attention {attn.name}: {local_b} rows per chip not divisible by "
                   f"{''.join(wanted)} (= {size(wanted)}); batch-sharded over "
                   f"{''.join(rb + move) or 'nothing'}")
  ub = rb + we if we and local_b % size(we) == 0 else rb
  looped = False
  if collective_matmul:
    gathered = re[len(we):]
    if cfg.parallel_block and wh != wf:
      reasons.append(f"collective matmul: a parallel block's heads ({''.join(wh)}) and mlp "
                     f"({''.join(wf)}) sharded differently; plain collectives")
    elif re[:len(we)] != we or gathered != wf or size(wf) < 2:
      reasons.append(f"collective matmul: {ffn.name} gathers no activations into its FFN "
                     "(weight-stationary layouts only); plain collectives")
    else:
      looped = True
  return LayoutPlan(ffn=ffn.name, attn=attn.name, batch=batch, rb=rb, re=re, we=we, wh=wh, wf=wf,
                    wv=wv, sh=sh, q_scatter=q_scatter, f_scatter=f_scatter, move=move,
                    ab=rb + move, ub=ub, reasons=tuple(reasons), looped=looped)


def make_plan(cfg: ModelConfig, mesh: Mesh, ffn: str | FfnLayout, attn: str | AttnLayout,
              batch: int, collective_matmul: bool = False) -> LayoutPlan:
  """The effective plan of one step of ``batch`` rows (see ``LayoutPlan``)."""
  if batch < 1:
    raise ValueError(f"batch must be >= 1, got {batch}")
  return _make_plan(cfg, mesh, get_ffn_layout(ffn), get_attn_layout(attn), batch,
                    collective_matmul)


def cache_spec(plan: LayoutPlan) -> PartitionSpec:
  """``[L, B.ab, K, S, H]``."""
  return PartitionSpec(*(spec_entry(plan.ab) if a == "batch" else None for a in CACHE_AXES))


def cache_sharding(cfg: ModelConfig, mesh: Mesh, ffn: str | FfnLayout, attn: str | AttnLayout,
                   batch: int) -> KVCache:
  """``KVCache`` of ``NamedSharding``: k/v batch-sharded over the attention batch axes,
  lengths replicated."""
  spec = cache_spec(make_plan(cfg, mesh, ffn, attn, batch))
  kv = NamedSharding(mesh, spec)
  return KVCache(k=kv, v=kv, lengths=NamedSharding(mesh, PartitionSpec()))  # type: ignore[arg-type]  # shardings in the arrays' places


__all__ = [
    "Axes", "Rules", "FfnLayout", "AttnLayout", "FFN_LAYOUTS", "ATTN_LAYOUTS", "get_ffn_layout",
    "get_attn_layout", "parse_pairs", "Resolved", "resolve", "resolve_dim", "logical_to_spec",
    "logical_to_sharding", "param_specs", "param_shardings", "param_fallbacks", "match_params",
    "LayoutPlan", "make_plan", "cache_spec", "cache_sharding", "axes_size", "spec_entry"]
