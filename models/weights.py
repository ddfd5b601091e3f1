"""One description per weight: shape, logical axes, init and quantization facts.

Contract: ``param_infos(cfg)`` returns the params pytree with an ``ArrayInfo`` at every leaf.
Everything else derives from it: ``init_params`` (random init), ``abstract_params`` (shapes for
restore / AOT), ``logical_axes`` (for partitioning), and ``models.quant`` quantization
(``ArrayInfo.contract_axes`` says which axes a matmul reduces, so scales are per output channel).

Params layout (a nested dict; ``layers`` is a list, one dict per layer, so each layer's weights
are their own buffers and a Python loop over layers never slices a stacked array):
  embed [V, D]; unembed [D, V] (untied only); final_norm [D];
  layers[i]: attn_norm [D], mlp_norm [D] (serial block only), q [D, N, H], k [D, K, H],
             v [D, K, H], o [N, H, D], gate [D, F], up [D, F], down [F, D].
``stack_layers(params)`` is the other layout, for a ``lax.scan`` over layers (compile time
independent of depth, ``models.transformer``): ``layers`` one dict whose every leaf has a leading
``[L]`` axis (a ``QuantArray``'s values and scales alike); ``is_stacked`` tells them apart.
``tile_params(params, cfg)`` adds to each bf16 matmul weight its copy for the tiled decode kernel
(and weight-only int8: ``models.quant.TiledArray``), in either layout; ``untile`` drops them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.quant import QuantArray, TiledArray, quantize_array, tile_array

Init = Literal["normal", "ones", "zeros"]
Params = dict  # nested dict / list pytree of jax.Array | QuantArray


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
  shape: tuple[int, ...]
  logical_axes: tuple[str, ...]
  init: Init = "normal"
  contract_axes: tuple[int, ...] = ()  # axes a matmul reduces; () = not a matmul weight

  @property
  def quantizable(self) -> bool:
    return bool(self.contract_axes)

  @property
  def fan_in(self) -> int:
    return math.prod(self.shape[a] for a in self.contract_axes) if self.contract_axes else 1


def _layer_infos(cfg: ModelConfig) -> dict[str, ArrayInfo]:
  d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  norm_init: Init = "zeros" if cfg.norm_plus_one else "ones"
  infos = {
      "attn_norm": ArrayInfo((d,), ("embed",), norm_init),
      "q": ArrayInfo((d, n, h), ("embed", "heads", "head_dim"), contract_axes=(0,)),
      "k": ArrayInfo((d, k, h), ("embed", "kv_heads", "head_dim"), contract_axes=(0,)),
      "v": ArrayInfo((d, k, h), ("embed", "kv_heads", "head_dim"), contract_axes=(0,)),
      "o": ArrayInfo((n, h, d), ("heads", "head_dim", "embed"), contract_axes=(0, 1)),
      "gate": ArrayInfo((d, f), ("embed", "mlp"), contract_axes=(0,)),
      "up": ArrayInfo((d, f), ("embed", "mlp"), contract_axes=(0,)),
      "down": ArrayInfo((f, d), ("mlp", "embed"), contract_axes=(0,)),
  }
  if not cfg.parallel_block:
    infos["mlp_norm"] = ArrayInfo((d,), ("embed",), norm_init)
  return infos


def param_infos(cfg: ModelConfig) -> Params:
  d, v = cfg.embed_dim, cfg.vocab_size
  infos: Params = {
      # The embedding is "contracted" over D when it doubles as the (tied) unembedding, so its
      # int8 scale is per vocab row, which also suits the lookup.
      "embed": ArrayInfo((v, d), ("vocab", "embed"), contract_axes=(1,)),
      "final_norm": ArrayInfo((d,), ("embed",), "zeros" if cfg.norm_plus_one else "ones"),
      "layers": [_layer_infos(cfg) for _ in range(cfg.num_layers)],
  }
  if not cfg.tie_embeddings:
    infos["unembed"] = ArrayInfo((d, v), ("embed", "vocab"), contract_axes=(0,))
  return infos


def _is_info(x) -> bool:
  return isinstance(x, ArrayInfo)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
  """Random init: normal(0, 1/sqrt(fan_in)) matmul weights (embedding: normal(0, 1))."""
  infos = param_infos(cfg)
  leaves, treedef = jax.tree.flatten(infos, is_leaf=_is_info)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [init_array(i, k, dtype) for i, k in zip(leaves, keys)])


def init_array(info: ArrayInfo, key: jax.Array, dtype=jnp.float32) -> jax.Array:
  """One weight of ``init_params`` (``key``: its share of the split; see ``init_params``)."""
  if info.init == "ones":
    return jnp.ones(info.shape, dtype)
  if info.init == "zeros":
    return jnp.zeros(info.shape, dtype)
  std = 1.0 if info.logical_axes == ("vocab", "embed") else 1.0 / math.sqrt(info.fan_in)
  return (std * jax.random.normal(key, info.shape, jnp.float32)).astype(dtype)


def quantize(params: Params, cfg: ModelConfig, act_quant: bool = False) -> Params:
  """Float params -> params with every matmul weight a ``QuantArray`` (norms stay float)."""
  infos = param_infos(cfg)

  def one(info: ArrayInfo, w):
    if isinstance(w, QuantArray) or not info.quantizable:
      return w
    return quantize_array(w, info.contract_axes, act_quant=act_quant)

  return jax.tree.map(one, infos, params, is_leaf=_is_info)


def _quant_leaf(info: ArrayInfo, make):
  scale_shape = tuple(1 if a in info.contract_axes else s for a, s in enumerate(info.shape))
  return QuantArray(quant=make(info.shape, jnp.int8), scale=make(scale_shape, jnp.float32))


def abstract_params(cfg: ModelConfig, dtype=jnp.float32, quantized: bool = False,
                    act_quant: bool = False) -> Params:
  """``jax.ShapeDtypeStruct`` pytree of the params (float or int8) without allocating."""
  def make(shape, dt):
    return jax.ShapeDtypeStruct(shape, dt)

  def one(info: ArrayInfo):
    if quantized and info.quantizable:
      q = _quant_leaf(info, make)
      return q.replace(act_quant=act_quant)
    return make(info.shape, dtype)

  return jax.tree.map(one, param_infos(cfg), is_leaf=_is_info)


def logical_axes(cfg: ModelConfig, quantized: bool = False) -> Params:
  """The params pytree with a tuple of logical axis names at every array leaf.

  For int8 weights both ``quant`` and ``scale`` carry the weight's axes (scale's contracted axes
  have size 1, which any partitioner must leave unsharded).
  """
  def one(info: ArrayInfo):
    if quantized and info.quantizable:
      return QuantArray(quant=info.logical_axes, scale=info.logical_axes)  # type: ignore[arg-type]  # axis names in the arrays' places
    return info.logical_axes

  return jax.tree.map(one, param_infos(cfg), is_leaf=_is_info)



def tile_params(params: Params, cfg: ModelConfig, pairs: bool = True, w8a8: bool = True,
                int8: bool = True, int8_quads: bool = False) -> Params:
  """Every matmul weight a tiled kernel takes as a ``TiledArray`` (its tiles contracted as
  ``ArrayInfo`` says): bf16 ones where ``pairs`` (AVX512-BF16 or AMX); weight-only int8 ones
  as AMX int8 quads where ``int8_quads``, else as pairs where ``pairs`` and ``int8``; W8A8
  ones where ``w8a8`` (AVX512-VNNI); the rest as it is."""
  infos = param_infos(cfg)
  stacked = is_stacked(params)
  if stacked:  # one info per stacked leaf, its axes after the leading [L]
    infos = {**infos, "layers": infos["layers"][0]}

  def one(info: ArrayInfo, w, layered: bool):
    if not info.quantizable or isinstance(w, TiledArray):
      return w
    if isinstance(w, QuantArray) and w.act_quant:
      tiled = w8a8
    elif isinstance(w, QuantArray):
      tiled = int8_quads or (pairs and int8)
    else:
      tiled = pairs and w.dtype == jnp.bfloat16
    if not tiled:
      return w
    quads = isinstance(w, QuantArray) and not w.act_quant and int8_quads
    return _tiler(info.contract_axes, layered, quads)(w)

  out = {k: jax.tree.map(lambda i, w: one(i, w, False), infos[k], v, is_leaf=_is_info)
         for k, v in params.items() if k != "layers"}
  out["layers"] = jax.tree.map(lambda i, w: one(i, w, stacked), infos["layers"],
                               params["layers"], is_leaf=_is_info)
  return out


def untile(params: Params) -> Params:
  """``params`` with every ``TiledArray`` back to its stored weight (for a step that makes its
  own copies, or none)."""
  return jax.tree.map(lambda w: w.array if isinstance(w, TiledArray) else w, params,
                      is_leaf=lambda w: isinstance(w, TiledArray))


@functools.cache
def _tiler(contract_axes: tuple[int, ...], layered: bool, quads: bool = False):
  """One jitted ``tile_array`` per contraction (compiled once per weight shape, not per weight;
  ``layered``: over a leading ``[L]`` axis; ``quads``: weight-only int8 as AMX int8 quads)."""
  tile = functools.partial(tile_array, contract_axes=contract_axes, quads=quads)
  return jax.jit(jax.vmap(tile) if layered else tile)


def stack_layers(params: Params) -> Params:
  """The same params with ``layers`` stacked: one dict of ``[L, ...]`` leaves."""
  if is_stacked(params):
    return params
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"])
  return {**params, "layers": stacked}


def is_stacked(params: Params) -> bool:
  return isinstance(params["layers"], dict)
