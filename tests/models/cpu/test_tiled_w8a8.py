"""The W8A8 tiled kernel (``cpu_kernels.matmul_tiled_w8a8_group`` on ``tile_weight_w8a8`` copies
of W8A8 weights, AVX512-VNNI) and how ``models.quant`` routes W8A8 ``TiledArray`` weights to it:
the layout index by index, products against a numpy reference of the same per-row quantization
(exact integer sums) off every boundary (rows across the 8- and 16-lane vectors, K off the quads,
columns off the 16-column tiles, several weights split over threads), the routing rules, the
start-up race, and a whole W8A8 decode step on tiled params against XLA's int8 dots. Skipped
where the CPU lacks ``avx512_vnni`` (there the backend never has the kernel and no copy is
made)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import quant, weights
from models.config import get_preset
from models.cpu import kernels as cpu_kernels
from models.step import UnshardedStep
from tests.cpu_policies import NATIVE, XLA_ONLY

needs_vnni = pytest.mark.skipif(not cpu_kernels.tiled_w8a8_available(),
                                reason="no avx512_vnni on this CPU")
TILED = dataclasses.replace(NATIVE, amx=False, dpbf16=False, tiled=False, tiled_w8a8=True,
                            policy=dataclasses.replace(NATIVE.policy, tiled_w8a8_min_rows=2,
                                                       tiled_w8a8_max_rows=96))
TARGET = "phaseserve_tiled_w8a8_group"


def _calls(fn, *args) -> int:
  return jax.jit(fn).lower(*args).compile().as_text().count(TARGET)


def _quantized_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """numpy's per-row int8 quantization, as the kernel's contract states it (f32 division,
  round half to even, [-127, 127])."""
  x = x.astype(np.float32)
  amax = np.max(np.abs(x), axis=1, keepdims=True)
  scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
  return np.clip(np.rint(x / scale), -127, 127).astype(np.int64), scale


def test_tile_layout_index_by_index():
  k, n = 7, 19  # K off the quads (a zero-weight row pads the last quad), N past one tile
  w = (jnp.arange(k * n, dtype=jnp.int32) % 255 - 127).astype(jnp.int8).reshape(k, n)
  t = np.asarray(cpu_kernels.tile_weight_w8a8(w))
  assert t.shape == (2, 2, 64) and t.dtype == np.uint8
  wn = np.asarray(w, np.int32)
  for ti in range(2):
    for q in range(2):
      for c in range(16):
        for j in range(4):
          row, col = 4 * q + j, 16 * ti + c
          want = (wn[row, col] if row < k and col < n else 0) + 128
          assert t[ti, q, 4 * c + j] == want, (ti, q, c, j)


@needs_vnni
@pytest.mark.parametrize("xdtype,m,k,ns", [
    ("float32", 1, 7, (5,)), ("bfloat16", 3, 33, (17, 40)), ("float32", 8, 64, (16,)),
    ("bfloat16", 9, 576, (576, 192, 192)), ("float32", 16, 101, (33,)),
    ("bfloat16", 17, 1536, (576,)), ("bfloat16", 40, 66, (100, 3)),
    ("float32", 97, 30, (2000,))])
def test_group_equals_the_quantized_products(xdtype, m, k, ns):
  rng = np.random.default_rng(m + k)
  x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1)), xdtype)
  x.at[0].set(0)  # an all-zero row: scale 1
  ws = [jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8) for n in ns]
  got = jax.jit(lambda x, ts: cpu_kernels.matmul_tiled_w8a8_group(x, ts, ns))(
      x, [cpu_kernels.tile_weight_w8a8(w) for w in ws])
  xq, scale = _quantized_rows(np.asarray(x, np.float32))
  assert [g.shape for g in got] == [(m, n) for n in ns]
  for g, w in zip(got, ws):
    ref = (xq @ np.asarray(w, np.int64)).astype(np.float32) * scale  # exact integer sums
    np.testing.assert_allclose(np.asarray(g), ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@needs_vnni
def test_refuses_bad_operands():
  x = jnp.ones((4, 8), jnp.bfloat16)
  t = cpu_kernels.tile_weight_w8a8(jnp.ones((8, 20), jnp.int8))  # [2, 2, 64]
  with pytest.raises(ValueError, match="matmul_tiled_w8a8_group"):
    cpu_kernels.matmul_tiled_w8a8_group(x.astype(jnp.int32), [t], [20])
  with pytest.raises(ValueError, match="matmul_tiled_w8a8_group"):
    cpu_kernels.matmul_tiled_w8a8_group(x, [t], [40])  # 40 columns are 3 tiles
  with pytest.raises(ValueError, match="matmul_tiled_w8a8_group"):
    cpu_kernels.matmul_tiled_w8a8_group(jnp.ones((4, 12), jnp.bfloat16), [t], [20])
  with pytest.raises(ValueError, match="tile_weight_w8a8"):
    cpu_kernels.tile_weight_w8a8(jnp.ones((8, 20), jnp.bfloat16))
  f32 = jax.ShapeDtypeStruct((4, 20), jnp.float32)
  with pytest.raises(Exception, match="phaseserve_tiled_w8a8_group: want"):
    jax.ffi.ffi_call(TARGET, [f32])(x, t[:, :1])


def _w8a8(rng, *shape, axes=(0,)):
  a = jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.float32)
  return quant.quantize_array(a, axes, act_quant=True)


@needs_vnni
@pytest.mark.parametrize("rows", [1, 3, 24, 97])
def test_einsums_equal_xla(rows):
  rng = np.random.default_rng(rows)
  stored = [_w8a8(rng, 64, 4, 16), _w8a8(rng, 64, 1, 16), _w8a8(rng, 64, 1, 16),
            _w8a8(rng, 4, 16, 64, axes=(0, 1))]
  tiled = [quant.tile_array(w, (0,)) for w in stored[:3]] + [
      quant.tile_array(stored[3], (0, 1))]
  x = jnp.asarray(rng.standard_normal((rows, 1, 64)), jnp.bfloat16)
  a = jnp.asarray(rng.standard_normal((rows, 1, 4, 16)), jnp.bfloat16)
  specs = ["BTD,DNH->BTNH"] * 3

  def make(ws, b):
    return lambda x, a: quant.einsums(specs, x, ws[:3], b) + [
        quant.einsum("BTNH,NHD->BTD", a, ws[3], b)]

  ref = jax.jit(make(stored, XLA_ONLY))(x, a)
  got = jax.jit(make(tiled, TILED))(x, a)
  # In the range: one grouped call for q / k / v and one for o; else none.
  assert _calls(make(tiled, TILED), x, a) == (2 if 2 <= rows <= 96 else 0)
  for g, r in zip(got, ref):
    assert g.dtype == jnp.bfloat16 and g.shape == r.shape
    # The same quantized values and exact integer sums; the results rounded once to bf16 (an
    # activation rounded the other way by XLA's division moves a sum by one step of it).
    scale = float(jnp.max(jnp.abs(r.astype(jnp.float32))))
    assert float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32)))) < 2 ** -6 * scale


@needs_vnni
def test_routing_rules():
  rng = np.random.default_rng(0)
  w = _w8a8(rng, 64, 32)
  tw = quant.tile_array(w, (0,))
  assert tw.tiles.dtype == jnp.uint8
  x16 = jnp.ones((16, 64), jnp.bfloat16)
  mm = lambda w, b=TILED: (lambda x: quant.einsum("MK,KN->MN", x, w, b))  # noqa: E731
  assert _calls(mm(tw), x16) == 1
  assert _calls(mm(tw), x16.astype(jnp.float32)) == 1  # f32 activations too
  # Not: the stored weight, rows out of range, a backend without the kernel, a weight-only copy.
  assert _calls(mm(w), x16) == 0
  assert _calls(mm(tw), x16[:1]) == 0
  assert _calls(mm(tw, dataclasses.replace(TILED, tiled_w8a8=False)), x16) == 0
  wo = quant.tile_array(w.replace(act_quant=False), (0,))
  assert wo.tiles.dtype == jnp.int8 and _calls(mm(wo), x16) == 0


def test_tile_params_and_the_step_copy_w8a8_weights_for_the_vnni_kernel():
  cfg = get_preset("tiny")
  params = weights.quantize(weights.init_params(cfg, jax.random.key(0)), cfg, act_quant=True)
  tiled = weights.tile_params(params, cfg, pairs=False)
  assert tiled["layers"][0]["gate"].tiles.dtype == jnp.uint8
  assert isinstance(tiled["layers"][0]["gate"].array, quant.QuantArray)
  is_tiled = lambda p: isinstance(p["layers"][0]["q"], quant.TiledArray)  # noqa: E731
  assert is_tiled(UnshardedStep(cfg, backend=TILED).place_params(params))
  assert not is_tiled(UnshardedStep(cfg, backend=dataclasses.replace(
      TILED, tiled_w8a8=False)).place_params(params))


@needs_vnni
def test_decode_step_equals_xla():
  """A whole W8A8 decode step of the tiny model at 24 rows (bf16 activations) on tiled params,
  layers stacked (one scanned layer: the vmapped tiling), against the stored weights under XLA's
  int8 dots (unrolled layers' calls: test_einsums_equal_xla)."""
  from models.kv_cache import init_cache
  from models.transformer import decode_step
  cfg = get_preset("tiny")
  f32 = weights.init_params(cfg, jax.random.key(0))
  params = weights.quantize(f32, cfg, act_quant=True)
  params["final_norm"] = params["final_norm"].astype(jnp.bfloat16)  # bf16 activations
  for layer in params["layers"]:
    for name in ("attn_norm", "mlp_norm"):
      layer[name] = layer[name].astype(jnp.bfloat16)
  params = weights.stack_layers(params)
  tiled = weights.tile_params(params, cfg, pairs=False)
  toks = jax.random.randint(jax.random.key(1), (24,), 0, cfg.vocab_size)
  cache = init_cache(cfg, 24, 32, jnp.bfloat16).replace(lengths=jnp.full((24,), 5, jnp.int32))
  run = lambda p, b: jax.jit(  # noqa: E731
      lambda p, t, c: decode_step(p, t, c, cfg=cfg, attend_len=32, backend=b)[0])
  got = run(tiled, TILED)(tiled, toks, cache)
  ref = run(params, XLA_ONLY)(params, toks, cache)
  hlo = run(tiled, TILED).lower(tiled, toks, cache).compile().as_text()
  assert hlo.count(TARGET) >= 4 + 1  # q / k / v, o, gate / up, down in the scan; the unembedding
  scale = float(jnp.max(jnp.abs(ref)))
  assert float(jnp.max(jnp.abs(got - ref))) < 2 ** -5 * scale


@needs_vnni
def test_start_up_race_records_every_row_count():
  from models.cpu import lowering_kernels
  meas: dict = {}
  rows = (1, 16)
  lo, hi = lowering_kernels.measure_tiled_w8a8(meas, 1, 64, 128, 4 * 64 * 128, 8, False, 8,
                                               rows=rows)
  assert {f"tiled_w8a8_{m}rows" for m in rows} == set(meas)
  assert all(set(v) == {"tiled", "incumbent"} and min(v.values()) > 0 for v in meas.values())
  assert (lo, hi) == (0, 0) or (lo in rows and hi in rows and lo <= hi)
