"""Tests for partitioning.hardware and partitioning.cost_model (hand-checked arithmetic)."""

import dataclasses
import math

import pytest

from models.config import ModelConfig, get_preset
from partitioning import cost_model
from partitioning.cost_model import check_layout, optimal_2d_x, step_cost, structural_reason
from partitioning.hardware import HARDWARE_NAMES, Hardware, get_hardware

# Toy model, small enough to check by hand:
#   param_count(False) = L*(d*h*(2N+2K) + 3*d*F + d) + d = 2*(48 + 96 + 4) + 4 = 300
#   param_count(True) = 300 + V*d (tied) = 340; per-layer params = 148
#   flops_per_token(0) = 2*(L*(48 + 96) + V*d) = 656
TOY = ModelConfig(name="toy", vocab_size=10, embed_dim=4, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=2, mlp_dim=8, tie_embeddings=True,
                  parallel_block=True)
# Switched fabric: W = 10 B/s, recursive-doubling steps of 0.5 s.
TOY_HW = Hardware(name="toy", peak_flops_bf16=1e3, peak_flops_int8=2e3, hbm_bandwidth=100.0,
                  hbm_bytes=1e9, ici_bandwidth=10.0, torus_dims=0,
                  collective_step_latency_s=0.5, max_chips=64)
PALM = get_preset("palm-540b")
V4 = get_hardware("tpu-v4")


def test_toy_model_counts():
  assert TOY.param_count(include_embedding=False) == 300
  assert TOY.param_count() == 340
  assert TOY.flops_per_token(0) == 656


def test_decode_ws_1d_by_hand():
  c = step_cost(TOY, TOY_HW, "ws_1d", "heads", (2, 1, 1), "decode", batch=4, context=3)
  # FLOPs: 4 tokens * (656 + L*4*N*H*S = 2*4*2*2*3 = 96).
  assert c.flops == 3008
  # Each chip also repeats the k / v projections (whole under ws_1d): L*2*T*E*2*K*H = 256
  # FLOPs, half of them beyond its even share.
  assert c.compute_s == pytest.approx((3008 / 2 + 128) / 1e3)
  # ws_1d: 2*T*E*a*(n-1)/n/W = 2*4*4*2*(1/2)/10 = 3.2 s per layer (each chip sends and
  # receives half of the gathered / reduced tensor); 2 collectives x 1 step x 0.5 s per layer.
  assert c.collective_floor_s == pytest.approx(2.0)
  assert c.comm_s == pytest.approx(2 * 3.2 + 2.0)
  # Weights: 340 params * 2 B over 2 chips, except the k / v projections (2*E*K*H = 16 params,
  # 32 B per layer), which ws_1d keeps whole on every chip (kv heads are never sharded, E is not
  # sharded by ws_1d): (680 - 2*32) / 2 + 2*32 = 372 B, all read each step.
  # KV: L*B*S*2*K*H*2 B = 192, MQA + heads: replicated.
  assert c.weight_bytes_per_chip == 372
  assert c.weight_mem_s == pytest.approx(3.72)
  assert c.kv_bytes_per_chip == 192
  assert c.kv_mem_s == pytest.approx(1.92)
  latency = 3.72 + 1.92 + 8.4  # memory-bound, comms not overlapped
  assert c.latency_s == pytest.approx(latency)
  assert c.mfu == pytest.approx(3008 / (latency * 2 * 1e3))
  assert c.cost_chip_s_per_token == pytest.approx(latency * 2 / 4)
  assert c.hbm_bytes_per_chip == pytest.approx(372 + 192 + 4 * 2 * 4 * 2 / 2)
  assert c.fits and c.tokens == 4 and c.n_chips == 2


def test_decode_ws_2d_batch_sharded_by_hand():
  c = step_cost(TOY, TOY_HW, "ws_2d", "batch_yz", (2, 2, 1), "decode", batch=4, context=3)
  # ws_2d: 2*T*a*(E/X*(YZ-1)/YZ + F/YZ*(X-1)/X)/W = 2*4*2*(2/2 + 4/2)/10 = 4.8 s per layer.
  # all-to-all over yz (2 chips) of Q in and the output back (K/V are sliced, not moved):
  # T*2N*H*a = 64 B globally, 32 B per group; switch: 32 * (1/2) / 2 / 10 = 0.8 s per layer.
  # Steps per layer: 2*(1+1) + 2*1 = 6.
  assert c.collective_floor_s == pytest.approx(2 * 6 * 0.5)
  assert c.comm_s == pytest.approx(2 * (4.8 + 0.8) + 6.0)
  assert c.all_to_all_s == pytest.approx(2 * (0.8 + 2 * 0.5))
  assert c.kv_bytes_per_chip == 96  # split over the 2 batch shards
  # Weights read: everything over the 4 chips but the k / v projections (32 B per layer), split
  # over x = 2 only: 2*(264/4 + 32/2) + 88/4 = 186 B.
  assert c.weight_mem_s == pytest.approx(186 / 100)
  assert c.latency_s == pytest.approx(1.86 + 0.96 + 17.2)


def test_prefill_weight_gathered_int8_by_hand():
  c = step_cost(TOY, TOY_HW, "wg_xyz", "batch_xyz", (2, 1, 1), "prefill", batch=2, context=3,
                weights="int8")
  # 6 tokens, causal mean context (3+1)/2 = 2: attention 2*4*2*2*2 = 64 per token.
  assert c.flops == 6 * (656 + 64)
  # Gather a 148-byte layer over N = 2 of 2 chips, receiving the other half: 148*2/2*(1/2)/10 =
  # 7.4 s per layer; no activation collective (N = n) and no all-to-all (both shard the batch
  # over xyz).
  assert c.comm_s == pytest.approx(2 * 7.4 + 2 * 2 * 1 * 0.5)
  # Gathered weights read: (L*148*2 + 44 embedding/norm bytes)/2 = 318 B.
  assert c.weight_mem_s == pytest.approx(3.18)
  assert c.kv_bytes_per_chip == 48
  assert c.latency_s == pytest.approx(3.18 + 0.48 + 16.8)
  assert c.hbm_bytes_per_chip == pytest.approx(170 + 48 + 148 + 6 * 8 * 2 / 2)


def test_single_chip_has_no_communication():
  c = step_cost(TOY, TOY_HW, "ws_1d", "heads", (1, 1, 1), "decode", 4, 3)
  assert c.comm_s == 0 and c.collective_floor_s == 0
  assert c.weight_bytes_per_chip == 680


def test_serial_block_doubles_activation_collectives():
  serial = dataclasses.replace(TOY, parallel_block=False)
  a = step_cost(TOY, TOY_HW, "ws_1d", "heads", (4, 1, 1), "decode", 4, 3)
  b = step_cost(serial, TOY_HW, "ws_1d", "heads", (4, 1, 1), "decode", 4, 3)
  assert b.comm_s == pytest.approx(2 * a.comm_s)


def test_paper_2d_formula_at_optimum():
  """With F = 4E and X = sqrt(nE/F) = 0.5*sqrt(n) the paper's formula is 8*T*E*a/(sqrt(n)*W) per
  layer; the model moves each collective's exact ring share (g-1)/g of it, per axis group."""
  hw = dataclasses.replace(V4, collective_step_latency_s=0.0)
  assert optimal_2d_x(PALM, 64) == pytest.approx(4.0)
  c = step_cost(PALM, hw, "ws_2d", "heads", (4, 4, 4), "decode", batch=512, context=2048)
  e, f, t, a, w = PALM.embed_dim, PALM.mlp_dim, 512, 2, 270e9
  assert f == 4 * e
  paper = 8 * t * e * a / (math.sqrt(64) * w)
  # The two halves of the paper's sum: E/X over the 16 yz chips, F/YZ over the 4 x chips.
  exact = 2 * t * a * (e / 4 * 15 / 16 + f / 16 * 3 / 4) / w
  assert exact == pytest.approx(paper * (15 / 16 + 3 / 4) / 2)
  assert c.comm_s == pytest.approx(PALM.num_layers * exact)
  one_d = step_cost(PALM, hw, "ws_1d", "heads", (64, 1, 1), "decode", batch=512, context=2048)
  assert one_d.comm_s == pytest.approx(PALM.num_layers * 2 * t * e * a * 63 / 64 / w)


def test_ring_volumes_tie_1d_and_2d_on_eight_chips():
  """On 8 chips (X = 2, YZ = 4, F = 4E) ws_1d and ws_2d move the same activation bytes:
  2*T*E*a*7/8 = 2*T*a*(E/2*3/4 + E*1/2); the factor-free formulas would charge ws_2d 1.5x."""
  hw = dataclasses.replace(V4, collective_step_latency_s=0.0)
  m = get_preset("palm-62b")
  assert m.mlp_dim == 4 * m.embed_dim
  args = ("decode", 512, 2048)
  one = step_cost(m, hw, "ws_1d", "batch_xyz", (2, 2, 2), *args)
  two = step_cost(m, hw, "ws_2d", "batch_xyz", (2, 2, 2), *args)
  assert one.all_to_all_s == pytest.approx(two.all_to_all_s)
  assert one.comm_s - one.all_to_all_s == pytest.approx(two.comm_s - two.all_to_all_s)
  assert V4.ring_fraction(1) == 0 and V4.ring_fraction(8) == 7 / 8


def test_int8_halves_weight_memory_and_gather_time():
  args = ("decode", 64, 2048)
  bf16 = step_cost(PALM, V4, "ws_2d", "batch_xyz", (4, 4, 4), *args, weights="bf16")
  int8 = step_cost(PALM, V4, "ws_2d", "batch_xyz", (4, 4, 4), *args, weights="int8")
  assert int8.weight_mem_s == pytest.approx(bf16.weight_mem_s / 2)
  assert int8.weight_bytes_per_chip == pytest.approx(bf16.weight_bytes_per_chip / 2)
  assert int8.latency_s < bf16.latency_s
  wg16 = step_cost(PALM, V4, "wg_xyz", "batch_xyz", (4, 4, 4), "prefill", 64, 2048, "bf16")
  wg8 = step_cost(PALM, V4, "wg_xyz", "batch_xyz", (4, 4, 4), "prefill", 64, 2048, "int8")
  assert wg8.comm_s - wg8.collective_floor_s == pytest.approx(
      (wg16.comm_s - wg16.collective_floor_s) / 2)


def test_batch_sharding_splits_multiquery_kv_cache():
  heads = step_cost(PALM, V4, "ws_2d", "heads", (4, 4, 4), "decode", 64, 2048)
  batch = step_cost(PALM, V4, "ws_2d", "batch_xyz", (4, 4, 4), "decode", 64, 2048)
  total = cost_model.kv_cache_bytes(PALM, 64, 2048)
  assert heads.kv_bytes_per_chip == pytest.approx(total)  # K = 1: replicated on every chip
  assert batch.kv_bytes_per_chip == pytest.approx(total / 64)


def test_hbm_fit_rejection():
  assert not step_cost(PALM, V4, "ws_2d", "batch_xyz", (2, 2, 2), "decode", 8, 2048).fits
  # 512 x 2048 multiquery cache replicated per chip (~118 GiB) cannot fit in 32 GiB.
  assert not step_cost(PALM, V4, "ws_2d", "heads", (4, 4, 4), "decode", 512, 2048).fits
  assert step_cost(PALM, V4, "ws_2d", "batch_xyz", (4, 4, 4), "decode", 512, 2048).fits


def test_check_layout_reasons():
  assert check_layout("ws_2d", "batch_xyz", (4, 4, 4), 64) is None
  assert "divisible" in check_layout("ws_2d", "batch_xyz", (4, 4, 4), 32)
  assert "divisible" in check_layout("wg_xyz", "heads", (4, 4, 4), 1)
  assert structural_reason("ws_1d", "heads", (4, 4, 4)) is None  # ws_1d runs on any mesh
  assert structural_reason("ws_1d", "batch_yz", (8, 1, 1))  # y = 1: is batch_z
  assert structural_reason("ws_2d", "batch_z", (4, 16, 1))  # z = 1: is heads
  assert structural_reason("wg_x", "heads", (8, 1, 1))
  assert structural_reason("wg_xyz", "heads", (8, 1, 1)) is None
  assert structural_reason("nope", "heads", (1, 1, 1))
  with pytest.raises(ValueError):
    step_cost(PALM, V4, "ws_2d", "batch_xyz", (4, 4, 4), "decode", 32, 2048)
  with pytest.raises(ValueError):
    step_cost(PALM, V4, "ws_2d", "heads", (4, 4, 4), "train", 32, 2048)  # type: ignore[arg-type]


def test_ws_1d_cost_depends_only_on_the_chip_count():
  ref = step_cost(PALM, V4, "ws_1d", "heads", (64, 1, 1), "decode", 64, 2048)
  for mesh in [(4, 4, 4), (1, 8, 8), (2, 4, 8)]:
    assert step_cost(PALM, V4, "ws_1d", "heads", mesh, "decode", 64, 2048) == ref
  # Batch-sharded attention: only the all-to-all group (the named axes) depends on the shape.
  a = step_cost(PALM, V4, "ws_1d", "batch_z", (4, 4, 4), "decode", 64, 2048)
  b = step_cost(PALM, V4, "ws_1d", "batch_z", (16, 1, 4), "decode", 64, 2048)
  assert a == b and a.all_to_all_s > 0 and a.kv_bytes_per_chip == ref.kv_bytes_per_chip / 4


def test_weight_gathered_attention_keeps_the_ffn_batch_axes():
  """As layouts.make_plan: the FFN's batch axes stay batch axes in attention; only the named
  axes not already batch axes are moved by the all-to-all."""
  mesh = (4, 4, 4)
  assert cost_model.attention_batch_axes("wg_xyz", "heads", mesh) == "xyz"
  assert cost_model.all_to_all_axes("wg_xyz", "batch_z", mesh) == ""
  assert cost_model.attention_batch_axes("wg_x", "batch_z", mesh) == "xz"
  assert cost_model.all_to_all_axes("wg_xy", "batch_xyz", mesh) == "z"
  args = ("prefill", 64, 2048)
  same = [step_cost(PALM, V4, "wg_xyz", a, mesh, *args) for a in cost_model.ATTN_LAYOUT_NAMES]
  assert all(c == same[0] for c in same) and same[0].all_to_all_s == 0
  zs = [step_cost(PALM, V4, "wg_xy", a, mesh, *args) for a in ("batch_z", "batch_yz", "batch_xyz")]
  assert all(c == zs[0] for c in zs) and zs[0].all_to_all_s > 0
  heads = step_cost(PALM, V4, "wg_xy", "heads", mesh, *args)
  assert heads.all_to_all_s == 0
  total = cost_model.kv_cache_bytes(PALM, 64, 2048)
  assert heads.kv_bytes_per_chip == pytest.approx(total / 16)  # sharded over xy, not replicated
  assert zs[0].kv_bytes_per_chip == pytest.approx(total / 64)
  # The planner reports each program once, under the name that matches its batch axes.
  assert cost_model.canonical_attention("wg_xyz", "heads", mesh) == "batch_xyz"
  assert cost_model.canonical_attention("wg_xy", "batch_z", mesh) == "batch_xyz"
  assert cost_model.canonical_attention("wg_xy", "heads", mesh) == "heads"
  assert cost_model.canonical_attention("wg_x", "batch_z", mesh) == "batch_z"
  assert cost_model.canonical_attention("wg_xyz", "heads", (8, 1, 1)) == "batch_xyz"
  assert "attention batch chips" in check_layout("wg_x", "batch_z", mesh, 8)  # needs B % 16


def _fake_mesh(shape):
  from partitioning.mesh import make_mesh

  return make_mesh(shape=shape)


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 2, 4), (8, 1, 1)])
def test_attention_axes_agree_with_make_plan(shape):
  """The cost model's attention batch chips, all-to-all and KV shard count equal what the
  sharding code (layouts.make_plan, followed by collectives.py) does, for every pair the cost
  model accepts on the mesh, on a config where nothing falls back."""
  from partitioning import layouts

  cfg = get_preset("tiny").replace(num_heads=8, vocab_size=256, embed_dim=64, mlp_dim=128)
  mesh = _fake_mesh(shape)
  batch = 16
  programs: dict[tuple[str, str], set] = {}
  for ffn in cost_model.FFN_LAYOUT_NAMES:
    for attn in cost_model.ATTN_LAYOUT_NAMES:
      if structural_reason(ffn, attn, shape):
        continue
      plan = layouts.make_plan(cfg, mesh, ffn, attn, batch)
      assert not plan.reasons, (ffn, attn, plan.reasons)
      ab = set(cost_model.attention_batch_axes(ffn, attn, shape))
      assert ab == set(plan.ab), (ffn, attn)
      assert set(cost_model.all_to_all_axes(ffn, attn, shape)) == set(plan.move), (ffn, attn)
      c = step_cost(cfg, TOY_HW, ffn, attn, shape, "decode", batch, 8)
      chips = layouts.axes_size(mesh, plan.ab)
      assert cost_model.attention_batch_chips(ffn, attn, shape) == chips
      assert (c.all_to_all_s > 0) == bool(plan.move), (ffn, attn)
      kv_shards = cost_model.kv_cache_bytes(cfg, batch, 8) / c.kv_bytes_per_chip
      spec = layouts.cache_spec(plan)  # [L, B.ab, K, S, H]
      code_shards = math.prod(layouts.axes_size(mesh, (e,) if isinstance(e, str) else e)
                              for e in spec if e is not None)
      assert kv_shards == pytest.approx(code_shards) and code_shards == chips, (ffn, attn)
      # The planner's de-duplication: same canonical name <=> the code runs the same program.
      programs.setdefault((ffn, cost_model.canonical_attention(ffn, attn, shape)),
                          set()).add(plan.key())
  assert sum(map(len, programs.values())) == len(programs)  # one program per canonical name
  assert len({k for keys in programs.values() for k in keys}) == len(programs)
  assert len(programs) == {(2, 2, 2): 14, (1, 2, 4): 4, (8, 1, 1): 3}[shape]


def test_hardware_presets():
  assert set(HARDWARE_NAMES) >= {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "h100", "h200",
                                 "local"}
  assert V4.network_bandwidth == pytest.approx(270e9)  # the paper's figure
  assert V4.peak_flops_bf16 == 275e12 and V4.hbm_bandwidth == 1.2e12
  h200 = get_hardware("h200")
  assert h200.hbm_bytes == 141e9 and h200.network_bandwidth == 450e9
  with pytest.raises(ValueError):
    get_hardware("tpu-v9")
  # A 64-chip 1D collective takes as many hops as a 16-chip plus a 4-chip one on a 4x4x4 torus.
  assert [V4.collective_steps(g) for g in (1, 2, 4, 16, 64)] == [0, 1, 2, 4, 6]
  assert V4.all_to_all_time(1e9, 64) == pytest.approx(1e9 / (4 * 270e9))
  with pytest.raises(ValueError):
    dataclasses.replace(V4, hbm_bandwidth=0.0)


def test_measure_smoke():
  from partitioning import hardware

  assert hardware.measure_matmul_peak("bfloat16", 64, reps=1) > 0
  assert hardware.measure_matmul_peak("int8", 32, reps=1) > 0
  assert hardware.measure_read_bandwidth(1 << 20, reps=1) > 0
  local = hardware.measure_local(matmul_size=64, read_bytes=1 << 20)
  assert local.name == "local" and local.peak_flops_bf16 > 0 and local.hbm_bytes > 0


@pytest.mark.parametrize("layout", ["ws_1d", "ws_2d", "wg_xyz"])
def test_resident_weights_match_the_layouts_shards(layout):
  """The cost model's weight bytes per chip are what ``partitioning.layouts`` places, for a
  grouped-query model whose dimensions all divide the mesh (8 kv heads are never sharded: the
  k / v projections are whole on every chip under ws_1d, split over x otherwise)."""
  import jax
  import numpy as np
  from models.config import get_shape
  from models.weights import abstract_params
  from partitioning import layouts
  from partitioning.mesh import make_mesh
  cfg = get_shape("llama-3-70b")
  shape = (2, 2, 2)
  mesh = make_mesh(jax.devices()[:8], shape)
  leaves = jax.tree.leaves(abstract_params(cfg, quantized=True))
  shards = jax.tree.leaves(layouts.param_shardings(cfg, mesh, layout, True))
  placed = sum(int(np.prod(sh.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
               for x, sh in zip(leaves, shards) if x.dtype == np.int8)  # the int8 weights
  cost = step_cost(cfg, get_hardware("tpu-v5e"), layout, "heads", shape, "decode", 8, 1024,
                   "int8")
  assert cost.weight_bytes_per_chip == pytest.approx(placed, rel=0.002)


def test_repeated_kv_projection_flops_match_the_compiled_programs():
  """The k / v projections' FLOPs repeated per chip (whole under ws_1d, split over x under
  ws_2d, not repeated under wg_xyz) are what XLA counts in the sharded prefill programs: the
  difference between two layouts' per-device FLOPs is the difference of the model's terms."""
  import functools
  import jax
  import jax.numpy as jnp
  from models.config import get_preset
  from models.weights import init_params
  from partitioning import collectives
  from partitioning.layouts import get_attn_layout, get_ffn_layout
  from partitioning.mesh import make_mesh
  cfg = get_preset("tiny").replace(num_heads=8, num_kv_heads=2, head_dim=32, embed_dim=256,
                                   mlp_dim=512, vocab_size=256, num_layers=2)
  shape, b, t = (2, 2, 2), 8, 64
  mesh = make_mesh(jax.devices()[:8], shape)
  params = init_params(cfg, jax.random.key(0))
  hw = get_hardware("tpu-v5e")
  compiled, modelled = {}, {}
  for ffn in ("ws_1d", "ws_2d", "wg_xyz"):
    fn = jax.jit(functools.partial(collectives._prefill, cfg=cfg, mesh=mesh,
                                   ffn=get_ffn_layout(ffn), attn=get_attn_layout("heads")),
                 static_argnames=("attend_len", "all_logits"))
    cache = collectives.init_sharded_cache(cfg, b, t, mesh, ffn, "heads", jnp.float32)
    lowered = fn.lower(collectives.shard_params(params, cfg, mesh, ffn),
                       jnp.zeros((b, t), jnp.int32), cache, jnp.zeros((b,), jnp.int32),
                       jnp.full((b,), t, jnp.int32), attend_len=None, all_logits=False)
    analysis = lowered.compile().cost_analysis()
    compiled[ffn] = (analysis[0] if isinstance(analysis, (list, tuple)) else analysis)["flops"]
    modelled[ffn] = step_cost(cfg, hw, ffn, "heads", shape, "prefill", b, t).compute_s \
        * hw.peak_flops_bf16
  for ffn in ("ws_1d", "ws_2d"):
    want = modelled[ffn] - modelled["wg_xyz"]
    assert want > 0
    assert compiled[ffn] - compiled["wg_xyz"] == pytest.approx(want, rel=0.15), ffn


def test_collective_bandwidth_and_ring_switches():
  """The two ways of charging a collective the TPU v4 fit set chose between
  (``published.collective_sensitivity``): ring shares on / off, per-axis links off / on."""
  links = dataclasses.replace(V4, axis_links=True)
  assert V4.collective_bandwidth(1) == V4.collective_bandwidth(3) == 270e9  # the paper's W
  assert links.collective_bandwidth(1) == pytest.approx(90e9)  # one axis, both directions
  assert links.collective_bandwidth(2) == pytest.approx(180e9)
  assert links.collective_bandwidth(3) == pytest.approx(270e9)
  assert dataclasses.replace(TOY_HW, axis_links=True).collective_bandwidth(1) == 10.0  # switch
  paper = dataclasses.replace(V4, ring_volumes=False)
  assert paper.ring_fraction(2) == 1.0 and V4.ring_fraction(2) == 0.5
  assert paper.ring_fraction(1) == V4.ring_fraction(1) == 0.0
  # ws_2d on 2x2x2 with per-axis links: the x collectives (one axis) at a third of W, the yz
  # ones (two axes) at two thirds: E/2*(3/4)/(2W/3) + E*(1/2)/(W/3) against 0.375 E + 0.5 E at W.
  hw0 = dataclasses.replace(links, collective_step_latency_s=0.0)
  m = get_preset("palm-62b")
  base = step_cost(m, dataclasses.replace(V4, collective_step_latency_s=0.0), "ws_2d", "heads",
                   (2, 2, 2), "decode", 8, 128)
  per_axis = step_cost(m, hw0, "ws_2d", "heads", (2, 2, 2), "decode", 8, 128)
  assert per_axis.comm_s / base.comm_s == pytest.approx((0.375 * 1.5 + 0.5 * 3) / 0.875)


def test_weight_gathered_remainder_collectives_use_ring_shares():
  """wg_x on a 2x2x1 toy mesh: the layer's weights gathered over x (N = 2) and the activations'
  all-gather + reduce-scatter over the remaining y (r = 2), each at its ring share 1/2."""
  c = step_cost(TOY, TOY_HW, "wg_x", "heads", (2, 2, 1), "decode", batch=4, context=3)
  gather = (148 * 2) * 2 / 4 * (1 / 2) / 10  # W_layer*N/n*(N-1)/N / W = 7.4 s per layer
  rest = 2 * (4 / 2) * 4 * 2 * (1 / 2) / 10  # 2*(T/N)*E*a*(r-1)/r / W = 1.6 s per layer
  # hops per layer: 2 for the gather (1 step over 2 chips each way) + 2 over y.
  assert c.collective_floor_s == pytest.approx(2 * 4 * 0.5)
  assert c.comm_s - c.all_to_all_s == pytest.approx(2 * (gather + rest) + 4.0)
