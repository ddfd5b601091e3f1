"""The AMX kernel (``cpu_kernels.matmul_amx_group``) and how ``models.quant`` routes to it: the
product of bf16 activations with bf16 or int8 ``[K, N]`` weights against an f64 reference for
shapes off every tile boundary (also from tiled copies: ``matmul_amx_tiled_group``); ``einsum`` / ``einsums`` under a policy that enables it equal
XLA's dot; the routing rules (bf16 activations, ``[K, N]``, weight-only int8, the row range);
bad groups refused; and the policy's range rule. Skipped where the CPU has no AMX (the AMD EPYC
machines): there the kernel is never chosen (``amx_available()`` is False)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.cpu import kernels as cpu_kernels, lowering as cpu_lowering
from models import quant
from models.quant import quantize_array
from models.config import get_preset
from tests.cpu_policies import NATIVE, XLA_ONLY, decode_step_vs_xla

needs_amx = pytest.mark.skipif(not cpu_kernels.amx_available(),
                               reason="no AMX on this CPU (or the OS refused its tile state)")
AMX = dataclasses.replace(NATIVE, policy=dataclasses.replace(
    cpu_lowering.DEFAULT, amx_min_rows=4, amx_max_rows=96, amx_int8_min_rows=4,
    amx_int8_max_rows=96, amx_nk_min_rows=4, amx_nk_max_rows=96))


def _rel_err(got, ref) -> float:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(got - ref)) / max(1e-30, float(np.max(np.abs(ref)))))


def _amx_calls(fn, *args) -> int:
  return jax.jit(fn).lower(*args).compile().as_text().count("phaseserve_amx_matmul_group")


# Rows across the 16- and 32-row tile blocks (1, 17, 33, 64), K off the 32-row K step (100,
# 31), N off the 16- and 32-column tiles (33, 17) and wider than one chunk (1536; 20000 with a
# short K), and a group of several widths; prefill-sized rows (>= 256: the whole-K loop, each
# C block written straight to y or through its buffer where it crosses row M or column N),
# including a K whose whole-K panel is a single 32-column chunk (K 8000).
@needs_amx
@pytest.mark.parametrize("wdtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("m,k,ns", [(1, 576, (576, 192, 192)), (17, 100, (33, 64)),
                                    (33, 31, (17,)), (64, 1536, (576,)), (5, 40, (20000, 48)),
                                    (256, 576, (1536, 192)), (300, 100, (33, 700)),
                                    (257, 8000, (40,))])
def test_amx_group_equals_the_products(wdtype, m, k, ns):
  rng = np.random.default_rng(m + k)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  ws = [jnp.asarray(rng.integers(-127, 128, (k, n)) if wdtype == "int8"
                    else rng.standard_normal((k, n)), wdtype) for n in ns]
  got = jax.jit(cpu_kernels.matmul_amx_group)(x, ws)
  assert [g.shape for g in got] == [(m, n) for n in ns]
  for g, w in zip(got, ws):
    ref = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    # bf16 x bf16 products are exact in f32 (int8 values are exact in bf16): f32 summation only.
    assert _rel_err(g, ref) < 1e-5


@needs_amx
@pytest.mark.parametrize("wdtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("m,k,n", [(1, 576, 1000), (33, 100, 70), (64, 31, 33), (17, 64, 4097)])
def test_amx_nk_equals_the_product(wdtype, m, k, n):
  rng = np.random.default_rng(m * k + n)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.integers(-127, 128, (n, k)) if wdtype == "int8"
                  else rng.standard_normal((n, k)), wdtype)
  got = jax.jit(cpu_kernels.matmul_amx_nk)(x, w)
  ref = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
  assert got.shape == (m, n) and _rel_err(got, ref) < 1e-5


@needs_amx
def test_amx_group_refuses_bad_operands():
  x = jnp.ones((4, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match="matmul_amx_group"):
    cpu_kernels.matmul_amx_group(x.astype(jnp.float32), [jnp.ones((8, 4), jnp.bfloat16)])
  with pytest.raises(ValueError, match="matmul_amx_group"):
    cpu_kernels.matmul_amx_group(x, [jnp.ones((8, 4), jnp.float32)])
  with pytest.raises(ValueError, match="matmul_amx_group"):
    cpu_kernels.matmul_amx_group(x, [jnp.ones((8, 4), jnp.bfloat16), jnp.ones((8, 4), jnp.int8)])
  with pytest.raises(ValueError, match="matmul_amx_group"):
    cpu_kernels.matmul_amx_group(x, [jnp.ones((7, 4), jnp.bfloat16)])
  with pytest.raises(ValueError, match="matmul_amx_nk"):
    cpu_kernels.matmul_amx_nk(x, jnp.ones((4, 7), jnp.bfloat16))


def _layer(rng, quantize: bool):
  """SmolLM2-like q / k / v and down weights, bf16 or weight-only int8."""
  def w(*shape):
    a = jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.bfloat16)
    return quantize_array(a.astype(jnp.float32), (0,)) if quantize else a
  return [w(64, 4, 16), w(64, 1, 16), w(64, 1, 16)], w(96, 64)


@needs_amx
@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("rows", [3, 24, 96, 97])
def test_einsums_on_amx_equal_xla(quantize, rows):
  rng = np.random.default_rng(rows)
  qkv, down = _layer(rng, quantize)
  x = jnp.asarray(rng.standard_normal((rows, 1, 64)), jnp.bfloat16)
  h = jnp.asarray(rng.standard_normal((rows, 1, 96)), jnp.bfloat16)
  specs = ["BTD,DNH->BTNH"] * 3

  table = jnp.asarray(rng.standard_normal((96, 64)) * 0.05, jnp.bfloat16)  # a tied [V, D]
  if quantize:
    table = quantize_array(table.astype(jnp.float32), (1,))

  def make(b):
    return lambda x, h: quant.einsums(specs, x, qkv, b) + [
        quant.einsum("BTF,FD->BTD", h, down, b), quant.einsum("BTD,VD->BTV", x, table, b)]

  ref = jax.jit(make(XLA_ONLY))(x, h)
  got = jax.jit(make(AMX))(x, h)
  calls = _amx_calls(make(AMX), x, h)
  # In the range [4, 96]: one grouped call for q / k / v and one for down; outside it none.
  assert calls == (2 if 4 <= rows <= 96 else 0)
  # The tied table: bf16 in the amx_nk range; int8 past the native [N, K] kernel's rows.
  nk_calls = jax.jit(make(AMX)).lower(x, h).compile().as_text().count("phaseserve_amx_matmul_nk")
  int8_nk = AMX.policy.int8_nk_native_max_rows < rows <= AMX.policy.amx_int8_max_rows
  assert nk_calls == (int8_nk if quantize else 4 <= rows <= 96)
  for g, r in zip(got, ref):
    assert g.dtype == jnp.bfloat16 and g.shape == r.shape
    # Both are f32 sums of exact products rounded once to bf16: within a few bf16 ulps.
    assert _rel_err(g, r) < 2 ** -6


@needs_amx
def test_amx_routing_rules():
  rng = np.random.default_rng(0)
  w_bf16 = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
  w_int8 = quantize_array(w_bf16.astype(jnp.float32), (0,))
  w_w8a8 = dataclasses.replace(w_int8, act_quant=True)
  x16 = jnp.ones((16, 64), jnp.bfloat16)
  assert _amx_calls(lambda x: quant.einsum("MK,KN->MN", x, w_bf16, AMX), x16) == 1
  assert _amx_calls(lambda x: quant.einsum("MK,KN->MN", x, w_int8, AMX), x16) == 1
  # Not: f32 activations (AMX would round them to bf16), W8A8, too few rows; an [N, K] weight
  # not through the [K, N] kernel.
  assert _amx_calls(lambda x: quant.einsum("MK,KN->MN", x, w_bf16, AMX),
                    x16.astype(jnp.float32)) == 0
  assert _amx_calls(lambda x: quant.einsum("MK,KN->MN", x, w_w8a8, AMX), x16) == 0
  assert _amx_calls(lambda x: quant.einsum("MK,NK->MN", x, w_bf16.T, AMX), x16) == 0
  assert _amx_calls(lambda x: quant.einsum("MK,KN->MN", x, w_bf16, AMX), x16[:3]) == 0
  # [N, K] (a tied unembedding): weight-only int8 past the native [N, K] kernel's rows only.
  w_nk = quantize_array(w_bf16.T.astype(jnp.float32), (1,))
  x24 = jnp.ones((24, 64), jnp.bfloat16)
  nk = lambda x: quant.einsum("MK,NK->MN", x, w_nk, AMX)  # noqa: E731
  assert AMX.policy.int8_nk_native_max_rows < 24
  assert jax.jit(nk).lower(x24).compile().as_text().count("phaseserve_amx_matmul_nk") == 1
  assert jax.jit(nk).lower(x16[:AMX.policy.int8_nk_native_max_rows]).compile().as_text().count(
      "phaseserve_amx_matmul_nk") == 0
  # bf16 [N, K]: rows in the policy's amx_nk range (raced at start-up); not outside it.
  t_bf16 = w_bf16.T
  nk16 = lambda x, p=AMX.policy: quant.einsum(  # noqa: E731
      "MK,NK->MN", x, t_bf16, dataclasses.replace(AMX, policy=p))
  nk_calls = lambda x, **kw: jax.jit(functools.partial(  # noqa: E731
      nk16, p=dataclasses.replace(AMX.policy, **kw))).lower(x).compile().as_text().count(
          "phaseserve_amx_matmul_nk")
  assert nk_calls(x16) == 1
  assert nk_calls(x16, amx_nk_max_rows=0) == 0
  assert nk_calls(x16[:3]) == 0 and nk_calls(x24, amx_nk_max_rows=16) == 0
  off = dataclasses.replace(AMX, policy=dataclasses.replace(AMX.policy, amx_max_rows=0))
  assert _amx_calls(lambda x: quant.einsum("MK,KN->MN", x, w_bf16, off), x16) == 0
  assert _amx_calls(lambda x: quant.einsum("MK,KN->MN", x, w_int8, off), x16) == 1


def test_win_range_is_the_first_run_of_wins():
  other = {8: 10.0, 16: 10.0, 32: 10.0, 64: 10.0, 128: 10.0}
  assert cpu_lowering.win_range({8: 9.5, 16: 8.0, 32: 8.0, 64: 9.5, 128: 5.0}, other) == (16, 32)
  assert cpu_lowering.win_range({8: 5.0, 16: 5.0, 32: 5.0, 64: 5.0, 128: 5.0}, other) == (8, 128)
  assert cpu_lowering.win_range({m: 9.5 for m in other}, other) == (0, 0)  # within the margin


@needs_amx
def test_every_int8_value_is_exact():
  """Each of the 256 int8 values (widened to bf16 inside the kernel) times one-hot rows of x:
  the product must be the value itself."""
  w = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8).reshape(8, 32)  # [K, N]
  x = jnp.eye(8, dtype=jnp.bfloat16)  # row i picks weight row i
  (y,) = jax.jit(cpu_kernels.matmul_amx_group)(x, [w])
  np.testing.assert_array_equal(np.asarray(y), np.asarray(w, np.float32))


@needs_amx
@pytest.mark.parametrize("quantize", [False, True])
def test_decode_step_on_amx_equals_xla(quantize):
  """A whole decode step of the tiny model (bf16, weight-only int8 too) at 24 rows: every
  [K, N] matmul on AMX against XLA's dots."""
  got, ref, hlo = decode_step_vs_xla(AMX, quantize)
  # Every layer's q / k / v, o, gate / up and down on the kernel.
  assert hlo.count("phaseserve_amx_matmul_group") >= 3 * get_preset("tiny").num_layers
  # bf16 activations rounded at every layer on both sides, sums in different orders.
  assert _rel_err(np.asarray(got, np.float32), np.asarray(ref, np.float32)) < 2 ** -5


# Rows across the 16- and 32-row blocks and past 64 (1, 17, 33, 64, 100, 300), N off the 16-
# and 32-column tiles (40: an odd count of column tiles; 17), a group of several widths.
@needs_amx
@pytest.mark.parametrize("m,k,ns", [(1, 576, (576, 192, 192)), (17, 64, (40,)),
                                    (33, 96, (17, 1536)), (64, 1536, (576,)), (100, 32, (48,)),
                                    (300, 576, (1536,))])
def test_amx_tiled_group_equals_the_products(m, k, ns):
  rng = np.random.default_rng(m * 7 + k)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  ws = [jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16) for n in ns]
  got = jax.jit(cpu_kernels.matmul_amx_tiled_group, static_argnums=2)(
      x, [cpu_kernels.tile_weight(w) for w in ws], tuple(ns))
  assert [g.shape for g in got] == [(m, n) for n in ns]
  for g, w in zip(got, ws):
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert _rel_err(g, ref) < 1e-5


@needs_amx
def test_amx_tiled_refuses_what_it_cannot_read():
  x = jnp.ones((4, 48), jnp.bfloat16)
  with pytest.raises(ValueError, match="K % 32"):  # K off the 32-row K step
    cpu_kernels.matmul_amx_tiled_group(x, [cpu_kernels.tile_weight(jnp.ones((48, 16)))], [16])
  x = jnp.ones((4, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="bf16"):  # int8 tiles
    cpu_kernels.matmul_amx_tiled_group(
        x, [cpu_kernels.tile_weight(jnp.ones((64, 16), jnp.int8))], [16])


AMX_TILED = dataclasses.replace(AMX, policy=dataclasses.replace(
    AMX.policy, amx_tiled_min_rows=8, amx_tiled_max_rows=64))


@needs_amx
def test_amx_tiled_routing_rules():
  """A ``TiledArray`` with bf16 tiles goes to AMX on its tiles for bf16 activations in the
  policy's ``amx_tiled`` rows (grouped: one call); other rows read the stored weight (AMX's
  panel kernel in its range); f32 activations and K off 32 never."""
  rng = np.random.default_rng(3)
  a = jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16)
  w = quant.TiledArray(a, cpu_kernels.tile_weight(a))
  tiled_calls = lambda fn, x: jax.jit(fn).lower(x).compile().as_text().count(  # noqa: E731
      "phaseserve_amx_tiled_group")
  one = lambda x: quant.einsum("MK,KN->MN", x, w, AMX_TILED)  # noqa: E731
  two = lambda x: quant.einsums(["MK,KN->MN"] * 2, x, [w, w], AMX_TILED)  # noqa: E731
  x16 = jnp.ones((16, 64), jnp.bfloat16)
  assert tiled_calls(one, x16) == 1 and tiled_calls(two, x16) == 1
  assert tiled_calls(one, x16[:4]) == 0 and _amx_calls(one, x16[:4]) == 1  # below: the panel
  assert tiled_calls(one, jnp.ones((65, 64), jnp.bfloat16)) == 0
  assert tiled_calls(one, x16.astype(jnp.float32)) == 0
  np.testing.assert_allclose(np.asarray(jax.jit(one)(x16), np.float32),
                             np.asarray(quant.einsum("MK,KN->MN", x16, w.array, XLA_ONLY),
                                        np.float32), rtol=2 ** -7)
  k48 = quant.TiledArray(jnp.ones((48, 32), jnp.bfloat16),
                         cpu_kernels.tile_weight(jnp.ones((48, 32), jnp.bfloat16)))
  assert tiled_calls(lambda x: quant.einsum("MK,KN->MN", x, k48, AMX_TILED),
                     jnp.ones((16, 48), jnp.bfloat16)) == 0


@needs_amx
def test_decode_step_on_amx_tiles_equals_xla():
  """A whole decode step of the tiny model at 24 rows from tiled copies: every [K, N] matmul
  on AMX's tiled path against XLA's dots."""
  got, ref, hlo = decode_step_vs_xla(AMX_TILED, False, tile=True)
  assert hlo.count("phaseserve_amx_tiled_group") >= 3 * get_preset("tiny").num_layers
  assert "phaseserve_amx_matmul_group" not in hlo
  assert _rel_err(np.asarray(got, np.float32), np.asarray(ref, np.float32)) < 2 ** -5


@needs_amx
@pytest.mark.parametrize("quantize", [False, True])
def test_placement_makes_amx_tiles_for_bf16_weights_only(quantize):
  """Without the AVX512-BF16 tiled kernel, AMX's tiled rows alone make the copies: every bf16
  matmul weight of the step is a ``TiledArray``; weight-only int8 ones are left as stored (AMX
  reads only bf16 tiles)."""
  from models import weights
  from models.step import UnshardedStep
  cfg = get_preset("tiny")
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), weights.init_params(cfg, jax.random.key(0)))
  if quantize:
    params = weights.quantize(params, cfg)
  be = dataclasses.replace(AMX_TILED, tiled=False)
  placed = UnshardedStep(cfg, backend=be).place_params(params)
  leaves = jax.tree.leaves(placed["layers"], is_leaf=lambda w: isinstance(
      w, (quant.TiledArray, quant.QuantArray)))
  tiled = [w for w in leaves if isinstance(w, quant.TiledArray)]
  if quantize:
    assert not tiled
  else:
    assert len(tiled) >= 7 * cfg.num_layers and all(w.tiles.dtype == jnp.bfloat16 for w in tiled)
  none = UnshardedStep(cfg, backend=dataclasses.replace(be, policy=dataclasses.replace(
      be.policy, amx_tiled_max_rows=0))).place_params(params)
  assert not any(isinstance(w, quant.TiledArray) for w in jax.tree.leaves(
      none, is_leaf=lambda w: isinstance(w, quant.TiledArray)))
