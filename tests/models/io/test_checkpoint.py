"""models.io.checkpoint: float / int8 round trips, restore into shardings, bad paths."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from models.io import checkpoint
from models.config import get_preset
from models.quant import QuantArray
from models.weights import abstract_params, init_params, logical_axes, quantize

CFG = get_preset("tiny")


def _params(dtype=jnp.float32, cfg=CFG):
  return init_params(cfg, jax.random.key(0), dtype)


def _assert_bitwise_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)  # includes QuantArray.act_quant
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_float_round_trip(tmp_path, dtype):
  params = _params(dtype)
  checkpoint.save_params(tmp_path / "ckpt", params, CFG)
  restored = checkpoint.restore_params(tmp_path / "ckpt")
  _assert_bitwise_equal(params, restored)
  meta = checkpoint.load_metadata(tmp_path / "ckpt")
  assert meta.dtype == jnp.dtype(dtype) and not meta.quantized and not meta.act_quant
  assert checkpoint.load_config(str(tmp_path / "ckpt")) == CFG


@pytest.mark.parametrize("act_quant", [False, True])
def test_int8_round_trip(tmp_path, act_quant):
  params = quantize(_params(jnp.bfloat16), CFG, act_quant=act_quant)
  checkpoint.save_params(tmp_path / "ckpt", params, CFG)
  restored = checkpoint.restore_params(tmp_path / "ckpt")
  _assert_bitwise_equal(params, restored)
  q = restored["layers"][1]["q"]
  assert isinstance(q, QuantArray) and q.act_quant is act_quant
  assert q.quant.dtype == jnp.int8 and q.scale.dtype == jnp.float32
  assert restored["final_norm"].dtype == jnp.bfloat16
  meta = checkpoint.load_metadata(tmp_path / "ckpt")
  assert meta.quantized and meta.act_quant is act_quant


def test_metadata_json_and_dtype_cast(tmp_path):
  checkpoint.save_params(tmp_path / "ckpt", _params(), CFG)
  meta = json.loads((tmp_path / "ckpt" / "phaseserve" / "metadata").read_text())
  assert meta["format"] == "phaseserve.params" and meta["dtype"] == "float32"
  assert meta["config"]["vocab_size"] == CFG.vocab_size
  restored = checkpoint.restore_params(tmp_path / "ckpt", dtype=jnp.bfloat16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(restored))


def _shardings(cfg, mesh, quantized):
  """NamedShardings from logical axes: vocab and mlp over 'x', size-1 (scale) axes unsharded."""
  rules = {"vocab": "x", "mlp": "x"}
  axes = logical_axes(cfg, quantized)
  shapes = abstract_params(cfg, quantized=quantized)
  is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)
  return jax.tree.map(
      lambda names, a: NamedSharding(mesh, P(*(
          rules.get(n) if d > 1 else None for n, d in zip(names, a.shape)))),
      axes, shapes, is_leaf=is_axes)


@pytest.mark.parametrize("quantized", [False, True])
def test_restore_into_named_sharding(tmp_path, quantized):
  cfg = CFG.replace(vocab_size=264)  # 259 does not split 8 ways; see test_indivisible_sharding
  params = _params(cfg=cfg)
  if quantized:
    params = quantize(params, cfg, act_quant=True)
  checkpoint.save_params(tmp_path / "ckpt", params, cfg)
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
  # A shardings tree built from logical_axes has act_quant=False; matching is by key path.
  restored = checkpoint.restore_params(tmp_path / "ckpt", _shardings(cfg, mesh, quantized))
  _assert_bitwise_equal(params, restored)
  embed = restored["embed"].quant if quantized else restored["embed"]
  gate = restored["layers"][0]["gate"].quant if quantized else restored["layers"][0]["gate"]
  assert embed.sharding == NamedSharding(mesh, P("x", None))
  assert gate.sharding == NamedSharding(mesh, P(None, "x"))
  assert {s.data.shape for s in embed.addressable_shards} == {(264 // 8, cfg.embed_dim)}
  assert restored["final_norm"].sharding == NamedSharding(mesh, P(None))
  if quantized:
    assert restored["layers"][0]["down"].scale.sharding == NamedSharding(mesh, P(None, None))

  replicated = checkpoint.restore_params(tmp_path / "ckpt", NamedSharding(mesh, P()))
  r_embed = replicated["embed"].quant if quantized else replicated["embed"]
  assert r_embed.sharding == NamedSharding(mesh, P())
  _assert_bitwise_equal(params, replicated)


def test_indivisible_or_mismatched_shardings(tmp_path):
  checkpoint.save_params(tmp_path / "ckpt", _params(), CFG)
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
  with pytest.raises(ValueError, match=r"\['embed'\].*not usable"):
    checkpoint.restore_params(tmp_path / "ckpt", _shardings(CFG, mesh, False))
  shardings = _shardings(CFG.replace(vocab_size=264), mesh, False)
  del shardings["final_norm"]
  with pytest.raises(ValueError, match="missing"):
    checkpoint.restore_params(tmp_path / "ckpt", shardings)


def test_bad_paths(tmp_path):
  with pytest.raises(FileNotFoundError):
    checkpoint.restore_params(tmp_path / "nope")
  with pytest.raises(FileNotFoundError):
    checkpoint.load_config(tmp_path / "nope")
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="not a checkpoint directory"):
    checkpoint.restore_params(tmp_path / "file")
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="not a phaseserve checkpoint"):
    checkpoint.load_config(tmp_path / "empty")


def test_foreign_metadata_rejected(tmp_path):
  checkpoint.save_params(tmp_path / "ckpt", _params(), CFG)
  path = tmp_path / "ckpt" / "phaseserve" / "metadata"
  meta = json.loads(path.read_text())
  path.write_text(json.dumps({**meta, "format": "other"}))
  with pytest.raises(ValueError, match="not a phaseserve params checkpoint"):
    checkpoint.restore_params(tmp_path / "ckpt")
  path.write_text(json.dumps({**meta, "version": 99}))
  with pytest.raises(ValueError, match="version"):
    checkpoint.load_config(tmp_path / "ckpt")


def test_save_validates(tmp_path):
  params = _params()
  checkpoint.save_params(tmp_path / "ckpt", params, CFG)
  with pytest.raises(ValueError, match="already exists"):
    checkpoint.save_params(tmp_path / "ckpt", params, CFG)
  checkpoint.save_params(tmp_path / "ckpt", quantize(params, CFG), CFG, overwrite=True)
  assert checkpoint.load_metadata(tmp_path / "ckpt").quantized
  with pytest.raises(ValueError, match="config says"):
    checkpoint.save_params(tmp_path / "other", params, CFG.replace(mlp_dim=64))
  mixed = dict(params, final_norm=params["final_norm"].astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="one float dtype"):
    checkpoint.save_params(tmp_path / "other", mixed, CFG)
  assert not (tmp_path / "other").exists()
