"""Params checkpoints: orbax save/restore of float (f32/bf16) and int8 (``QuantArray``) params.

Contract:
  * ``save_params(path, params, cfg)`` writes one orbax checkpoint directory atomically:
    ``path/params/`` (the pytree) and ``path/phaseserve/metadata`` (JSON: format, version, config,
    dtype, quantized, act_quant). ``params`` must match ``models.weights.abstract_params`` for its
    config, else ``ValueError`` before anything is written.
  * ``restore_params(path, shardings=None, dtype=None)`` rebuilds the abstract tree from the
    metadata (never from orbax's stored tree) and reads each array straight into its sharding
    (a ``models.io.placement.Target``); each process reads only its own shards. A sharding that
    does not divide its array evenly is a ``ValueError`` naming the weight; ``dtype`` casts the
    float leaves (int8 ``quant`` and f32 ``scale`` are kept).
  * ``load_config(path)`` / ``load_metadata(path)`` read only the JSON.
  * Errors: a missing path -> ``FileNotFoundError``; not a ``save_params`` checkpoint or an
    unknown format version -> ``ValueError``. Details: BUILD_NOTES "Design: Checkpoints".
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Iterator

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from jax.typing import DTypeLike

from models.config import ModelConfig
from models.io.placement import Target, shardings_for
from models.quant import QuantArray
from models.weights import Params, abstract_params

FORMAT = "phaseserve.params"
FORMAT_VERSION = 1
PARAMS_ITEM = "params"
METADATA_ITEM = "phaseserve"

_IN_FLIGHT = 1.2  # restore reads in flight, in multiples of the largest stored array
PathLike = str | os.PathLike[str]
Shardings = Target  # models.io.placement's: None, one Sharding, a params-shaped pytree, a callable


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
  """What ``save_params`` records next to the arrays; enough to rebuild the abstract tree."""

  config: ModelConfig
  dtype: jnp.dtype  # the float leaves (all of them for float params; norms for int8 params)
  quantized: bool
  act_quant: bool

  def to_json(self) -> dict[str, object]:
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "config": dataclasses.asdict(self.config),
        "dtype": jnp.dtype(self.dtype).name,
        "quantized": self.quantized,
        "act_quant": self.act_quant,
    }

  @classmethod
  def from_json(cls, meta: dict[str, object], where: str) -> "CheckpointMetadata":
    if meta.get("format") != FORMAT:
      raise ValueError(f"{where} is not a phaseserve params checkpoint "
                       f"(metadata format {meta.get('format')!r}, expected {FORMAT!r})")
    if meta.get("version") != FORMAT_VERSION:
      raise ValueError(f"{where}: unsupported checkpoint format version "
                       f"{meta.get('version')!r} (this build reads {FORMAT_VERSION})")
    config = meta.get("config")
    if not isinstance(config, dict):
      raise ValueError(f"{where}: metadata has no model config")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(config) - known)
    if unknown:
      raise ValueError(f"{where}: unknown ModelConfig fields {unknown} "
                       "(written by a newer phaseserve?)")
    try:
      return cls(config=ModelConfig(**config), dtype=jnp.dtype(str(meta["dtype"])),
                 quantized=bool(meta["quantized"]), act_quant=bool(meta["act_quant"]))
    except (KeyError, TypeError) as e:
      raise ValueError(f"{where}: malformed phaseserve metadata: {e}") from None

  def abstract(self, dtype: DTypeLike | None = None) -> Params:
    return abstract_params(self.config, jnp.dtype(dtype) if dtype is not None else self.dtype,
                           quantized=self.quantized, act_quant=self.act_quant)


def _as_path(path: PathLike) -> epath.Path:
  """Absolute local path (orbax requires one); URLs such as gs://... pass through."""
  name = os.fspath(path)
  return epath.Path(name if "://" in name else os.path.abspath(name))


@contextlib.contextmanager
def _checkpointer(restore_bytes: int | None = None) -> Iterator[ocp.Checkpointer]:
  handlers = {} if restore_bytes is None else {PARAMS_ITEM: ocp.StandardCheckpointHandler(
      restore_concurrent_gb=restore_bytes / 1e9)}  # bytes = gb * 1e9
  ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers))
  try:
    yield ckptr
  finally:
    ckptr.close()


def _is_quant(x: object) -> bool:
  return isinstance(x, QuantArray)


def _describe(params: Params) -> tuple[jnp.dtype, bool, bool]:
  """(float dtype, quantized, act_quant) of a params tree; ValueError if inconsistent. act_quant
  is the layers' (W8A8 keeps the unembedding weight-only: ``models.precision.W8A8_KEEP``)."""
  leaves = jax.tree.leaves(params, is_leaf=_is_quant)
  quants = [x for x in leaves if isinstance(x, QuantArray)]
  float_dtypes = {jnp.dtype(x.dtype) for x in leaves if not isinstance(x, QuantArray)}
  if len(float_dtypes) != 1:
    raise ValueError(f"params must have one float dtype, got {sorted(map(str, float_dtypes))}")
  act_quants = {q.act_quant for q in jax.tree.leaves(params["layers"], is_leaf=_is_quant)
                if isinstance(q, QuantArray)}
  if len(act_quants) > 1:
    raise ValueError("params mix QuantArray leaves with act_quant=True and act_quant=False")
  return float_dtypes.pop(), bool(quants), bool(act_quants and act_quants.pop())


def _check_matches(params: Params, abstract: Params) -> None:
  got = jax.tree_util.tree_flatten_with_path(params)[0]
  want = jax.tree_util.tree_flatten_with_path(abstract)[0]
  got_paths = [jax.tree_util.keystr(k) for k, _ in got]
  want_paths = [jax.tree_util.keystr(k) for k, _ in want]
  if got_paths != want_paths:
    missing = sorted(set(want_paths) - set(got_paths))[:5]
    extra = sorted(set(got_paths) - set(want_paths))[:5]
    raise ValueError("params do not match the weight description for this config "
                     f"(missing {missing}, unexpected {extra})")
  for (path, x), (_, a) in zip(got, want):
    if tuple(x.shape) != tuple(a.shape) or jnp.dtype(x.dtype) != jnp.dtype(a.dtype):
      raise ValueError(f"param {jax.tree_util.keystr(path)} is {jnp.dtype(x.dtype).name}"
                       f"{list(x.shape)}, the config says {jnp.dtype(a.dtype).name}"
                       f"{list(a.shape)}")
  if jax.tree.structure(params) != jax.tree.structure(abstract):
    raise ValueError("params tree structure differs from the weight description")


def save_params(path: PathLike, params: Params, cfg: ModelConfig, *,
                overwrite: bool = False) -> None:
  """Writes ``params`` (float or int8) and their metadata to the directory ``path``.

  ``path`` must not exist unless ``overwrite`` (then it is replaced). Arrays may be sharded; in a
  multi-host run every process calls this.
  """
  dtype, quantized, act_quant = _describe(params)
  meta = CheckpointMetadata(cfg, dtype, quantized, act_quant)
  _check_matches(params, meta.abstract())
  directory = _as_path(path)
  if directory.exists() and not overwrite:
    raise ValueError(f"checkpoint destination {directory} already exists (pass overwrite=True)")
  with _checkpointer() as ckptr:
    ckptr.save(directory, ocp.args.Composite(**{
        PARAMS_ITEM: ocp.args.StandardSave(params),
        METADATA_ITEM: ocp.args.JsonSave(meta.to_json()),
    }), force=overwrite)


def _checkpoint_dir(path: PathLike) -> epath.Path:
  directory = _as_path(path)
  if not directory.exists():
    raise FileNotFoundError(f"no checkpoint at {directory}")
  if not directory.is_dir():
    raise ValueError(f"{directory} is not a checkpoint directory")
  if not (directory / METADATA_ITEM).is_dir() or not (directory / PARAMS_ITEM).is_dir():
    raise ValueError(f"{directory} is not a phaseserve checkpoint (expected {METADATA_ITEM}/ "
                     f"and {PARAMS_ITEM}/ items written by models.io.checkpoint.save_params)")
  return directory


def load_metadata(path: PathLike) -> CheckpointMetadata:
  """The checkpoint's config, float dtype, quantized flag and act_quant."""
  directory = _checkpoint_dir(path)
  with _checkpointer() as ckptr:
    try:
      restored = ckptr.restore(directory, ocp.args.Composite(**{
          METADATA_ITEM: ocp.args.JsonRestore()}))
    except FileNotFoundError as e:
      raise ValueError(f"{directory} is not a phaseserve checkpoint: {e}") from None
  meta = restored[METADATA_ITEM]
  if not isinstance(meta, dict):
    raise ValueError(f"{directory}: metadata is not a JSON object")
  return CheckpointMetadata.from_json(meta, str(directory))


def load_config(path: PathLike) -> ModelConfig:
  return load_metadata(path).config


def _place(abstract: Params, shardings: Target) -> Params:
  """``abstract`` with a sharding on every ``ShapeDtypeStruct`` (see the module contract)."""
  leaves, treedef = jax.tree.flatten(abstract)
  placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
            for a, s in zip(leaves, shardings_for(abstract, shardings))]
  return jax.tree.unflatten(treedef, placed)


def restore_params(path: PathLike, shardings: Shardings = None, *,
                   dtype: DTypeLike | None = None) -> Params:
  """Reads the params written by ``save_params``, each array straight into its sharding."""
  directory = _checkpoint_dir(path)
  meta = load_metadata(directory)
  target = _place(meta.abstract(dtype), shardings)
  # orbax reads every array at once unless told otherwise (a whole extra copy of the model in
  # flight). Its limiter counts each shard read as the stored chunks it touches (at most the
  # whole array) and refuses a read it could never admit, so: a little over the largest array.
  stored = meta.abstract()
  largest = max(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(stored))
  with _checkpointer(restore_bytes=int(largest * _IN_FLIGHT) + 1) as ckptr:
    restored = ckptr.restore(directory, ocp.args.Composite(**{
        PARAMS_ITEM: ocp.args.StandardRestore(target)}))
  return restored[PARAMS_ITEM]

