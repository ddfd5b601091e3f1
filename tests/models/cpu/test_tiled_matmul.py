"""The tiled AVX512-BF16 kernel (``cpu_kernels.matmul_tiled_group`` on ``tile_weight`` copies of
bf16 and int8 weights) and how ``models.quant`` routes ``TiledArray`` weights to it: the layout
index by index, every int8 value widened exactly, products against an f64 reference off every
boundary (rows across the 8- and 16-lane vectors, odd K,
columns off the 16-column tiles, several weights split over threads), the routing rules, and a
whole decode step on tiled params (unrolled and stacked layers) against XLA's dots. Skipped where
the CPU lacks ``avx512_bf16`` (there the backend never has the kernel and no copy is made)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import quant, weights
from models.config import get_preset
from models.cpu import kernels as cpu_kernels
from models.step import UnshardedStep
from tests.cpu_policies import NATIVE, XLA_ONLY, decode_step_vs_xla

needs_tiled = pytest.mark.skipif(not cpu_kernels.tiled_available(),
                                 reason="no avx512_bf16 on this CPU")
TILED = dataclasses.replace(NATIVE, amx=False, dpbf16=False, tiled=True, policy=dataclasses.replace(
    NATIVE.policy, tiled_min_rows=2, tiled_max_rows=96, tiled_int8_min_rows=2,
    tiled_int8_max_rows=96))
TARGET = "phaseserve_tiled_matmul_group"


def _rel_err(got, ref) -> float:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(got - ref)) / max(1e-30, float(np.max(np.abs(ref)))))


def _calls(fn, *args) -> int:
  return jax.jit(fn).lower(*args).compile().as_text().count(TARGET)


def test_tile_layout_index_by_index():
  k, n = 5, 19  # odd K (a zero row pads the last pair), N past one 16-column tile
  w = jnp.arange(k * n, dtype=jnp.float32).reshape(k, n).astype(jnp.bfloat16)
  t = np.asarray(cpu_kernels.tile_weight(w), np.float32)
  assert t.shape == (2, 3, 32)
  wn = np.asarray(w, np.float32)
  for ti in range(2):
    for p in range(3):
      for c in range(16):
        for j in range(2):
          row, col = 2 * p + j, 16 * ti + c
          want = wn[row, col] if row < k and col < n else 0.0
          assert t[ti, p, 2 * c + j] == want, (ti, p, c, j)


def _weight(rng, shape, wdtype):
  return jnp.asarray(rng.integers(-127, 128, shape) if wdtype == "int8"
                     else rng.standard_normal(shape), wdtype)


@needs_tiled
@pytest.mark.parametrize("wdtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("m,k,ns", [(1, 7, (5,)), (3, 33, (17, 40)), (8, 64, (16,)),
                                    (9, 576, (576, 192, 192)), (16, 101, (33,)),
                                    (17, 1536, (576,)), (40, 66, (100, 3)), (97, 30, (2000,))])
def test_group_equals_the_products(wdtype, m, k, ns):
  rng = np.random.default_rng(m + k)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  ws = [_weight(rng, (k, n), wdtype) for n in ns]
  got = jax.jit(lambda x, ts: cpu_kernels.matmul_tiled_group(x, ts, ns))(
      x, [cpu_kernels.tile_weight(w) for w in ws])
  assert [g.shape for g in got] == [(m, n) for n in ns]
  for g, w in zip(got, ws):
    ref = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    # bf16 x bf16 products are exact in f32 (int8 values are exact in bf16): f32 sums only.
    assert _rel_err(g, ref) < 1e-5


@needs_tiled
def test_every_int8_value_is_exact():
  """Each of the 256 int8 values (widened to bf16 in the kernel) times one-hot rows of x."""
  w = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8).reshape(8, 32)  # [K, N]
  x = jnp.eye(8, dtype=jnp.bfloat16)
  (y,) = jax.jit(lambda x, t: cpu_kernels.matmul_tiled_group(x, [t], [32]))(
      x, cpu_kernels.tile_weight(w))
  np.testing.assert_array_equal(np.asarray(y), np.asarray(w, np.float32))


@needs_tiled
def test_refuses_bad_operands():
  x = jnp.ones((4, 8), jnp.bfloat16)
  t = cpu_kernels.tile_weight(jnp.ones((8, 20), jnp.bfloat16))  # [2, 4, 32]
  with pytest.raises(ValueError, match="matmul_tiled_group"):
    cpu_kernels.matmul_tiled_group(x.astype(jnp.float32), [t], [20])
  with pytest.raises(ValueError, match="matmul_tiled_group"):
    cpu_kernels.matmul_tiled_group(x, [t], [40])  # 40 columns are 3 tiles
  with pytest.raises(ValueError, match="matmul_tiled_group"):
    cpu_kernels.matmul_tiled_group(jnp.ones((4, 10), jnp.bfloat16), [t], [20])
  with pytest.raises(ValueError, match="matmul_tiled_group"):  # two dtypes in one group
    cpu_kernels.matmul_tiled_group(x, [t, t.astype(jnp.int8)], [20, 20])
  f32 = jax.ShapeDtypeStruct((4, 20), jnp.float32)
  with pytest.raises(Exception, match="phaseserve_tiled_matmul_group: want"):
    jax.ffi.ffi_call(TARGET, [f32])(x, t[:, :3])


@needs_tiled
@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 24, 97])
def test_einsums_equal_xla(quantize, rows):
  rng = np.random.default_rng(rows)

  def w(*shape, axes=(0,)):
    a = jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.bfloat16)
    return quant.tile_array(quant.quantize_array(a.astype(jnp.float32), axes) if quantize else a,
                            axes)

  qkv, o = [w(64, 4, 16), w(64, 1, 16), w(64, 1, 16)], w(4, 16, 64, axes=(0, 1))
  table = w(96, 64, axes=(1,))  # a tied [V, D] table as the unembedding: contracted trailing
  x = jnp.asarray(rng.standard_normal((rows, 1, 64)), jnp.bfloat16)
  a = jnp.asarray(rng.standard_normal((rows, 1, 4, 16)), jnp.bfloat16)
  specs = ["BTD,DNH->BTNH"] * 3

  def make(b):
    return lambda x, a: quant.einsums(specs, x, qkv, b) + [
        quant.einsum("BTNH,NHD->BTD", a, o, b), quant.einsum("BTD,VD->BTV", x, table, b)]

  ref = jax.jit(make(XLA_ONLY))(x, a)
  got = jax.jit(make(TILED))(x, a)
  # In the range: one grouped call for q / k / v, one for o, one for the table; else none.
  assert _calls(make(TILED), x, a) == (3 if 2 <= rows <= 96 else 0)
  for g, r in zip(got, ref):
    assert g.dtype == jnp.bfloat16 and g.shape == r.shape
    assert _rel_err(g, r) < 2 ** -6  # f32 sums of exact products, each rounded once to bf16


@needs_tiled
def test_routing_rules():
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
  tw = quant.tile_array(w, (0,))
  x16 = jnp.ones((16, 64), jnp.bfloat16)
  mm = lambda w, b=TILED: (lambda x: quant.einsum("MK,KN->MN", x, w, b))  # noqa: E731
  assert _calls(mm(tw), x16) == 1
  # Not: a plain weight, f32 activations, rows out of range, a backend without the kernel, tiles
  # of another contraction (the weight read as [N, K]).
  assert _calls(mm(w), x16) == 0
  assert _calls(mm(tw), x16.astype(jnp.float32)) == 0
  assert _calls(mm(tw), x16[:1]) == 0
  assert _calls(mm(tw, dataclasses.replace(TILED, tiled=False)), x16) == 0
  assert _calls(lambda x: quant.einsum("MN,KN->MK", x, tw, TILED), jnp.ones((16, 32),
                                                                             jnp.bfloat16)) == 0
  # The stored copy serves every other use.
  ids = jnp.array([3, 0, 63])
  np.testing.assert_array_equal(np.asarray(quant.take_rows(tw, ids, jnp.float32)),
                                np.asarray(w[ids], np.float32))


def test_tile_params_copies_bf16_matmul_weights_only():
  cfg = get_preset("tiny")
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), weights.init_params(cfg, jax.random.key(0)))
  tiled = weights.tile_params(params, cfg)
  assert isinstance(tiled["embed"], quant.TiledArray)
  assert not isinstance(tiled["final_norm"], quant.TiledArray)
  layer = tiled["layers"][0]
  assert all(isinstance(layer[n], quant.TiledArray) for n in ("q", "k", "v", "o", "gate", "up",
                                                               "down"))
  assert not isinstance(layer["attn_norm"], quant.TiledArray)
  d, n, h = cfg.embed_dim, cfg.num_heads, cfg.head_dim
  assert layer["o"].tiles.shape == (-(-d // 16), -(-n * h // 2), 32)
  np.testing.assert_array_equal(np.asarray(layer["q"].array), np.asarray(params["layers"][0]["q"]))
  # Stacked layers: one copy per layer along the leading axis.
  st = weights.tile_params(weights.stack_layers(params), cfg)
  assert st["layers"]["gate"].tiles.shape == (cfg.num_layers, *layer["gate"].tiles.shape)
  np.testing.assert_array_equal(np.asarray(st["layers"]["gate"].tiles[1]),
                                np.asarray(tiled["layers"][1]["gate"].tiles))
  # Weight-only int8: int8 tiles, the scales in the stored QuantArray; f32: none; W8A8: the
  # VNNI kernel's uint8 quads (tests/models/cpu/test_tiled_w8a8.py), none without ``w8a8``.
  q = weights.tile_params(weights.quantize(params, cfg), cfg)["layers"][0]["down"]
  assert isinstance(q, quant.TiledArray) and isinstance(q.array, quant.QuantArray)
  assert q.tiles.dtype == jnp.int8
  for p, w8a8 in ((weights.init_params(cfg, jax.random.key(0)), True),
                  (weights.quantize(params, cfg, act_quant=True), False)):
    assert not any(isinstance(x, quant.TiledArray) for x in jax.tree.leaves(
        weights.tile_params(p, cfg, w8a8=w8a8),
        is_leaf=lambda x: isinstance(x, quant.TiledArray)))


def test_the_step_places_copies_only_where_its_backend_reads_them():
  cfg = get_preset("tiny")
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), weights.init_params(cfg, jax.random.key(0)))
  is_tiled = lambda p: isinstance(p["layers"][0]["q"], quant.TiledArray)  # noqa: E731
  assert is_tiled(UnshardedStep(cfg, backend=TILED).place_params(params))
  assert not is_tiled(UnshardedStep(cfg, backend=XLA_ONLY).place_params(params))
  off = dataclasses.replace(TILED, policy=dataclasses.replace(
      TILED.policy, tiled_max_rows=0, tiled_int8_max_rows=0))
  assert not is_tiled(UnshardedStep(cfg, backend=off).place_params(params))


@needs_tiled
@pytest.mark.parametrize("quantize,stacked", [(False, False), (False, True), (True, False)])
def test_decode_step_equals_xla(quantize, stacked):
  """A whole decode step of the tiny model (bf16, weight-only int8 too) at 24 rows on tiled
  params: every matmul and the tied unembedding on the kernel against XLA's dots (which read
  the stored copies)."""
  got, ref, hlo = decode_step_vs_xla(TILED, quantize, tile=True, stacked=stacked)
  layers = 1 if stacked else get_preset("tiny").num_layers  # a scan body is traced once
  # q / k / v, o, gate / up, down per layer and the unembedding.
  assert hlo.count(TARGET) >= 4 * layers + 1
  assert _rel_err(np.asarray(got, np.float32), np.asarray(ref, np.float32)) < 2 ** -5


@needs_tiled
def test_start_up_race_records_both_formats():
  """``lowering_kernels.measure_tiled`` (small shapes): every row count raced for bf16 and int8,
  ranges among the measured counts."""
  from models.cpu import lowering_kernels
  meas: dict = {}
  rows = (1, 16)
  got = lowering_kernels.measure_tiled(meas, 1, 64, 128, 4 * 64 * 128, "xw", 8, 16,
                                       ((8, 32), (0, 0)), rows=rows)
  assert {f"tiled_{w}_{m}rows" for w in ("bf16", "int8") for m in rows} == set(meas)
  assert all(set(v) == {"tiled", "incumbent"} and min(v.values()) > 0 for v in meas.values())
  for lo, hi in got:
    assert (lo, hi) == (0, 0) or (lo in rows and hi in rows and lo <= hi)


def test_untile_gives_back_the_stored_weights():
  cfg = get_preset("tiny")
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), weights.init_params(cfg, jax.random.key(0)))
  back = weights.untile(weights.tile_params(params, cfg))
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
