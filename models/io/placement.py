"""Params made straight into their target shardings: each array (or each shard of it) is built on
its own devices, so a load never holds a whole extra copy of the model on one host.

Contract:
  * ``Target`` (where params go, as every loader takes it): ``None`` (the first local device),
    one ``Sharding``, a params-shaped pytree of them (int8 weights as ``QuantArray`` of two), or a
    callable ``(path, ShapeDtypeStruct) -> Sharding``. ``shardings_for(abstract, target)``
    resolves it per leaf (``ValueError`` naming the weight when it does not fit).
  * ``from_host(shape, dtype, sharding, read, on_bytes)``: a ``jax.Array`` whose shards come from
    ``read(index)``, only this process's, one shard on the host at a time.
  * ``build(...)``, ``init_params(...)``, ``quantize_placed(...)``, ``stack_placed(...)``: the params
    tree made, initialised, quantized or stacked one weight at a time in its sharding.
  * ``final_shardings(...)`` / ``sharding_of_source(final, path)``: the resolved tree, and the
    sharding a stored unstacked array is read into; ``progress(Progress)`` reports bytes placed
    and read. The engine side (``partitioning``) computes the target; models never import it.
Details: BUILD_NOTES "Design: Checkpoints".
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from models.config import ModelConfig
from models.quant import QuantArray, quantize_array
from models.weights import ArrayInfo, Params, abstract_params, init_array, param_infos

ShardingFn = Callable[[str, jax.ShapeDtypeStruct], Sharding]
Target = Sharding | Params | ShardingFn | None
Index = tuple[tuple[int, int], ...]  # (start, stop) per axis
Placement = Sharding | QuantArray  # a weight's sharding, or QuantArray(quant=, scale=) of them


@dataclasses.dataclass(frozen=True)
class Progress:
  placed_bytes: int
  read_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class WeightRef:
  """One weight of ``param_infos(cfg)``: top-level (``layer=None``) or of layer ``layer``."""
  name: str
  layer: int | None
  info: ArrayInfo

  @property
  def path(self) -> str:
    return (f"['{self.name}']" if self.layer is None
            else f"['layers'][{self.layer}]['{self.name}']")


MakeWeight = Callable[[WeightRef, Placement, Callable[[int], None]], jax.Array | QuantArray]


def _is_quant(x: object) -> bool:
  return isinstance(x, QuantArray)


def shardings_for(abstract: Params, target: Target) -> list[Sharding]:
  """One sharding per leaf of ``abstract`` (flatten order); see the module contract."""
  leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
  paths = [jax.tree_util.keystr(k) for k, _ in leaves]
  if target is None:
    target = SingleDeviceSharding(jax.local_devices()[0])
  if isinstance(target, Sharding):
    out = [target] * len(leaves)
  elif callable(target):
    out = [target(p, a) for p, (_, a) in zip(paths, leaves)]
  else:
    given = jax.tree_util.tree_flatten_with_path(
        target, is_leaf=lambda x: isinstance(x, Sharding))[0]
    by_path = {jax.tree_util.keystr(k): s for k, s in given}
    if set(by_path) != set(paths) or len(given) != len(paths):
      missing = sorted(set(paths) - set(by_path))[:5]
      extra = sorted(set(by_path) - set(paths))[:5]
      raise ValueError(f"shardings do not match the params tree (missing {missing}, "
                       f"unexpected {extra})")
    out = [by_path[p] for p in paths]
  for p, (_, a), s in zip(paths, leaves, out):
    if not isinstance(s, Sharding):
      raise ValueError(f"sharding for {p} is {type(s).__name__}, not a jax.sharding.Sharding")
    try:
      s.shard_shape(tuple(a.shape))
    except ValueError as e:  # jax's IndivisibleError, or a rank mismatch
      raise ValueError(f"sharding for param {p} {list(a.shape)} is not usable: {e}") from None
  return out


def _index(shape: Sequence[int], idx: tuple[slice, ...]) -> Index:
  return tuple(s.indices(n)[:2] for s, n in zip(idx, shape))


def from_host(shape: Sequence[int], dtype, sharding: Sharding,
              read: Callable[[Index], np.ndarray],
              on_bytes: Callable[[int], None] | None = None) -> jax.Array:
  """A ``jax.Array`` in ``sharding`` whose shards ``read`` gives (see the module contract)."""
  shape = tuple(shape)
  dtype = np.dtype(dtype)
  groups: dict[Index, list[jax.Device]] = {}
  for device, idx in sharding.addressable_devices_indices_map(shape).items():
    assert idx is not None  # typed Optional, but always devices_indices_map's value
    groups.setdefault(_index(shape, idx), []).append(device)
  want = sharding.shard_shape(shape)
  buffers: dict[jax.Device, jax.Array] = {}
  for index, devices in groups.items():
    host = read(index)
    if tuple(host.shape) != tuple(want) or host.dtype != dtype:
      raise AssertionError(f"read gave {host.dtype}{list(host.shape)} for index {index}, "
                           f"expected {dtype}{list(want)}")
    for device in devices:
      buffers[device] = jax.device_put(host, device).block_until_ready()
      if on_bytes is not None:
        on_bytes(host.nbytes)
    del host
  return jax.make_array_from_single_device_arrays(shape, sharding, list(buffers.values()))


def _local_bytes(x: jax.Array | QuantArray) -> int:
  return sum(s.data.nbytes for a in jax.tree.leaves(x) for s in a.addressable_shards)


def _layer_sharding(s: Sharding, where: str) -> Sharding:
  """The sharding of one layer of a stacked ``[L, ...]`` array in ``s``."""
  if isinstance(s, SingleDeviceSharding):
    return s
  if isinstance(s, NamedSharding):
    spec = tuple(s.spec)
    if spec and spec[0] is not None:
      raise ValueError(f"{where}: the stacked layer axis must be unsharded, got {s.spec}")
    return NamedSharding(s.mesh, PartitionSpec(*spec[1:]), memory_kind=s.memory_kind)
  raise ValueError(f"{where}: stacked layers need a NamedSharding or SingleDeviceSharding, "
                   f"got {type(s).__name__}")


def _allocate(sds: jax.ShapeDtypeStruct, sharding: Sharding) -> jax.Array:
  return jax.jit(lambda: jnp.zeros(sds.shape, sds.dtype), out_shardings=sharding)()


def _set_layer_impl(stacked, layer, i):
  return lax.dynamic_update_index_in_dim(stacked, layer.astype(stacked.dtype), i, 0)


_set_layer = jax.jit(_set_layer_impl, donate_argnums=0)


def stacked_abstract(abstract: Params) -> Params:
  """``abstract`` with ``layers`` one dict of ``[L, ...]`` structs (``stack_layers``' form)."""
  layers = abstract["layers"]
  stacked = jax.tree.map(lambda *xs: jax.ShapeDtypeStruct((len(xs),) + tuple(xs[0].shape),
                                                          xs[0].dtype), *layers)
  return {**abstract, "layers": stacked}


def _final_abstract(cfg: ModelConfig, dtype, quantized: bool, stacked: bool) -> Params:
  abstract = abstract_params(cfg, dtype, quantized=quantized)
  return stacked_abstract(abstract) if stacked else abstract


def _placements(abstract: Params, target: Target) -> Params:
  """``abstract``'s tree with a ``Sharding`` (``QuantArray`` of them) at every weight."""
  treedef = jax.tree.structure(abstract)
  return jax.tree.unflatten(treedef, shardings_for(abstract, target))


def build(cfg: ModelConfig, dtype, target: Target, make: MakeWeight, *, quantized: bool = False,
          stacked: bool = False, progress: Callable[[Progress], None] | None = None,
          read_bytes: Callable[[], int] = lambda: 0) -> Params:
  """The params tree made weight by weight in its target shardings (see the module contract)."""
  abstract = _final_abstract(cfg, dtype, quantized, stacked)
  where = _placements(abstract, target)
  infos = param_infos(cfg)
  placed = [0]

  def count(n: int) -> None:
    placed[0] += n
    if progress is not None:
      progress(Progress(placed[0], read_bytes()))

  def quiet(n: int) -> None:
    del n

  out: Params = {}
  for name, info in infos.items():
    if name != "layers":
      out[name] = make(WeightRef(name, None, info), where[name], count)
  layer_infos = infos["layers"]
  if not stacked:
    out["layers"] = [{name: make(WeightRef(name, i, info), where["layers"][i][name], count)
                      for name, info in li.items()} for i, li in enumerate(layer_infos)]
  else:
    out["layers"] = {}
    for name, info in layer_infos[0].items():
      sds, s = abstract["layers"][name], where["layers"][name]
      path = f"['layers']['{name}']"
      layer_s = jax.tree.map(lambda x: _layer_sharding(x, path), s)
      buf = jax.tree.map(_allocate, sds, s)
      count(_local_bytes(buf))
      for i in range(cfg.num_layers):
        w = make(WeightRef(name, i, layer_infos[i][name]), layer_s, quiet)
        buf = jax.tree.map(lambda b, x: _set_layer(b, x, i), buf, w)
        for a in jax.tree.leaves(w):
          a.delete()
      out["layers"][name] = buf
  if jax.tree.structure(out) != jax.tree.structure(abstract):
    raise AssertionError("placement.build made a tree that does not match models.weights")
  return out


def final_shardings(cfg: ModelConfig, dtype, quantized: bool, stacked: bool,
                    target: Target) -> Params:
  """The params tree (int8 / stacked as asked) with its ``Sharding`` at every array."""
  return _placements(_final_abstract(cfg, dtype, quantized, stacked), target)


def sharding_of_source(final: Params, path: str) -> Sharding:
  """The sharding an unstacked array at ``path`` (``"['layers'][3]['q']"``, or its ``.quant`` /
  ``.scale``) must have to become its weight in ``final``: the int8 ``quant``'s when a float
  weight is to be quantized, one layer's of the stacked weight when it is to be stacked."""
  by_path = {jax.tree_util.keystr(k): s for k, s in jax.tree_util.tree_flatten_with_path(final)[0]}
  weight, dot, field = path.partition(".")
  stacked = isinstance(final["layers"], dict) and weight.startswith("['layers'][")
  if stacked:  # "['layers'][3]['q']" -> "['layers']['q']"
    weight = "['layers']" + weight[weight.index("]", len("['layers'][")) + 1:]
  key = weight + dot + field
  if not field and key not in by_path:  # a float weight that becomes int8
    key = weight + ".quant"
  if key not in by_path:
    raise ValueError(f"no target sharding for the stored array {path}")
  return _layer_sharding(by_path[key], key) if stacked else by_path[key]


def stack_placed(params: Params, cfg: ModelConfig, target: Target = None) -> Params:
  """Placed per-layer params -> stacked (``target``: the stacked tree's shardings; default each
  layer-0 weight's sharding with an unsharded layer axis). Each stacked weight is allocated,
  filled a layer at a time by a donated update, and every per-layer array deleted once copied:
  at most one stacked weight (all layers of one name) exists twice."""
  if isinstance(params["layers"], dict):
    return params
  dtype = params["final_norm"].dtype  # the float dtype (norms are never quantized)
  quantized = any(_is_quant(x) for x in jax.tree.leaves(params, is_leaf=_is_quant))
  if target is None:
    first = {jax.tree_util.keystr(k).replace("['layers'][0]", "['layers']", 1): a.sharding
             for k, a in jax.tree_util.tree_flatten_with_path(params)[0]}

    def target(path: str, sds) -> Sharding:
      del sds
      base = first[path]
      if isinstance(base, NamedSharding) and path.startswith("['layers']"):
        return NamedSharding(base.mesh, PartitionSpec(None, *base.spec),
                             memory_kind=base.memory_kind)
      return base
  abstract = _final_abstract(cfg, dtype, quantized, True)
  where = _placements(abstract, target)
  stacked = {}
  for name in params["layers"][0]:
    buf = jax.tree.map(_allocate, abstract["layers"][name], where["layers"][name])
    for i, layer in enumerate(params["layers"]):
      buf = jax.tree.map(lambda b, x: _set_layer(b, x, i), buf, layer[name])
      for arr in jax.tree.leaves(layer[name]):
        arr.delete()
    stacked[name] = buf
  top = {k: v for k, v in params.items() if k != "layers"}
  top_where = {k: v for k, v in where.items() if k != "layers"}
  return {**jax.device_put(top, top_where), "layers": stacked}


def _init_one(info: ArrayInfo, key: jax.Array, dtype, quantized: bool):
  w = init_array(info, key, dtype)
  return quantize_array(w, info.contract_axes) if quantized and info.quantizable else w


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, target: Target = None, *,
                quantized: bool = False, stacked: bool = False,
                progress: Callable[[Progress], None] | None = None) -> Params:
  """Random init straight into ``target``; the values of ``models.weights.init_params``."""
  leaves = jax.tree.leaves(param_infos(cfg), is_leaf=lambda x: isinstance(x, ArrayInfo))
  keys = jax.random.split(key, len(leaves))
  # init_params' key order: param_infos flattened (dict keys sorted, layers in order).
  order: dict[str, int] = {}
  for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(
      param_infos(cfg), is_leaf=lambda x: isinstance(x, ArrayInfo))[0]):
    order[jax.tree_util.keystr(path)] = i

  def make(ref: WeightRef, placement: Placement, on_bytes):
    k = keys[order[ref.path]]
    w = jax.jit(_init_one, static_argnums=(0, 2, 3), out_shardings=placement)(
        ref.info, k, dtype, quantized)
    on_bytes(_local_bytes(w))
    return w

  return build(cfg, dtype, target, make, quantized=quantized, stacked=stacked,
               progress=progress)


def quantize_placed(params: Params, cfg: ModelConfig, target: Target = None) -> Params:
  """Placed float params -> int8 (per weight, in ``target``'s shardings for the int8 tree;
  default: each float weight's own sharding); the float weights are deleted as it goes."""
  stacked = isinstance(params["layers"], dict)
  leaves = jax.tree.leaves(params)
  dtype = leaves[0].dtype
  if target is None:
    float_s = {jax.tree_util.keystr(k): a.sharding
               for k, a in jax.tree_util.tree_flatten_with_path(params)[0]}

    def target(path: str, sds) -> Sharding:
      s = float_s[path.removesuffix(".quant").removesuffix(".scale")]
      if path.endswith(".scale") and isinstance(s, NamedSharding):  # size-1 axes: unsharded
        spec = tuple(s.spec) + (None,) * (len(sds.shape) - len(s.spec))
        s = NamedSharding(s.mesh, PartitionSpec(*(None if n == 1 else e
                                                  for n, e in zip(sds.shape, spec))))
      return s
  where = _placements(_final_abstract(cfg, dtype, True, stacked), target)
  infos = param_infos(cfg)
  lead = 1 if stacked else 0

  def one(info: ArrayInfo, w, s):
    if not info.quantizable:
      return w
    axes = tuple(a + lead for a in info.contract_axes)
    q = jax.jit(quantize_array, static_argnums=1, out_shardings=s)(w, axes)
    w.delete()
    return q

  if stacked:
    infos = {**infos, "layers": infos["layers"][0]}
  return jax.tree.map(one, infos, params, where, is_leaf=lambda x: isinstance(x, ArrayInfo))


__all__ = ["Placement", "Progress", "ShardingFn", "Target", "WeightRef", "build",
           "final_shardings", "from_host", "init_params", "quantize_placed", "sharding_of_source",
           "shardings_for", "stack_placed", "stacked_abstract"]
