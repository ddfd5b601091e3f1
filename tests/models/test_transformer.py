"""Model invariants: chunked prefill == one-shot, decode step t == full forward at t, causality,
ragged batches, GQA/MHA/parallel-block/GeGLU variants, and the int8 quality gate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_preset
from models.kv_cache import init_cache
from models import transformer as T
from models.weights import init_params, quantize

TINY = get_preset("tiny")
VARIANTS = {
    "mqa": TINY,
    "gqa": TINY.replace(num_kv_heads=2),
    "mha_parallel_geglu": TINY.replace(num_kv_heads=4, parallel_block=True, activation="geglu",
                                       tie_embeddings=True, embed_scale=True, norm_plus_one=True),
}
# f32 tolerances, relative to the values' magnitude: |got - ref| <= c * max(1, max|ref|). Only
# summation order differs between the compared paths (chunked vs one-shot, XLA:CPU kernels with or
# without AMX / YNNPACK / native decode kernels), so c is a few hundred f32 ulps of the largest
# value; stated per comparison below.
C_LOGITS = 2e-5  # logits (chunked prefill / decode vs one-shot forward)
C_CACHE = 1e-5  # K/V cache entries (one-shot vs chunked prefill)
C_SAME = 1e-6  # values that only masked (zero-weight) inputs could change


def assert_close(got, ref, c: float) -> None:
  """``max|got - ref| <= c * max(1, max|ref|)`` (an absolute bound scaled by the magnitude)."""
  got = np.asarray(got, np.float64)
  ref = np.asarray(ref, np.float64)
  assert got.shape == ref.shape, (got.shape, ref.shape)
  err = float(np.max(np.abs(got - ref))) if ref.size else 0.0
  bound = c * max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
  assert err <= bound, f"max |diff| {err:.3g} > {c:g} * max(1, max|ref|) = {bound:.3g}"


def _setup(cfg, b=2, t=24, seed=0):
  params = init_params(cfg, jax.random.key(seed))
  toks = jax.random.randint(jax.random.key(seed + 1), (b, t), 0, cfg.vocab_size)
  return params, toks


@pytest.mark.parametrize("name", list(VARIANTS))
def test_chunked_prefill_and_decode_match_full_forward(name):
  cfg = VARIANTS[name]
  params, toks = _setup(cfg)
  full = T.forward(params, toks, cfg=cfg)
  cache = init_cache(cfg, 2, 64)
  # Chunks of 5 (padded to 8) and 11 (padded to 16): padding must not leak into the cache.
  pieces = [(0, 5), (5, 16)]
  for lo, hi in pieces:
    pad = T.bucket(hi - lo, minimum=8)
    chunk = jnp.zeros((2, pad), jnp.int32).at[:, :hi - lo].set(toks[:, lo:hi])
    logits, cache = T.jit_prefill(params, chunk, cache, None, jnp.full((2,), hi - lo, jnp.int32),
                                  cfg=cfg, attend_len=32)
    assert_close(logits, full[:, hi - 1], C_LOGITS)
  for t in range(16, 24):
    logits, cache = T.jit_decode_step(params, toks[:, t], cache, cfg=cfg, attend_len=32)
    assert_close(logits, full[:, t], C_LOGITS)
  np.testing.assert_array_equal(cache.lengths, [24, 24])


def test_one_shot_prefill_cache_equals_chunked_cache():
  cfg = TINY
  params, toks = _setup(cfg)
  z, full_len = jnp.zeros((2,), jnp.int32), jnp.full((2,), 24, jnp.int32)
  _, c1 = T.prefill(params, toks, init_cache(cfg, 2, 32), z, full_len, cfg=cfg)
  c2 = init_cache(cfg, 2, 32)
  for lo in range(0, 24, 8):
    _, c2 = T.prefill(params, toks[:, lo:lo + 8], c2, None, jnp.full((2,), 8, jnp.int32), cfg=cfg)
  assert_close(c2.k, c1.k, C_CACHE)
  assert_close(c2.v, c1.v, C_CACHE)


def test_causality():
  cfg = TINY
  params, toks = _setup(cfg, b=1, t=16)
  changed = toks.at[0, 10].set((toks[0, 10] + 1) % cfg.vocab_size)
  a, b = T.forward(params, toks, cfg=cfg), T.forward(params, changed, cfg=cfg)
  assert_close(b[:, :10], a[:, :10], C_SAME)
  assert np.abs(np.asarray(a[:, 10:] - b[:, 10:])).max() > 1e-3  # the change is visible later


def test_ragged_batch_rows_are_independent():
  """Rows at different lengths decode exactly as each would alone."""
  cfg = TINY
  params, toks = _setup(cfg, b=2, t=20)
  lens = jnp.array([7, 13], jnp.int32)
  cache = init_cache(cfg, 2, 32)
  _, cache = T.prefill(params, toks[:, :16], cache, jnp.zeros((2,), jnp.int32), lens, cfg=cfg)
  nxt = jnp.stack([toks[0, 7], toks[1, 13]])
  logits, cache = T.decode_step(params, nxt, cache, cfg=cfg)
  for row, n in enumerate([7, 13]):
    alone = T.forward(params, toks[row:row + 1, :n + 1], cfg=cfg)
    assert_close(logits[row], alone[0, n], C_LOGITS)
  np.testing.assert_array_equal(cache.lengths, [8, 14])


def test_inactive_rows_untouched_by_decode():
  cfg = TINY
  params, toks = _setup(cfg, b=2, t=8)
  cache = init_cache(cfg, 2, 16)
  _, cache = T.prefill(params, toks, cache, jnp.zeros((2,), jnp.int32),
                       jnp.full((2,), 8, jnp.int32), cfg=cfg)
  before = np.asarray(cache.k[:, 1]).copy()
  _, cache = T.decode_step(params, toks[:, 0], cache, cfg=cfg, active_B=jnp.array([1, 0]))
  np.testing.assert_array_equal(cache.lengths, [9, 8])
  np.testing.assert_array_equal(cache.k[:, 1], before)


def _kl_and_top1(ref_logits, q_logits):
  p = jax.nn.log_softmax(ref_logits.astype(jnp.float32), -1)
  q = jax.nn.log_softmax(q_logits.astype(jnp.float32), -1)
  kl = jnp.sum(jnp.exp(p) * (p - q), -1)
  top1 = jnp.mean(jnp.argmax(p, -1) == jnp.argmax(q, -1))
  return float(jnp.mean(kl)), float(top1)


# The int8 quality gate. Config between tiny and small so the check is meaningful yet quick.
GATE_CFG = TINY.replace(vocab_size=2048, embed_dim=256, num_layers=4, num_heads=8, head_dim=32,
                        mlp_dim=768)
KL_MAX = {"weight_only": 0.002, "w8a8": 0.005}
TOP1_MIN = {"weight_only": 0.95, "w8a8": 0.93}


@pytest.mark.parametrize("mode", ["weight_only", "w8a8"])
def test_int8_quality_gate(mode):
  cfg = GATE_CFG
  params, toks = _setup(cfg, b=4, t=64, seed=3)
  ref = T.forward(params, toks, cfg=cfg)
  q = quantize(params, cfg, act_quant=(mode == "w8a8"))
  kl, top1 = _kl_and_top1(ref, T.forward(q, toks, cfg=cfg))
  print(f"int8 {mode}: KL={kl:.5f} top1={top1:.4f}")
  assert kl < KL_MAX[mode] and top1 >= TOP1_MIN[mode], (kl, top1)
