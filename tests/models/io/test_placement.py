"""models.io.placement and the loaders built on it: params made straight into target shardings equal
the unsharded load (bitwise), in the shardings asked for, and the engine's placement of them moves
nothing. 8 fake CPU devices (tests/conftest.py); the tiny preset written as an HF checkpoint."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from models.io import checkpoint, loader, placement
from models.config import get_preset
from launch.lab.hf_export import byte_tokenizer, save_hf_checkpoint
from models.io.hf_import import load_hf_checkpoint
from models.weights import init_params, quantize, stack_layers
from partitioning.layouts import param_shardings
from partitioning.mesh import make_mesh
from partitioning.paged_step import PagedShardedStep

CFG = get_preset("tiny")  # MQA, untied
TIED = CFG.replace(name="tiny_tied", tie_embeddings=True, num_kv_heads=2)


def _stacked(sh):
  """A per-layer shardings tree -> the stacked tree's (layer axis unsharded)."""
  layers = jax.tree.map(lambda s: NamedSharding(s.mesh, P(None, *s.spec)), sh["layers"][0])
  return {**sh, "layers": layers}


def _target(cfg, quantized, stacked, layout="ws_2d"):
  sh = param_shardings(cfg, make_mesh(), layout, quantized)
  return _stacked(sh) if stacked else sh


def _assert_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def _assert_placed(params, target):
  for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(target)):
    assert a.sharding == s


@pytest.fixture(scope="module", params=[CFG, TIED], ids=["untied_mqa", "tied_gqa"])
def hf_dir(request, tmp_path_factory):
  cfg = request.param
  out = tmp_path_factory.mktemp("hf") / cfg.name
  save_hf_checkpoint(cfg, init_params(cfg, jax.random.key(1)), out, dtype="bfloat16",
                     tokenizer=byte_tokenizer())
  return cfg, out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("stacked", [False, True], ids=["layers", "stacked"])
def test_hf_into_shards_equals_unsharded(hf_dir, dtype, quantized, stacked):
  cfg, path = hf_dir
  _, whole = load_hf_checkpoint(path, dtype)
  want = quantize(whole, cfg) if quantized else whole
  want = stack_layers(want) if stacked else want
  target = _target(cfg, quantized, stacked)
  _, got = load_hf_checkpoint(path, dtype, shardings=target, quantize=quantized, stacked=stacked)
  _assert_equal(got, want)
  _assert_placed(got, target)


def test_callable_target_asks_each_final_path_once(hf_dir):
  cfg, path = hf_dir
  tree = _target(cfg, True, False)
  table = {jax.tree_util.keystr(k): s for k, s in jax.tree_util.tree_flatten_with_path(tree)[0]}
  asked = []

  def target(p, sds):
    asked.append(p)
    assert isinstance(sds, jax.ShapeDtypeStruct)
    return table[p]

  _, got = load_hf_checkpoint(path, jnp.float32, shardings=target, quantize=True)
  assert sorted(asked) == sorted(table) and len(asked) == len(table)
  assert "['layers'][0]['q'].quant" in asked and "['layers'][0]['q'].scale" in asked
  _assert_placed(got, tree)


def test_progress_counts_this_process_buffers(hf_dir):
  cfg, path = hf_dir
  events = []
  _, got = load_hf_checkpoint(path, jnp.float32, shardings=_target(cfg, False, False),
                              progress=events.append)
  held = sum(s.data.nbytes for a in jax.tree.leaves(got) for s in a.addressable_shards)
  assert events[-1].placed_bytes == held
  assert all(a.placed_bytes < b.placed_bytes for a, b in zip(events, events[1:]))
  assert 0 < events[-1].read_bytes <= held  # bf16 file, replicated shards read once


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("stacked", [False, True], ids=["layers", "stacked"])
def test_sharded_init_equals_unsharded_init(quantized, stacked):
  key = jax.random.key(3)
  want = init_params(CFG, key)
  want = quantize(want, CFG) if quantized else want
  want = stack_layers(want) if stacked else want
  target = _target(CFG, quantized, stacked)
  got = placement.init_params(CFG, key, jnp.float32, target, quantized=quantized,
                              stacked=stacked)
  _assert_equal(got, want)
  _assert_placed(got, target)


def test_stacked_layer_axis_must_be_unsharded(hf_dir):
  cfg, path = hf_dir
  mesh = make_mesh()
  def target(p, sds):  # layers over x along the stacked axis, the rest replicated
    return NamedSharding(mesh, P("x") if p.startswith("['layers']") else P())

  with pytest.raises(ValueError, match=r"\['layers'\]\['\w+'\]: the stacked layer axis must "
                     "be unsharded"):
    load_hf_checkpoint(path, jnp.float32, shardings=target, stacked=True)


def test_indivisible_sharding_names_the_weight(hf_dir):
  cfg, path = hf_dir
  mesh = make_mesh()
  with pytest.raises(ValueError, match=r"sharding for param \['embed'\] \[259, 64\] is not usable"):
    load_hf_checkpoint(path, jnp.float32, shardings=NamedSharding(mesh, P(("x", "y", "z"))))


@pytest.mark.parametrize("quantize_arg", ["none", "int8"])
def test_load_model_in_the_step_layout_is_not_moved_again(hf_dir, quantize_arg):
  """What engine_flags does: the step's param_sharding as the target, then place_params."""
  cfg, path = hf_dir
  step = PagedShardedStep.make(cfg, make_mesh(), "ws_2d", "batch_xyz")
  _, params, _ = loader.load_model(str(path), jnp.bfloat16, quantize=quantize_arg,
                                   shardings=step.param_sharding)
  placed = step.place_params(params)
  assert all(a is b for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(params)))
  _, whole, _ = loader.load_model(str(path), jnp.bfloat16, quantize=quantize_arg)
  _assert_equal(params, whole)


@pytest.mark.parametrize("stored_int8", [False, True], ids=["stored_float", "stored_int8"])
@pytest.mark.parametrize("stacked", [False, True], ids=["layers", "stacked"])
def test_orbax_into_shards_quantized_and_stacked(tmp_path, stored_int8, stacked):
  params = init_params(CFG, jax.random.key(2))
  checkpoint.save_params(tmp_path / "ckpt", quantize(params, CFG) if stored_int8 else params,
                         CFG)
  target = _target(CFG, True, stacked)
  _, got, _ = loader.load_model(str(tmp_path / "ckpt"), jnp.float32, quantize="int8",
                                shardings=target, stack_layers=stacked)
  want = quantize(params, CFG)
  _assert_equal(got, stack_layers(want) if stacked else want)
  _assert_placed(got, target)


def test_preset_init_into_the_step_layout():
  step = PagedShardedStep.make(CFG, make_mesh(), "ws_2d", "heads")  # init programs compiled above
  _, params, _ = loader.load_model("tiny", jnp.float32, 5, shardings=step.param_sharding)
  _assert_equal(params, init_params(CFG, jax.random.key(5)))
  placed = step.place_params(params)
  assert all(a is b for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(params)))
  assert any(isinstance(a.sharding, NamedSharding) and a.sharding.spec != P()
             for a in jax.tree.leaves(params))


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8"])
def test_inner_axis_cut_reads_the_covering_block(hf_dir, quantized):
  """head_dim sharded (no layout does it): the file range covering the shard is read, then cut."""
  cfg, path = hf_dir
  mesh = make_mesh()
  head_dim_axis = {"q": 2, "k": 2, "v": 2, "o": 1}

  def target(p, sds):
    name = p.split("['")[-1].split("']")[0]
    spec = [None] * len(sds.shape)
    if name in head_dim_axis and sds.shape[head_dim_axis[name]] > 1:
      spec[head_dim_axis[name]] = ("x", "y")
    return NamedSharding(mesh, P(*spec))

  _, whole = load_hf_checkpoint(path, jnp.float32)
  _, got = load_hf_checkpoint(path, jnp.float32, shardings=target, quantize=quantized)
  _assert_equal(got, quantize(whole, cfg) if quantized else whole)
  q = got["layers"][0]["q"]
  assert (q.quant if quantized else q).sharding.spec == P(None, None, ("x", "y"))
