"""Sharded forward == unsharded model, for every layout, on 8 (and 1, 2, 4) fake CPU devices.

Tolerance (float32 activations, float32 or weight-only int8 weights): the sharded step only
changes summation order (partial sums across chips), so for logits and KV cache contents
    max |sharded - reference| <= 1e-5 * max(1, max |reference|)
(observed: ~2e-6 on logits of O(1-60)). Integer outputs (cache lengths) must be equal.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import transformer as T
from models.config import get_preset
from models.kv_cache import init_cache
from models.weights import init_params, quantize
from partitioning import collectives as C
from partitioning import comm
from partitioning import layouts as L
from partitioning.mesh import make_mesh, split_devices

CFG = get_preset("tiny").replace(num_heads=8, vocab_size=256)  # every dim divisible by 8
B, S = 8, 32
RTOL = 1e-5


def assert_close(got, ref, what=""):
  got, ref = np.asarray(got), np.asarray(ref)
  assert got.shape == ref.shape, (what, got.shape, ref.shape)
  err = float(np.max(np.abs(got - ref))) if got.size else 0.0
  bound = RTOL * max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
  assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


@functools.lru_cache(maxsize=None)
def _case(cfg, quantized, batch=B):
  """Params, inputs and the unsharded reference of prefill (ragged) then decode (some idle)."""
  params = init_params(cfg, jax.random.key(0))
  if quantized:
    params = quantize(params, cfg)
  lens = jnp.array([12, 5, 0, 12, 7, 1, 12, 3][:batch], jnp.int32)
  toks = jax.random.randint(jax.random.key(1), (batch, 12), 0, cfg.vocab_size)
  start = jnp.array([0, 3, 0, 0, 9, 0, 2, 0][:batch], jnp.int32)
  nxt = jax.random.randint(jax.random.key(2), (batch,), 0, cfg.vocab_size)
  active = jnp.array([1, 1, 0, 1, 1, 1, 0, 1][:batch], jnp.int32)
  inputs = dict(toks=toks, start=start, lens=lens, nxt=nxt, active=active)
  ref_pre = T.prefill(params, toks, init_cache(cfg, batch, S), start, lens, cfg=cfg, attend_len=S)
  ref_dec = T.decode_step(params, nxt, ref_pre[1], cfg=cfg, attend_len=S, active_B=active)
  return params, inputs, ref_pre, ref_dec


def _check(got_pre, got_dec, ref_pre, ref_dec, what):
  for name, got, ref in (("prefill", got_pre, ref_pre), ("decode", got_dec, ref_dec)):
    assert_close(got[0], ref[0], f"{what} {name} logits")
    assert_close(got[1].k, ref[1].k, f"{what} {name} cache k")
    assert_close(got[1].v, ref[1].v, f"{what} {name} cache v")
    np.testing.assert_array_equal(got[1].lengths, ref[1].lengths)


def _run(cfg, mesh, ffn, attn, quantized, batch=B):
  """Prefill then decode under (ffn, attn) through one outer jit (one compile per pair)."""
  params, x, ref_pre, ref_dec = _case(cfg, quantized, batch)
  pre = C.make_sharded_step(cfg, mesh, ffn, attn, "prefill")
  dec = C.make_sharded_step(cfg, mesh, ffn, attn, "decode")

  @jax.jit
  def both(p, cache):
    got_pre = pre(p, x["toks"], cache, x["start"], x["lens"], attend_len=S)
    return got_pre, dec(p, x["nxt"], got_pre[1], attend_len=S, active_B=x["active"])

  p = C.shard_params(params, cfg, mesh, ffn)
  cache = C.init_sharded_cache(cfg, batch, S, mesh, ffn, attn)
  got_pre, got_dec = both(p, cache)
  _check(got_pre, got_dec, ref_pre, ref_dec, f"{ffn}+{attn}")
  return got_pre, got_dec


@pytest.fixture(scope="module")
def mesh8():
  return make_mesh()


def test_layout_names_match_cost_model():
  from partitioning import cost_model
  assert tuple(L.FFN_LAYOUTS) == tuple(cost_model.FFN_LAYOUT_NAMES)
  assert tuple(L.ATTN_LAYOUTS) == tuple(cost_model.ATTN_LAYOUT_NAMES)


# int8 under every FFN layout; in `make test` only under ws_2d and wg_xyz (the two the planner
# picks for prefill and decode), the rest in `make test-slow` (suite time).
_INT8_FAST = ("ws_2d", "wg_xyz")
_LAYOUT_CASES = [pytest.param(f, q, id=f"{f}-{'int8' if q else 'f32'}",
                              marks=[pytest.mark.slow] if q and f not in _INT8_FAST else [])
                 for f in L.FFN_LAYOUTS for q in (False, True)]


@pytest.mark.parametrize("ffn,quantized", _LAYOUT_CASES)
def test_every_layout_matches_unsharded(mesh8, ffn, quantized):
  """Every attention layout of ``ffn``; pairs with an identical LayoutPlan (same program: e.g.
  wg_xyz already shards the batch over every chip) are run once."""
  seen = {}
  for attn in L.ATTN_LAYOUTS:
    plan = L.make_plan(CFG, mesh8, ffn, attn, B)
    assert not plan.reasons, plan.reasons
    assert set(plan.ab) >= set(L.ATTN_LAYOUTS[attn].batch_axes) - set(plan.we), plan.describe()
    if plan.key() in seen:
      continue
    seen[plan.key()] = attn
    _run(CFG, mesh8, ffn, attn, quantized)
  expected_programs = {"ws_1d": 4, "ws_2d": 4, "wg_x": 3, "wg_xy": 2, "wg_xyz": 1}
  assert len(seen) == expected_programs[ffn]


def test_plans_are_the_papers(mesh8):
  def plan(f, a):
    return L.make_plan(CFG, mesh8, f, a, B)
  p = plan("ws_2d", "heads")  # E_x F_yz; Q reduce-scattered over x onto heads; KV replicated
  assert (p.re, p.we, p.wf, p.wh, p.q_scatter, p.f_scatter, p.ab) == (
      ("x", "y", "z"), ("x",), ("y", "z"), ("y", "z"), ("x",), ("x",), ())
  p = plan("ws_1d", "batch_xyz")
  assert (p.re, p.we, p.wf, p.move, p.ab) == (("x", "y", "z"), (), ("x", "y", "z"),
                                              ("x", "y", "z"), ("x", "y", "z"))
  p = plan("wg_x", "batch_z")
  assert (p.rb, p.re, p.wf, p.move, p.ab) == (("x",), ("y", "z"), ("y", "z"), ("z",), ("x", "z"))
  p = plan("wg_xyz", "heads")
  assert (p.rb, p.re, p.we, p.wf, p.wh, p.ab) == (("x", "y", "z"), (), (), (), (), ("x", "y", "z"))


def test_one_resident_copy_serves_2d_and_weight_gathered(mesh8):
  for quantized in (False, True):
    ws2d = L.param_shardings(CFG, mesh8, "ws_2d", quantized)
    for wg in ("wg_x", "wg_xy", "wg_xyz"):
      assert L.param_shardings(CFG, mesh8, wg, quantized) == ws2d
  q = L.param_specs(CFG, mesh8, "ws_2d")["layers"][0]
  assert (q["q"].notation, q["gate"].notation, q["down"].notation, q["o"].notation) == (
      "E_x N_yz H", "E_x F_yz", "F_yz E_x", "N_yz H E_x")
  g = L.param_specs(CFG, mesh8, "wg_xy", gathered=True)["layers"][0]
  assert (g["gate"].notation, g["q"].notation) == ("E F_z", "E N_z H")


def test_int8_scales_keep_contracted_axes_unsharded(mesh8):
  specs = L.param_specs(CFG, mesh8, "ws_2d", quantized=True)["layers"][0]
  assert specs["gate"].quant.spec == jax.sharding.PartitionSpec("x", ("y", "z"))
  assert specs["gate"].scale.spec == jax.sharding.PartitionSpec(None, ("y", "z"))
  assert specs["o"].scale.spec == jax.sharding.PartitionSpec(None, None, "x")
  assert not L.param_fallbacks(CFG, mesh8, "ws_2d", quantized=True)
  params = quantize(init_params(CFG, jax.random.key(0)), CFG, act_quant=True)
  placed = C.shard_params(params, CFG, mesh8, "ws_1d")  # act_quant=True treedef still matches
  assert placed["layers"][0]["down"].quant.sharding.spec == jax.sharding.PartitionSpec(
      ("x", "y", "z"), None)


@pytest.mark.parametrize("n,shape,pairs", [
    (1, None, [("ws_2d", "batch_xyz")]),
    (2, None, [("ws_1d", "batch_z"), ("wg_xyz", "heads")]),
    (4, None, [("ws_2d", "batch_yz"), ("wg_x", "batch_z")]),
    (8, (8, 1, 1), [("ws_1d", "heads")]),  # the cost model's ws_1d mesh
    (8, (2, 4, 1), [("ws_2d", "batch_xyz")]),
])
def test_sub_meshes_and_shapes(n, shape, pairs):
  mesh = make_mesh(jax.devices()[:n], shape)
  for ffn, attn in pairs:
    _run(CFG, mesh, ffn, attn, quantized=False)


def test_variants_gqa_parallel_block_tied_geglu(mesh8):
  """GQA with sharded (and, in wg_xy, permuted) query heads; PaLM parallel block; tied and
  scaled embeddings; GeGLU; norm (1 + w)."""
  cfg = CFG.replace(num_kv_heads=2, parallel_block=True, tie_embeddings=True, activation="geglu",
                    embed_scale=True, norm_plus_one=True)
  for ffn, attn in (("ws_2d", "batch_z"), ("wg_xy", "heads")):
    _run(cfg, mesh8, ffn, attn, quantized=False)


def test_fallback_to_replication_records_reasons_and_stays_exact(mesh8):
  cfg = get_preset("tiny")  # 4 heads and 259 vocab rows on 8 chips; batch 6
  reasons = L.param_fallbacks(cfg, mesh8, "ws_1d")
  assert any("259" in r and "replicated" in r for r in reasons), reasons
  assert any("heads" in r and "sharded over xy" in r for r in reasons), reasons
  plan = L.make_plan(cfg, mesh8, "wg_xyz", "batch_xyz", 6)
  assert plan.rb == ("x",) and any("residual batch" in r for r in plan.reasons), plan.reasons
  for ffn, attn in (("ws_1d", "batch_xyz"), ("ws_2d", "batch_xyz"), ("wg_xyz", "heads")):
    _run(cfg, mesh8, ffn, attn, quantized=False, batch=6)


def test_resolve_never_raises():
  mesh = make_mesh()
  r = L.resolve(("vocab", "embed"), (7, 64), L.Rules.of(vocab="xyz", embed="x"), mesh, "t")
  assert r.axes == ((), ("x",)) and len(r.reasons) == 1 and "replicated" in r.reasons[0]
  r = L.resolve(("mlp",), (12,), L.Rules.of(mlp="xyz"), mesh)
  assert r.axes == (("x", "y"),) and "sharded over xy" in r.reasons[0]
  r = L.resolve(("embed", "mlp"), (1, 8), L.Rules.of(embed="x", mlp="yz"), mesh)  # int8 scale
  assert r.axes == ((), ("y", "z")) and not r.reasons
  r = L.resolve(("embed", "mlp"), (8, 8), L.Rules.of(embed="x", mlp="xyz"), mesh)
  assert r.axes == (("x",), ("y", "z"))  # a mesh axis shards one dimension only


def test_direct_calls_donation_all_logits_and_cfg_check(mesh8):
  params, x, _, _ = _case(CFG, False)
  ref_all, _ = T.prefill(params, x["toks"], init_cache(CFG, B, S), x["start"], x["lens"],
                         cfg=CFG, all_logits=True)
  pre = C.make_sharded_step(CFG, mesh8, "wg_x", "batch_yz", "prefill")
  p = C.shard_params(params, CFG, mesh8, "wg_x")
  cache = C.shard_cache(init_cache(CFG, B, S), CFG, mesh8, "wg_x", "batch_yz")
  logits, cache2 = pre(p, x["toks"], cache, x["start"], x["lens"], cfg=CFG, all_logits=True)
  lens = np.asarray(x["lens"])
  for b in range(B):  # positions past a row's length are padding: not compared
    assert_close(logits[b, :lens[b]], ref_all[b, :lens[b]], f"row {b}")
  assert cache2.k.sharding.spec == jax.sharding.PartitionSpec(None, ("x", "y", "z"))
  assert cache.k.is_deleted()  # donated
  with pytest.raises(ValueError, match="cfg"):
    pre(p, x["toks"], cache2, x["start"], x["lens"], cfg=CFG.replace(norm_eps=1e-3))


def test_disaggregated_prefill_and_decode_on_disjoint_meshes():
  """Prefill on 4 chips (ws_2d, heads), ship the cache to the other 4 (wg_xyz, batch_xyz)."""
  params, x, ref_pre, ref_dec = _case(CFG, False)
  pre_devices, dec_devices = split_devices(None, 4)
  m_pre, m_dec = make_mesh(pre_devices), make_mesh(dec_devices)
  pre = C.make_sharded_step(CFG, m_pre, "ws_2d", "heads", "prefill")
  dec = C.make_sharded_step(CFG, m_dec, "wg_xyz", "batch_xyz", "decode")
  got_pre = pre(C.shard_params(params, CFG, m_pre, "ws_2d"), x["toks"],
                C.init_sharded_cache(CFG, B, S, m_pre, "ws_2d", "heads"), x["start"], x["lens"],
                attend_len=S)
  cache = C.shard_cache(got_pre[1], CFG, m_dec, "wg_xyz", "batch_xyz")
  got_dec = dec(C.shard_params(params, CFG, m_dec, "wg_xyz"), x["nxt"], cache, attend_len=S,
                active_B=x["active"])
  assert {d.id for d in got_dec[1].k.sharding.device_set} == {d.id for d in dec_devices}
  _check(got_pre, got_dec, ref_pre, ref_dec, "disaggregated")


def test_wrong_spec_and_missing_psum_fail_the_check(mesh8, monkeypatch):
  """The equivalence check has teeth: a weight sharded along the wrong mesh axes, or a dropped
  all-reduce, is caught."""
  real_specs = C.param_specs

  def swapped(cfg, mesh, layout, quantized=False, gathered=False):
    specs = real_specs(cfg, mesh, layout, quantized, gathered)
    layer = dict(specs["layers"][0])
    gate = layer["gate"]  # F_yz -> F_zy: same shapes, wrong chunks on each chip
    layer["gate"] = gate.__class__(gate.logical, gate.shape, (("x",), ("z", "y")))
    return {**specs, "layers": [layer, *specs["layers"][1:]]}

  monkeypatch.setattr(C, "param_specs", swapped)
  with pytest.raises(AssertionError, match="logits"):
    _run(CFG, mesh8, "ws_2d", "heads", quantized=False)
  monkeypatch.undo()

  monkeypatch.setattr(comm, "psum", lambda x, axes: x)  # drops e.g. the 2D norm's all-reduce
  with pytest.raises(AssertionError, match="logits"):
    _run(CFG, mesh8, "ws_2d", "heads", quantized=False)


def test_orbax_restore_straight_into_a_layout(mesh8, tmp_path):
  from models.io import checkpoint
  params = quantize(init_params(CFG, jax.random.key(0)), CFG)
  checkpoint.save_params(tmp_path / "ckpt", params, CFG)
  shardings = L.param_shardings(CFG, mesh8, "ws_2d", quantized=True)
  restored = checkpoint.restore_params(tmp_path / "ckpt", shardings=shardings)
  gate = restored["layers"][1]["gate"]
  assert gate.quant.sharding.spec == jax.sharding.PartitionSpec("x", ("y", "z"))
  np.testing.assert_array_equal(gate.quant, params["layers"][1]["gate"].quant)


def test_w8a8_act_quant_runs_sharded(mesh8):
  """act_quant=True quantizes each token over the chip's local slice of the contracted axis:
  exact when contractions are local (wg_xyz), otherwise within int8 rounding (< 5% of the
  largest logit; the int8-vs-float gap itself is ~2% here)."""
  params = quantize(init_params(CFG, jax.random.key(0)), CFG, act_quant=True)
  _, x, _, _ = _case(CFG, False)
  ref, _ = T.jit_prefill(params, x["toks"], init_cache(CFG, B, S), x["start"], x["lens"],
                         cfg=CFG)
  for ffn, attn, rtol in (("wg_xyz", "batch_xyz", RTOL), ("ws_2d", "heads", 0.05)):
    step = C.make_sharded_step(CFG, mesh8, ffn, attn, "prefill")
    got, _ = step(C.shard_params(params, CFG, mesh8, ffn), x["toks"],
                  C.init_sharded_cache(CFG, B, S, mesh8, ffn, attn), x["start"], x["lens"])
    err = float(jnp.max(jnp.abs(got - ref)))
    assert err <= rtol * max(1.0, float(jnp.max(jnp.abs(ref)))), (ffn, err)
