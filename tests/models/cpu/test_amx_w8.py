"""AMX's int8 products for weight-only int8 weights (``kernels.matmul_amx_w8_group``, native
``amx_w8.h``): the quad layout index by index; products off every tile boundary against the
same 16-bit quantization of x done in numpy with integer sums (to f32 rounding) and against
the f64 product (to the quantization's error: with a 40x outlier in a row, ~2e-4 of the largest
output); what it refuses; the
router's rule; a whole decode step of the tiny model on it; the copies placement makes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import quant
from models.config import get_preset
from models.cpu import kernels as cpu_kernels
from tests.cpu_policies import XLA_ONLY, decode_step_vs_xla
from tests.models.cpu.test_amx_matmul import AMX, needs_amx

AMX_W8 = dataclasses.replace(AMX, tiled=False, policy=dataclasses.replace(
    AMX.policy, amx_w8_min_rows=4, amx_w8_max_rows=64))


def _quantized_product(x, w) -> np.ndarray:
  """What the kernel computes: each row of x to 16 bits (``rint(x * (32767 / amax))`` in f32,
  half to even), integer sums with the int8 values, times ``amax / 32767``."""
  xf = np.asarray(x, np.float32)
  amax = np.abs(xf).max(axis=1, keepdims=True)
  inv = np.where(amax > 0, np.float32(32767) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
  q = np.clip(np.rint(xf * inv), -32767, 32767).astype(np.int64)
  return (q @ np.asarray(w, np.int64)) * (amax / np.float32(32767)).astype(np.float64)


def _rel(got, ref) -> float:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(got - ref)) / max(1e-30, float(np.max(np.abs(ref)))))


def test_quad_layout_index_by_index():
  w = np.arange(70 * 20).reshape(70, 20) % 251 - 125
  t = np.asarray(cpu_kernels.tile_weight_quads(jnp.asarray(w, jnp.int8)))
  assert t.shape == (2, 18, 64) and t.dtype == np.int8
  for tt in range(2):
    for q in range(18):
      for c in range(16):
        for j in range(4):
          k, n = 4 * q + j, 16 * tt + c
          assert t[tt, q, 4 * c + j] == (w[k, n] if k < 70 and n < 20 else 0)


# Rows across the 16-row blocks (1, 17, 33, 64, 100), N off the 16-column tiles (40: an odd
# count; 17), K of one to 24 steps of 64, a group of several widths.
@needs_amx
@pytest.mark.parametrize("m,k,ns", [(1, 576, (576, 192, 192)), (17, 64, (40,)),
                                    (33, 128, (17, 1536)), (64, 1536, (576,)),
                                    (100, 64, (48,))])
def test_amx_w8_group_equals_the_quantized_products(m, k, ns):
  rng = np.random.default_rng(m * 5 + k)
  x = rng.standard_normal((m, k)).astype(np.float32)
  x[0, 3] = 40.0  # an outlier sets row 0's step
  if m > 2:
    x[2] = 0.0  # a zero row: zeros out
  x = jnp.asarray(x, jnp.bfloat16)
  ws = [rng.integers(-127, 128, (k, n)).astype(np.int8) for n in ns]
  got = jax.jit(cpu_kernels.matmul_amx_w8_group, static_argnums=2)(
      x, [cpu_kernels.tile_weight_quads(jnp.asarray(w)) for w in ws], tuple(ns))
  assert [g.shape for g in got] == [(m, n) for n in ns]
  for g, w in zip(got, ws):
    assert _rel(g, _quantized_product(x, w)) < 1e-6
    # the 16-bit activations' error: at most half a step (row 0: 40 / 32767) per element
    assert _rel(g, np.asarray(x, np.float64) @ w.astype(np.float64)) < 1e-3
    if m > 2:
      assert not np.asarray(g)[2].any()


@needs_amx
def test_amx_w8_refuses_what_it_cannot_read():
  w = jnp.ones((96, 16), jnp.int8)
  with pytest.raises(ValueError, match="K % 64"):
    cpu_kernels.matmul_amx_w8_group(jnp.ones((4, 96), jnp.bfloat16),
                                    [cpu_kernels.tile_weight_quads(w)], [16])
  x = jnp.ones((4, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="int8"):  # pairs, not quads
    cpu_kernels.matmul_amx_w8_group(x, [cpu_kernels.tile_weight(jnp.ones((64, 16), jnp.int8))],
                                    [16])
  with pytest.raises(ValueError, match="int8 values"):
    cpu_kernels.tile_weight_quads(jnp.ones((64, 16), jnp.bfloat16))


@needs_amx
def test_amx_w8_routing_rules():
  """A weight-only int8 ``TiledArray`` with quad tiles goes to AMX's int8 products for bf16
  activations in the policy's ``amx_w8`` rows (grouped: one call); other rows, f32 activations
  and K off 64 read the stored weight."""
  rng = np.random.default_rng(4)
  a = quant.quantize_array(jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16), (0,))
  w = quant.tile_array(a, (0,), quads=True)
  assert w.tiles.dtype == jnp.int8 and w.tiles.shape == (3, 16, 64)
  calls = lambda fn, x: jax.jit(fn).lower(x).compile().as_text().count(  # noqa: E731
      "phaseserve_amx_w8_group")
  one = lambda x: quant.einsum("MK,KN->MN", x, w, AMX_W8)  # noqa: E731
  two = lambda x: quant.einsums(["MK,KN->MN"] * 2, x, [w, w], AMX_W8)  # noqa: E731
  x16 = jnp.asarray(rng.standard_normal((16, 64)), jnp.bfloat16)
  assert calls(one, x16) == 1 and calls(two, x16) == 1
  assert calls(one, x16[:2]) == 0 and calls(one, jnp.ones((65, 64), jnp.bfloat16)) == 0
  assert calls(one, x16.astype(jnp.float32)) == 0
  ref = quant.einsum("MK,KN->MN", x16, a, XLA_ONLY)
  assert _rel(np.asarray(jax.jit(one)(x16), np.float32), np.asarray(ref, np.float32)) < 2 ** -7
  a96 = quant.quantize_array(jnp.ones((96, 32), jnp.bfloat16), (0,))
  assert calls(lambda x: quant.einsum("MK,KN->MN", x, quant.tile_array(a96, (0,), quads=True),
                                      AMX_W8), jnp.ones((16, 96), jnp.bfloat16)) == 0


@needs_amx
def test_decode_step_on_amx_w8_equals_xla():
  """A whole decode step of the tiny model with weight-only int8 weights at 24 rows from quad
  copies: every layer matmul on AMX's int8 products against XLA's dots."""
  got, ref, hlo = decode_step_vs_xla(AMX_W8, True, tile=True, int8_quads=True)
  assert hlo.count("phaseserve_amx_w8_group") >= 3 * get_preset("tiny").num_layers
  assert _rel(np.asarray(got, np.float32), np.asarray(ref, np.float32)) < 2 ** -5


@needs_amx
def test_placement_makes_quads_for_int8_weights_where_the_range_is_set():
  from models import weights
  from models.step import UnshardedStep
  cfg = get_preset("tiny")
  params = weights.quantize(jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                                         weights.init_params(cfg, jax.random.key(0))), cfg)
  is_w = lambda w: isinstance(w, (quant.TiledArray, quant.QuantArray))  # noqa: E731
  placed = UnshardedStep(cfg, backend=AMX_W8).place_params(params)
  tiled = [w for w in jax.tree.leaves(placed["layers"], is_leaf=is_w)
           if isinstance(w, quant.TiledArray)]
  assert len(tiled) >= 7 * cfg.num_layers
  assert all(w.tiles.dtype == jnp.int8 and w.tiles.shape[-1] == 64 for w in tiled)
  off = dataclasses.replace(AMX_W8, policy=dataclasses.replace(AMX_W8.policy, amx_w8_max_rows=0))
  assert not any(isinstance(w, quant.TiledArray) for w in jax.tree.leaves(
      UnshardedStep(cfg, backend=off).place_params(params), is_leaf=is_w))
