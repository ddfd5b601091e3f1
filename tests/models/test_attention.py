"""attention.attend: the blocked online-softmax path (long key ranges) equals the one-block path
and a plain reference, for ragged positions, GQA/MQA, and the full model's chunked prefill."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention as A
from models import transformer as T
from models.config import get_preset
from models.kv_cache import init_cache
from models.weights import init_params


# Relative f32 tolerance: |got - ref| <= C * max(1, max|ref|); the blocked / one-block / reference
# paths differ only in summation order (online softmax, XLA:CPU kernels with or without AMX).
C = 2e-5


def assert_close(got, ref, c: float = C) -> None:
  got = np.asarray(got, np.float64)
  ref = np.asarray(ref, np.float64)
  assert got.shape == ref.shape, (got.shape, ref.shape)
  err = float(np.max(np.abs(got - ref)))
  bound = c * max(1.0, float(np.max(np.abs(ref))))
  assert err <= bound, f"max |diff| {err:.3g} > {c:g} * max(1, max|ref|) = {bound:.3g}"


def _reference(q, k, v, pos):
  b, t, n, h = q.shape
  kh = k.shape[1]
  kk = jnp.repeat(k, n // kh, axis=1)  # [B, N, S, H]
  vv = jnp.repeat(v, n // kh, axis=1)
  logits = jnp.einsum("btnh,bnsh->bnts", q, kk) * h ** -0.5
  mask = jnp.arange(k.shape[2])[None, None, :] <= pos[:, :, None]
  logits = jnp.where(mask[:, None], logits, -jnp.inf)
  return jnp.einsum("bnts,bnsh->btnh", jax.nn.softmax(logits, -1), vv)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("t,s,qb,kb", [(1, 40, 8, 16), (9, 40, 4, 16), (24, 64, 8, 8),
                                       (5, 50, 256, 16)])
def test_blocked_attention_matches_reference(monkeypatch, kv_heads, t, s, qb, kb):
  b, n, h = 3, 4, 16
  ks = jax.random.split(jax.random.key(t * s), 4)
  q = jax.random.normal(ks[0], (b, t, n, h))
  k = jax.random.normal(ks[1], (b, kv_heads, s, h))
  v = jax.random.normal(ks[2], (b, kv_heads, s, h))
  start = jnp.array([0, 7, s - t])  # ragged rows, one ending at the last cache position
  pos = start[:, None] + jnp.arange(t)[None]
  ref = _reference(q, k, v, pos)
  one = A.attend(q, k, v, pos)  # s <= KEY_BLOCK: one block
  monkeypatch.setattr(A, "QUERY_BLOCK", qb)
  monkeypatch.setattr(A, "KEY_BLOCK", kb)
  blocked = jax.jit(A.attend)(q, k, v, pos)
  assert_close(one, ref)
  assert_close(blocked, ref)


def test_model_chunked_prefill_with_small_blocks(monkeypatch):
  """The whole model through the blocked path: chunks + decode == one full forward."""
  monkeypatch.setattr(A, "QUERY_BLOCK", 8)
  monkeypatch.setattr(A, "KEY_BLOCK", 8)
  cfg = get_preset("tiny")
  params = init_params(cfg, jax.random.key(0))
  toks = jax.random.randint(jax.random.key(1), (2, 30), 0, cfg.vocab_size)
  full = T.forward(params, toks, cfg=cfg)
  cache = init_cache(cfg, 2, 64)
  logits, cache = T.prefill(params, toks[:, :13], cache, jnp.zeros((2,), jnp.int32),
                            jnp.full((2,), 13, jnp.int32), cfg=cfg, attend_len=64)
  assert_close(logits, full[:, 12])
  logits, cache = T.prefill(params, toks[:, 13:27], cache, None, jnp.full((2,), 14, jnp.int32),
                            cfg=cfg, attend_len=32)
  assert_close(logits, full[:, 26])
  for i in range(27, 30):
    logits, cache = T.decode_step(params, toks[:, i], cache, cfg=cfg, attend_len=64)
    assert_close(logits, full[:, i])
