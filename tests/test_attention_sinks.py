"""Attention sinks (StreamingLLM) over a raw-key paged pool: a stream 8x the window runs with a
fixed page table (the window's pages are a ring), stays finite, and its logits equal, token by
token, a plain-JAX reference of the same cache policy written from the paper's description:
keep the first ``sinks`` tokens and the last ``window``, store keys before RoPE, rotate them by
their index in the kept list (the query by its own index, the last). Also: attention with
explicit key positions against a dense masked softmax, a fully hidden key block, and a control
(the reference with another policy differs beyond the tolerance).

Tolerance (the pool in f32, the reference in float64 numpy): ``max |got - ref| <= 1e-4 *
max(1, max |ref|)`` per step; the two differ in precision, summation order and in where the
rotation happens (the same angles).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention, paged_kv as PK, transformer as T
from models.config import get_preset
from models.weights import init_params

CFG = get_preset("tiny").replace(num_kv_heads=2)
TOL = 1e-4


def _close(got, ref, what):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  err = float(np.max(np.abs(got - ref)))
  bound = TOL * max(1.0, float(np.max(np.abs(ref))))
  assert err <= bound, f"{what}: max |diff| {err:.3g} > {bound:.3g}"


def _np_rope(x, pos, theta):
  """x [..., n, H] rotated pairs (i, i + H/2) by pos [n] (float64)."""
  h = x.shape[-1]
  inv = theta ** (-np.arange(0, h, 2, dtype=np.float64) / h)
  ang = pos[:, None] * inv  # [n, H/2]
  shape = (1,) * (x.ndim - 2) + ang.shape
  cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
  x1, x2 = x[..., : h // 2], x[..., h // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _np_norm(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def reference_stream(params, cfg, tokens, sinks: int, window: int) -> np.ndarray:
  """[len(tokens), V] logits in float64 numpy, one token at a time over a contiguous kept list
  per layer: the kept keys (stored raw) rotated by their index in it, the query by its own."""
  assert cfg.activation == "swiglu" and not (cfg.parallel_block or cfg.embed_scale
                                             or cfg.norm_plus_one or cfg.tie_embeddings)
  f64 = lambda a: np.asarray(a, np.float64)
  layers = [{k: f64(v) for k, v in layer.items()} for layer in params["layers"]]
  embed, unembed, final = f64(params["embed"]), f64(params["unembed"]), f64(params["final_norm"])
  g = cfg.num_heads // cfg.num_kv_heads
  kept = [[] for _ in layers]  # per layer: [(absolute position, raw k [K, H], v [K, H])]
  out = []
  for t, tok in enumerate(tokens):
    x = embed[tok]  # [D]
    for l, w in enumerate(layers):
      h = _np_norm(x, w["attn_norm"], cfg.norm_eps)
      q = np.einsum("d,dnh->nh", h, w["q"])
      kept[l].append((t, np.einsum("d,dkh->kh", h, w["k"]), np.einsum("d,dkh->kh", h, w["v"])))
      if window:
        kept[l] = [e for e in kept[l] if e[0] < sinks or e[0] > t - window]
      n = len(kept[l])
      ks = _np_rope(np.stack([e[1] for e in kept[l]]).transpose(1, 0, 2),  # [K, n, H]
                    np.arange(n, dtype=np.float64), cfg.rope_theta)
      vs = np.stack([e[2] for e in kept[l]]).transpose(1, 0, 2)
      qr = _np_rope(q[:, None, :], np.asarray([n - 1.0]), cfg.rope_theta)[:, 0]  # [N, H]
      logits = np.einsum("nh,nsh->ns", qr, np.repeat(ks, g, axis=0)) / np.sqrt(cfg.head_dim)
      p = np.exp(logits - logits.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      att = np.einsum("ns,nsh->nh", p, np.repeat(vs, g, axis=0))
      x = x + np.einsum("nh,nhd->d", att, w["o"])
      hm = _np_norm(x, w["mlp_norm"], cfg.norm_eps)
      gate, up = hm @ w["gate"], hm @ w["up"]
      x = x + (gate / (1 + np.exp(-gate)) * up) @ w["down"]
    out.append(_np_norm(x, final, cfg.norm_eps) @ unembed)
  return np.stack(out)


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(3), jnp.float32)


Z, M = 4, 5  # ring of 4 pages (16 positions) beside the sink page: a window of 12 fits
SINKS, WINDOW, PROMPT, STREAM = 4, 12, 10, 96  # 8x the window


@pytest.fixture(scope="module")
def stream(params):
  """Rows: sinks 4 + window 12, and window 12 alone; teacher-forced over the same ids."""
  rng = np.random.default_rng(0)
  ids = rng.integers(0, CFG.vocab_size, (2, STREAM)).astype(np.int32)
  ids[1] = ids[0]
  b = 2
  kv = PK.init_paged(CFG, b, b * M + 1, Z, M, jnp.float32, raw_keys=True)
  kv = kv.replace(page_table=jnp.arange(b * M, dtype=jnp.int32).reshape(b, M),
                  sinks=jnp.asarray([SINKS, 0], jnp.int32),
                  window=jnp.asarray([WINDOW, WINDOW], jnp.int32))
  prefill = jax.jit(lambda p, t, kv: T.prefill(p, t, kv, None, jnp.full((b,), PROMPT),
                                               cfg=CFG, attend_len=M * Z, all_logits=True))
  decode = jax.jit(lambda p, t, kv: T.decode_step(p, t, kv, cfg=CFG, attend_len=M * Z))
  logits, kv = prefill(params, jnp.asarray(ids[:, :PROMPT]), kv)
  steps = [np.asarray(logits)]
  for i in range(PROMPT, STREAM):
    lg, kv = decode(params, jnp.asarray(ids[:, i]), kv)
    steps.append(np.asarray(lg)[:, None])
  return ids, np.concatenate(steps, axis=1), kv  # logits [B, STREAM, V]


def test_a_stream_8x_the_window_is_bounded_finite_and_equals_the_reference(params, stream):
  ids, got, kv = stream
  assert np.all(np.isfinite(got))
  assert int(kv.lengths[0]) == STREAM and kv.page_table.shape == (2, M)  # table never grows
  # Nothing landed outside each row's M pages: the spare page is still zeros.
  assert float(jnp.max(jnp.abs(kv.k_pages[:, 2 * M]))) == 0.0
  for row, sinks in ((0, SINKS), (1, 0)):
    ref = reference_stream(params, CFG, ids[row].tolist(), sinks, WINDOW)
    for t in range(STREAM):
      _close(got[row, t], ref[t], f"row {row} (sinks {sinks}) step {t}")


def test_control_another_policy_differs(params, stream):
  ids, got, _ = stream
  ref = reference_stream(params, CFG, ids[0, :40].tolist(), 0, WINDOW)  # sinks dropped
  err = np.max(np.abs(got[0, :40] - ref))
  assert err > 100 * TOL * max(1.0, float(np.max(np.abs(ref))))


def test_full_attention_rows_of_a_raw_pool_equal_the_rotated_pool(params):
  """Window 0 on a raw-key pool is plain causal attention: the same logits as storing keys
  rotated (the default pool), for a ragged prefill then decode."""
  rng = np.random.default_rng(1)
  toks = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 24)), jnp.int32)
  lens = jnp.asarray([24, 9], jnp.int32)
  out = {}
  for raw in (False, True):
    kv = PK.init_paged(CFG, 2, 16, 4, 8, jnp.float32, raw_keys=raw).replace(
        page_table=jnp.arange(16, dtype=jnp.int32).reshape(2, 8))
    l1, kv = T.jit_prefill(params, toks, kv, None, lens, cfg=CFG, attend_len=32)
    l2, _ = T.jit_decode_step(params, toks[:, 0], kv, cfg=CFG, attend_len=32)
    out[raw] = (l1, l2)
  for g, r in zip(out[True], out[False]):
    _close(g, r, "raw-key pool, full attention")


def test_explicit_key_positions_equal_a_dense_masked_softmax():
  """Keys in scrambled order with holes, sinks and windows per row, 600 keys (the online
  softmax over two key blocks); one row sees a block of only hidden keys first."""
  rng = np.random.default_rng(2)
  b, t, n, kh, h, s = 3, 2, 4, 2, 16, 600
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, kh, s, h)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, kh, s, h)), jnp.float32)
  kpos = np.stack([rng.permutation(s) for _ in range(b)]).astype(np.int32)
  kpos[0, :300] = -1  # no key in row 0's first block
  kpos[1, ::7] = -1
  qpos = np.asarray([[598, 599], [300, 301], [10, 11]], np.int32)
  sinks, window = np.asarray([4, 0, 2], np.int32), np.asarray([50, 100, 0], np.int32)
  keys = attention.KeyPositions(jnp.asarray(kpos), jnp.asarray(sinks), jnp.asarray(window))
  got = attention.attend(q, k, v, jnp.asarray(qpos), keys)
  vis = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= qpos[:, :, None]) & (
      (window[:, None, None] == 0) | (kpos[:, None, :] < sinks[:, None, None])
      | (kpos[:, None, :] > qpos[:, :, None] - window[:, None, None]))  # [B, T, S]
  g = n // kh
  kq = np.repeat(np.asarray(k), g, axis=1)  # [B, N, S, H]
  vq = np.repeat(np.asarray(v), g, axis=1)
  logits = np.einsum("btnh,bnsh->btns", np.asarray(q), kq) / np.sqrt(h)
  logits = np.where(vis[:, :, None, :], logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  ref = np.einsum("btns,bnsh->btnh", w, vq)
  _close(got, ref, "explicit key positions")
  none = attention.KeyPositions(jnp.full((b, s), -1, jnp.int32), keys.sinks_B, keys.window_B)
  assert float(jnp.max(jnp.abs(attention.attend(q, k, v, jnp.asarray(qpos), none)))) == 0.0
