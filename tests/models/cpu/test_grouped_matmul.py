"""Grouped native matmuls (``cpu_kernels.matmul_float_group`` / ``matmul_w8a8_group``) and
``quant.einsums``, which sends the weights that share an activation (q / k / v, gate / up) to
one of them: equal to the separate products (W8A8 bit for bit, float up to summation order),
one native call where they group, the separate einsums where they do not, and bad groups
refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.cpu import kernels as cpu_kernels
from models import quant
from models.quant import quantize_array
from tests.cpu_policies import NATIVE, XLA_ONLY, needs_kernel


def _rel_err(got, ref) -> float:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(got - ref)) / max(1e-30, float(np.max(np.abs(ref)))))


def _targets(fn, *args) -> list[str]:
  """The custom-call targets in the compiled HLO of ``fn(*args)``."""
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  return [t for t in ("phaseserve_float_matmul_group", "phaseserve_w8a8_matmul_group",
                      "phaseserve_float_matmul\"", "phaseserve_w8a8_matmul\"")
          for _ in range(hlo.count(t))]


# Shapes: SmolLM2's q / k / v (576 -> 576, 192, 192: K split over two threads), a scalar-tail
# width (33), a K that is no multiple of any block (100), rows across the 8-row register block
# (9), and a K of one block under wide weights (two parts, the second with no rows).
@needs_kernel
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("m,k,ns", [(1, 576, (576, 192, 192)), (3, 100, (96, 33)),
                                    (9, 64, (64, 160, 32, 31)), (2, 8, (40000, 20000))])
def test_float_group_equals_the_products(wdtype, m, k, ns):
  rng = np.random.default_rng(m + k)
  x = rng.standard_normal((m, k)).astype(np.float32)
  ws = [jnp.asarray(rng.integers(-127, 128, (k, n)) if wdtype == "int8"
                    else rng.standard_normal((k, n)), wdtype) for n in ns]
  got = jax.jit(cpu_kernels.matmul_float_group)(x, ws)
  assert [g.shape for g in got] == [(m, n) for n in ns]
  for g, w in zip(got, ws):
    ref = x.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    assert _rel_err(g, ref) < 1e-5  # f32 sums of exact products: summation order only


@needs_kernel
@pytest.mark.parametrize("m,k,ns", [(1, 576, (1536, 1536)), (6, 96, (64, 33, 17)),
                                    (16, 130, (48, 32)), (2, 16, (20000, 33))])
def test_w8a8_group_is_the_separate_calls_bit_for_bit(m, k, ns):
  rng = np.random.default_rng(m * 7 + k)
  x = rng.standard_normal((m, k)).astype(np.float32) * 3
  if m > 1:
    x[1] = 0.0  # amax == 0: scale 1
  ws = [rng.integers(-127, 128, (k, n), dtype=np.int8) for n in ns]
  ss = [rng.uniform(0.001, 0.1, (n,)).astype(np.float32) for n in ns]
  got = jax.jit(lambda x, ws, ss: cpu_kernels.matmul_w8a8_group(x, ws, ss))(x, ws, ss)
  for g, w, s in zip(got, ws, ss):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(cpu_kernels.matmul_w8a8(x, w, s)))


@needs_kernel
def test_bad_groups_are_refused():
  x = jnp.ones((1, 8), jnp.float32)
  with pytest.raises(ValueError, match="one dtype"):
    cpu_kernels.matmul_float_group(x, [jnp.ones((8, 32), jnp.float32),
                                       jnp.ones((8, 32), jnp.bfloat16)])
  with pytest.raises(ValueError, match="matmul_float_group"):
    cpu_kernels.matmul_float_group(x, [jnp.ones((9, 32), jnp.float32)])  # K mismatch
  with pytest.raises(ValueError, match="matmul_float_group"):
    cpu_kernels.matmul_float_group(x, [])
  with pytest.raises(ValueError, match="matmul_w8a8_group"):
    cpu_kernels.matmul_w8a8_group(x, [jnp.ones((8, 32), jnp.int8)], [])


QKV = ("btd,dnh->btnh", "btd,dkh->btkh", "btd,dkh->btkh")


def _qkv(kind: str, d: int = 64):
  keys = jax.random.split(jax.random.key(0), 3)
  shapes = [(d, 4, 16), (d, 2, 16), (d, 2, 16)]
  ws = [jax.random.normal(k, s, jnp.float32) / np.sqrt(d) for k, s in zip(keys, shapes)]
  if kind == "bfloat16":
    return [w.astype(jnp.bfloat16) for w in ws]
  if kind in ("weight_only", "w8a8"):
    return [quantize_array(w, (0,), act_quant=kind == "w8a8") for w in ws]
  return ws


@needs_kernel
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "weight_only", "w8a8"])
def test_einsums_group_decode_rows_in_one_call(kind):
  """Decode rows: one grouped native call replaces three, and the results are those of the
  separate einsums (W8A8 bit for bit; float up to summation order, bf16 up to its rounding)."""
  dtype = jnp.bfloat16 if kind == "bfloat16" else jnp.float32
  x = jax.random.normal(jax.random.key(1), (2, 1, 64), jnp.float32).astype(dtype)
  ws = _qkv(kind)
  grouped = lambda x, ws: quant.einsums(QKV, x, ws, NATIVE)
  separate = lambda x, ws: [quant.einsum(s, x, w, NATIVE) for s, w in zip(QKV, ws)]
  group_target = ("phaseserve_w8a8_matmul_group" if kind == "w8a8"
                  else "phaseserve_float_matmul_group")
  assert _targets(grouped, x, ws) == [group_target]
  assert len(_targets(separate, x, ws)) == 3 and group_target not in _targets(separate, x, ws)
  got, ref = jax.jit(grouped)(x, ws), jax.jit(separate)(x, ws)
  for g, r in zip(got, ref):
    assert g.shape == r.shape and g.dtype == r.dtype == dtype
    if kind == "w8a8":
      np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    else:
      assert _rel_err(g, r) < (1e-2 if kind == "bfloat16" else 1e-5)


@needs_kernel
def test_einsums_falls_back_where_products_do_not_group():
  """Mixed weight kinds, prefill rows past the native limit, XLA-only policy: the separate
  einsums, with their results."""
  x = jax.random.normal(jax.random.key(1), (1, 1, 64), jnp.float32)
  f32, wo = _qkv("float32"), _qkv("weight_only")
  mixed = [f32[0], wo[1], wo[2]]
  assert "phaseserve_float_matmul_group" not in _targets(
      lambda x, ws: quant.einsums(QKV, x, ws, NATIVE), x, mixed)
  rows = jax.random.normal(jax.random.key(2), (2, 16, 64), jnp.float32)  # 32 rows > 16
  assert _targets(lambda x, ws: quant.einsums(QKV, x, ws, NATIVE), rows, wo) == []
  assert _targets(lambda x, ws: quant.einsums(QKV, x, ws, XLA_ONLY), x, wo) == []
  assert _targets(lambda x, ws: quant.einsums(QKV, x, ws), x, wo) == []  # the library default
  for xs, ws in ((x, mixed), (rows, wo)):
    got = jax.jit(lambda x, ws: quant.einsums(QKV, x, ws, NATIVE))(xs, ws)
    ref = jax.jit(lambda x, ws: [quant.einsum(s, x, w, NATIVE) for s, w in zip(QKV, ws)])(xs, ws)
    for g, r in zip(got, ref):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
  with pytest.raises(ValueError, match="3 specs for 2 weights"):
    quant.einsums(QKV, x, wo[:2], NATIVE)
