"""The AVX512-BF16 kernel (``cpu_kernels.matmul_dpbf16_group`` / ``matmul_dpbf16_nk``) and how
``models.quant`` routes to it: products of bf16 activations with bf16 or int8 weights against an
f64 reference for shapes off every block boundary (rows across the 12-row register blocks, odd
K, columns off the 32-column tiles, K split over threads); ``einsum`` / ``einsums`` and a whole
decode step under a backend that enables it against XLA's dots; the routing rules. Skipped
where the CPU lacks ``avx512_bf16`` (there ``dpbf16_available()`` is False and the kernel is
never chosen)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import quant
from models.cpu import kernels as cpu_kernels
from models.quant import quantize_array
from models.config import get_preset
from tests.cpu_policies import NATIVE, XLA_ONLY, decode_step_vs_xla

needs_dpbf16 = pytest.mark.skipif(not cpu_kernels.dpbf16_available(),
                                  reason="no avx512_bf16 on this CPU")
DP = dataclasses.replace(NATIVE, amx=False, dpbf16=True, policy=dataclasses.replace(
    NATIVE.policy, dpbf16_min_rows=2, dpbf16_max_rows=96, dpbf16_int8_min_rows=2,
    dpbf16_int8_max_rows=96))


def _rel_err(got, ref) -> float:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(got - ref)) / max(1e-30, float(np.max(np.abs(ref)))))


def _calls(fn, *args, target="phaseserve_dpbf16_matmul_group") -> int:
  return jax.jit(fn).lower(*args).compile().as_text().count(target)


def _weight(rng, shape, wdtype):
  return jnp.asarray(rng.integers(-127, 128, shape) if wdtype == "int8"
                     else rng.standard_normal(shape), wdtype)


@needs_dpbf16
@pytest.mark.parametrize("wdtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("m,k,ns", [(1, 576, (576, 192, 192)), (12, 100, (33, 64)),
                                    (13, 31, (17,)), (37, 1536, (576,)), (64, 7, (5, 40)),
                                    (5, 40, (20000, 48))])
def test_group_equals_the_products(wdtype, m, k, ns):
  rng = np.random.default_rng(m + k)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  ws = [_weight(rng, (k, n), wdtype) for n in ns]
  got = jax.jit(cpu_kernels.matmul_dpbf16_group)(x, ws)
  assert [g.shape for g in got] == [(m, n) for n in ns]
  for g, w in zip(got, ws):
    ref = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    # bf16 x bf16 products are exact in f32 (int8 values are exact in bf16): f32 sums only.
    assert _rel_err(g, ref) < 1e-5


@needs_dpbf16
@pytest.mark.parametrize("wdtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("m,k,n", [(1, 576, 1000), (7, 100, 70), (64, 31, 33), (17, 64, 4097)])
def test_nk_equals_the_product(wdtype, m, k, n):
  rng = np.random.default_rng(m * k + n)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = _weight(rng, (n, k), wdtype)
  got = jax.jit(cpu_kernels.matmul_dpbf16_nk)(x, w)
  ref = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
  assert got.shape == (m, n) and _rel_err(got, ref) < 1e-5


@needs_dpbf16
def test_every_int8_value_is_exact():
  """Each of the 256 int8 values (widened to bf16 in the kernel) times one-hot rows of x."""
  w = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8).reshape(8, 32)  # [K, N]
  x = jnp.eye(8, dtype=jnp.bfloat16)
  (y,) = jax.jit(cpu_kernels.matmul_dpbf16_group)(x, [w])
  np.testing.assert_array_equal(np.asarray(y), np.asarray(w, np.float32))
  y = jax.jit(cpu_kernels.matmul_dpbf16_nk)(x, w.T)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(w, np.float32))


@needs_dpbf16
def test_refuses_bad_operands():
  x = jnp.ones((4, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match="matmul_dpbf16_group"):
    cpu_kernels.matmul_dpbf16_group(x.astype(jnp.float32), [jnp.ones((8, 4), jnp.bfloat16)])
  with pytest.raises(ValueError, match="matmul_dpbf16_group"):
    cpu_kernels.matmul_dpbf16_group(x, [jnp.ones((8, 4), jnp.bfloat16),
                                        jnp.ones((8, 4), jnp.int8)])
  with pytest.raises(ValueError, match="matmul_dpbf16_group"):
    cpu_kernels.matmul_dpbf16_group(x, [jnp.ones((7, 4), jnp.bfloat16)])
  with pytest.raises(ValueError, match="matmul_dpbf16_nk"):
    cpu_kernels.matmul_dpbf16_nk(x, jnp.ones((4, 7), jnp.bfloat16))
  # Past the wrappers, the kernels check their operands themselves.
  f32 = jax.ShapeDtypeStruct((4, 4), jnp.float32)
  with pytest.raises(Exception, match="phaseserve_dpbf16_matmul_nk: want"):
    jax.ffi.ffi_call("phaseserve_dpbf16_matmul_nk", f32)(x, jnp.ones((4, 7), jnp.bfloat16))
  with pytest.raises(Exception, match="phaseserve_dpbf16_matmul_group: want"):
    jax.ffi.ffi_call("phaseserve_dpbf16_matmul_group", [f32])(x, jnp.ones((7, 4), jnp.int8))


@needs_dpbf16
@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 24, 97])
def test_einsums_equal_xla(quantize, rows):
  rng = np.random.default_rng(rows)

  def w(*shape, axes=(0,)):
    a = jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.bfloat16)
    return quantize_array(a.astype(jnp.float32), axes) if quantize else a

  qkv, down, table = [w(64, 4, 16), w(64, 1, 16), w(64, 1, 16)], w(96, 64), w(96, 64, axes=(1,))
  x = jnp.asarray(rng.standard_normal((rows, 1, 64)), jnp.bfloat16)
  h = jnp.asarray(rng.standard_normal((rows, 1, 96)), jnp.bfloat16)
  specs = ["BTD,DNH->BTNH"] * 3

  def make(b):
    return lambda x, h: quant.einsums(specs, x, qkv, b) + [
        quant.einsum("BTF,FD->BTD", h, down, b), quant.einsum("BTD,VD->BTV", x, table, b)]

  ref = jax.jit(make(XLA_ONLY))(x, h)
  got = jax.jit(make(DP))(x, h)
  in_range = 2 <= rows <= 96
  # In the range: one grouped call for q / k / v, one for down, one [N, K] call; else none.
  assert _calls(make(DP), x, h) == (2 if in_range else 0)
  assert _calls(make(DP), x, h, target="phaseserve_dpbf16_matmul_nk") == (1 if in_range else 0)
  for g, r in zip(got, ref):
    assert g.dtype == jnp.bfloat16 and g.shape == r.shape
    # Both are f32 sums of exact products rounded once to bf16: within a few bf16 ulps.
    assert _rel_err(g, r) < 2 ** -6


@needs_dpbf16
def test_routing_rules():
  rng = np.random.default_rng(0)
  w_bf16 = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
  w_int8 = quantize_array(w_bf16.astype(jnp.float32), (0,))
  w_w8a8 = dataclasses.replace(w_int8, act_quant=True)
  x16 = jnp.ones((16, 64), jnp.bfloat16)
  mm = lambda w, b=DP: (lambda x: quant.einsum("MK,KN->MN", x, w, b))  # noqa: E731
  assert _calls(mm(w_bf16), x16) == 1
  assert _calls(mm(w_int8), x16) == 1
  # Not: f32 activations (bf16 products would round them), W8A8, f32 weights, rows out of range,
  # a backend without the kernel.
  assert _calls(mm(w_bf16), x16.astype(jnp.float32)) == 0
  assert _calls(mm(w_w8a8), x16) == 0
  assert _calls(mm(w_bf16.astype(jnp.float32)), x16) == 0
  assert _calls(mm(w_bf16), x16[:1]) == 0
  assert _calls(mm(w_bf16, dataclasses.replace(DP, dpbf16=False)), x16) == 0
  # The ranges are per weight format.
  bf16_off = dataclasses.replace(DP, policy=dataclasses.replace(DP.policy, dpbf16_max_rows=0))
  assert _calls(mm(w_bf16, bf16_off), x16) == 0
  assert _calls(mm(w_int8, bf16_off), x16) == 1


@needs_dpbf16
@pytest.mark.parametrize("quantize", [False, True])
def test_decode_step_equals_xla(quantize):
  """A whole decode step of the tiny model (bf16, weight-only int8 too) at 24 rows: every
  matmul on the kernel against XLA's dots."""
  got, ref, hlo = decode_step_vs_xla(DP, quantize)
  # Every layer's q / k / v, o, gate / up and down on the kernel.
  assert hlo.count("phaseserve_dpbf16_matmul_group") >= 3 * get_preset("tiny").num_layers
  # bf16 activations rounded at every layer on both sides, sums in different orders.
  assert _rel_err(np.asarray(got, np.float32), np.asarray(ref, np.float32)) < 2 ** -5
