"""The int8 KV cache (``models.paged_kv`` pools created with dtype int8): per-token, per-head
quantization error, the bytes a page takes, the model over an int8 pool against the float pool,
and the pool sharded and transferred under the partitioning layouts (the host tier and prefix
sharing over int8 pages: tests/serving/test_prefix_cache.py).

Tolerances, relative to the values' magnitude: a dequantized value is within half a quantization
step of the original (``amax / 254`` of its token and head, plus f32 rounding); the tiny random
model's logits over an int8 pool are within 5e-2 * max(1, max |ref|) of the float pool's (each K
and V element moves by at most 0.4% of its row's max); sharded int8 pools against the unsharded
int8 pool 2e-2 (the sharded K/V differ in summation order, which can move a value across a
rounding boundary: one step, 0.8% of its row's max, in a few elements).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import paged_kv as PK, transformer as T
from models.config import get_preset
from models.quant import QuantArray
from models.step import UnshardedStep
from models.weights import init_params
from partitioning import paged_step as PS
from partitioning.mesh import make_mesh, make_submeshes
from serving.kv_pages import page_budget

CFG = get_preset("tiny").replace(num_heads=8, vocab_size=256, max_seq_len=64)


def _close(got, ref, c: float, what: str) -> None:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  err = float(np.max(np.abs(got - ref)))
  bound = c * max(1.0, float(np.max(np.abs(ref))))
  assert err <= bound, f"{what}: max |diff| {err:.3g} > {bound:.3g}"


def test_write_then_read_is_within_half_a_step_per_token_and_head():
  cfg = CFG
  rng = np.random.default_rng(0)
  b, t, z, m = 2, 24, 8, 3
  kv = PK.init_paged(cfg, b, b * m, z, m, jnp.int8).replace(
      page_table=jnp.arange(b * m, dtype=jnp.int32).reshape(b, m))
  assert isinstance(kv.k_pages, QuantArray) and kv.k_pages.quant.dtype == jnp.int8
  assert kv.k_pages.scale.shape == kv.k_pages.shape[:-1] + (1,)
  spread = np.exp(rng.uniform(-6, 6, (b, t, cfg.num_kv_heads, 1)))  # 2.5e-3 .. 4e2 per token
  k = rng.standard_normal((b, t, cfg.num_kv_heads, cfg.head_dim)) * spread
  k[0, 3] = 0.0  # an all-zero token reads back as zeros
  v = -k[:, :, :, ::-1]
  wpos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  kv = kv.write(1, wpos, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32))
  for got, want in zip(kv.read(1, t), (k, v)):
    got = np.asarray(got, np.float64).transpose(0, 2, 1, 3)  # [B, S, K, H]
    half_step = np.max(np.abs(want), axis=-1, keepdims=True) / 254.0
    assert np.all(np.abs(got - want) <= half_step * (1 + 1e-5) + 1e-30)
    assert np.all(got[0, 3] == 0.0)
  untouched = kv.read(0, t)[0]  # layer 0 was never written: scale 0 reads as zeros
  assert float(jnp.max(jnp.abs(untouched))) == 0.0


def test_page_bytes_count_the_scales_and_about_halve_bf16():
  cfg = get_preset("smollm2-135m")
  z = 64
  f32, bf16, i8 = (PK.page_bytes(cfg, z, d) for d in ("float32", "bfloat16", "int8"))
  per = 2 * cfg.num_layers * cfg.num_kv_heads * z
  assert i8 == per * (cfg.head_dim + 4) and bf16 == per * cfg.head_dim * 2
  assert i8 / bf16 == pytest.approx((64 + 4) / 128) and i8 / f32 == pytest.approx(68 / 256)
  # The same byte budget holds about twice the bf16 pages.
  budget = 64 * bf16
  assert page_budget(cfg, "int8", z, budget_bytes=budget).pages_per_shard == budget // i8 >= 120


def _prefill_decode(params, dtype, toks, lens, nxt):
  b, m, z = toks.shape[0], 4, 16
  kv = PK.init_paged(CFG, b, b * m, z, m, dtype).replace(
      page_table=jnp.asarray(np.random.default_rng(5).permutation(b * m).reshape(b, m),
                             jnp.int32))
  l1, kv = T.jit_prefill(params, toks, kv, None, lens, cfg=CFG, attend_len=64)
  l2, kv = T.jit_decode_step(params, nxt, kv, cfg=CFG, attend_len=64)
  return l1, l2


def test_the_model_over_an_int8_pool_is_close_to_the_float_pool():
  params = init_params(CFG, jax.random.key(0), jnp.float32)
  rng = np.random.default_rng(1)
  toks = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 40)), jnp.int32)
  lens = jnp.asarray([40, 17, 3], jnp.int32)
  nxt = jnp.asarray([1, 2, 3], jnp.int32)
  ref = _prefill_decode(params, jnp.float32, toks, lens, nxt)
  got = _prefill_decode(params, jnp.int8, toks, lens, nxt)
  for g, r, what in zip(got, ref, ("prefill", "decode")):
    _close(g, r, 5e-2, f"int8 pool {what} logits")
    assert float(jnp.max(jnp.abs(g - r))) > 0.0  # the int8 pool really is a different cache


@pytest.fixture(scope="module")
def mesh8():
  return make_mesh(jax.devices()[:8])


B, Z, M, NP = 8, 4, 8, 64


def _table() -> np.ndarray:
  rng = np.random.default_rng(0)
  return np.stack([8 * r + rng.permutation(8) for r in range(B)]).astype(np.int32)


def _inputs():
  k = jax.random.split(jax.random.key(1), 2)
  return (jax.random.randint(k[0], (B, 12), 0, CFG.vocab_size),
          jnp.array([12, 5, 0, 12, 7, 1, 12, 3], jnp.int32),
          jax.random.randint(k[1], (B,), 0, CFG.vocab_size),
          jnp.array([1, 1, 0, 1, 1, 1, 0, 1], jnp.int32))


def _run(pre, dec, params_pre, params_dec, kv, between=lambda kv: kv):
  toks, lens, nxt, active = _inputs()
  l1, kv = jax.jit(lambda p, kv: pre.prefill(p, toks, kv, jnp.zeros((B,), jnp.int32), lens,
                                              attend_len=Z * M))(params_pre, kv)
  kv = between(kv)
  l2, kv = jax.jit(lambda p, kv: dec.decode(p, nxt, kv, active, attend_len=Z * M))(params_dec,
                                                                                  kv)
  return l1, l2, kv


def test_sharded_and_disaggregated_int8_pools_match_the_unsharded_int8_pool(mesh8):
  params = init_params(CFG, jax.random.key(0))
  ref_step = UnshardedStep(CFG)
  kv0 = PK.init_paged(CFG, B, NP, Z, M, jnp.int8).replace(page_table=jnp.asarray(_table()))
  ref = _run(ref_step, ref_step, params, params, kv0)
  # One mesh, the pool page-sharded two ways (batch_z) and replicated over the head chips.
  step = PS.PagedShardedStep.make(CFG, mesh8, "ws_2d", "batch_z")
  kv = step.init_kv(B, NP, Z, M, jnp.int8).replace(page_table=jnp.asarray(_table()))
  spec = step.kv_sharding(jnp.int8).k_pages
  assert isinstance(kv.k_pages, QuantArray) and isinstance(spec, QuantArray)
  assert kv.k_pages.scale.sharding.is_equivalent_to(spec.scale, 5)
  p = step.place_params(params)
  got = _run(step, step, p, p, kv)
  for g, r, what in zip(got[:2], ref[:2], ("prefill", "decode")):
    _close(g, r, 2e-2, f"sharded int8 {what}")
  # Disaggregated: prefill on 4 chips, every page moved (values and scales) to the decode chips.
  pre_mesh, dec_mesh = make_submeshes(jax.devices()[:8], 4)
  steps = PS.phase_steps(CFG, pre_mesh, ("ws_2d", "heads"), ("wg_xyz", "batch_xyz"),
                         decode_mesh=dec_mesh)
  p_pre, p_dec = steps.place_params(params)
  kv_pre = steps.prefill.init_kv(B, NP, Z, M, jnp.int8).replace(
      page_table=jnp.asarray(_table()))

  def move(src):
    dst = steps.decode.init_kv(B, NP, Z, M, jnp.int8)
    ids = np.arange(NP, dtype=np.int32)
    dst = PS.transfer_pages(src, dst, ids, ids)
    assert jax.tree.leaves(dst.k_pages)[1].sharding.mesh == dec_mesh
    lengths = jnp.asarray(np.asarray(src.lengths))
    return dst.replace(page_table=jnp.asarray(_table()), lengths=lengths)

  got = _run(steps.prefill, steps.decode, p_pre, p_dec, kv_pre, between=move)
  for g, r, what in zip(got[:2], ref[:2], ("prefill", "decode")):
    _close(g, r, 2e-2, f"disaggregated int8 {what}")
  np.testing.assert_array_equal(got[2].lengths, ref[2].lengths)
