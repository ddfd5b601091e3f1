"""The paged attention's AMX block path (``amx_blocks``, ``native/attention_blocks.h``): the plan
(which rows form blocks), and prefill chunks through it against an f64 reference and against the
row path: chunks from position 0, mid-page and ending at the table's end, lengths off the
16-row block (1, 3, 5, 16, 17, 40), grouped and multiquery heads, head sizes 64 and 128, pages
of 32 and 64, a null table entry inside the visible range, ``max_keys`` below the chunk's end,
and NaN in every key and value past the chunk's last one (a reused page's stale values).

Tolerance, relative to ``max(1, max|ref|)``: 2e-2, the bf16 dot path's (q and the probabilities
rounded to bf16: one rounding step is 2^-8 relative; the row path has the same bound).
Skipped where the CPU has no AMX (the AMD EPYC machines), where the path is never taken."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import paged_kv as PK
from models.cpu import kernels as cpu_kernels, paged_attention as cpa
from tests.cpu_policies import NATIVE

needs_amx = pytest.mark.skipif(
    not (cpa.available() and cpa.bf16_dot_supported() and cpu_kernels.amx_available()),
    reason="no AMX (or no native paged attention) on this CPU")
TOL = 2e-2


def _reference(q_TNH, k_PKZH, v_PKZH, table_M, pos_T, max_keys):
  """f64 softmax attention of each query (scaled by H ** -0.5, rounded to bf16 as the kernel
  path does) over keys ``s < min(pos + 1, max_keys)`` read through the table (null: zeros)."""
  t, n, h = q_TNH.shape
  p, kh, z, _ = k_PKZH.shape
  g = n // kh
  q = np.asarray(jnp.asarray(np.asarray(q_TNH, np.float32) * h ** -0.5, jnp.bfloat16),
                 np.float64)
  keys = np.zeros((len(table_M) * z, kh, h))
  vals = np.zeros((len(table_M) * z, kh, h))
  for m, page in enumerate(table_M):
    if 0 <= page < p:
      keys[m * z:(m + 1) * z] = np.asarray(k_PKZH[page], np.float64).transpose(1, 0, 2)
      vals[m * z:(m + 1) * z] = np.asarray(v_PKZH[page], np.float64).transpose(1, 0, 2)
  out = np.zeros((t, n, h))
  for i in range(t):
    s_end = min(int(pos_T[i]) + 1, max_keys)
    for head in range(n):
      c = head // g
      logits = keys[:s_end, c] @ q[i, head]
      w = np.exp(logits - logits.max())
      out[i, head] = (w / w.sum()) @ vals[:s_end, c]
  return out


def _chunk(rng, t, start, n, kh, h, z, m=8):
  """One sequence's chunk of ``t`` tokens from ``start``; pages with NaN past its last key."""
  layers, p = 2, m + 4
  k = rng.standard_normal((layers, p, kh, z, h)).astype(np.float32)
  v = rng.standard_normal((layers, p, kh, z, h)).astype(np.float32)
  table = rng.permutation(p)[:m].astype(np.int32)
  table[1] = p + 5  # a null entry: reads as zeros
  for s in range(start + t, m * z):
    page = table[s // z]
    if page < p:
      k[:, page, :, s % z] = np.nan
      v[:, page, :, s % z] = np.nan
  q = rng.standard_normal((1, t, n, h)).astype(np.float32)
  pos = (start + np.arange(t, dtype=np.int32))[None]
  return q, k, v, table, pos


@needs_amx
def test_the_plan_blocks_consecutive_rows_of_one_table():
  t = np.zeros((44, 3), np.int32)
  t[20:] = 1
  pos = np.r_[np.arange(5, 25), np.arange(0, 3), -1, np.arange(7, 27)].astype(np.int32)
  got = cpa.block_rows(pos, t)
  # 16 rows, then the 4 left of that table (a block: >= 4 rows); a new table at row 20 with 3
  # rows (each alone), padding (-1: alone), then 20 rows: 16 + 4.
  want = np.zeros(44, np.int64)
  want[[0, 16, 20, 21, 22, 23, 24, 40]] = [16, 4, 1, 1, 1, 1, 16, 4]
  np.testing.assert_array_equal(got, want)
  # Decode rows (one token each of different sequences) never form blocks.
  rows = np.arange(8, dtype=np.int32)[:, None].repeat(3, 1)
  np.testing.assert_array_equal(cpa.block_rows(np.full(8, 30, np.int32), rows), np.ones(8))
  # A gap in the positions ends a block.
  gap = np.r_[np.arange(0, 6), np.arange(7, 13)].astype(np.int32)
  np.testing.assert_array_equal(cpa.block_rows(gap, np.zeros((12, 2), np.int32))[[0, 6]], [6, 6])


@needs_amx
@pytest.mark.parametrize("t,start,n,kh,h,z", [
    (16, 0, 9, 3, 64, 64), (40, 70, 9, 3, 64, 64), (17, 100, 4, 1, 64, 64),
    (5, 30, 2, 2, 128, 32), (3, 10, 9, 3, 64, 64), (1, 50, 9, 3, 64, 64),
    (24, 8 * 64 - 24, 6, 3, 64, 64)])
def test_a_chunk_through_blocks_equals_the_reference(t, start, n, kh, h, z):
  rng = np.random.default_rng(t * 1000 + start)
  q, k, v, table, pos = _chunk(rng, t, start, n, kh, h, z)
  kb, vb = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
  qb = jnp.asarray(q, jnp.bfloat16)
  cap = table.shape[0] * z
  assert (cpa.block_rows(np.repeat(pos[0][None], 1, 0)[0], np.repeat(table[None], t, 0)).max()
          == (t if 4 <= t <= 16 else 16 if t > 16 else 1))
  for layer in (0, 1):
    for max_keys in (cap, start + t // 2 + 1):
      ref = _reference(q[0], np.asarray(kb[layer], np.float64), np.asarray(vb[layer], np.float64),
                       table, pos[0], max_keys)
      outs = {}
      for amx in (True, False):
        fn = jax.jit(lambda q, k, v, amx=amx, mk=max_keys: cpa.attend_paged(
            q, k, v, jnp.asarray(table)[None], jnp.asarray(pos), layer, mk, True, True, amx))
        outs[amx] = np.asarray(fn(qb, kb, vb), np.float64)[0]
        assert np.isfinite(outs[amx]).all()
        err = np.max(np.abs(outs[amx] - ref))
        assert err <= TOL * max(1.0, np.max(np.abs(ref))), (amx, layer, max_keys, err)


@needs_amx
def test_the_engine_prefill_takes_blocks_and_matches_the_row_path():
  """``PagedKV.attend`` passes ``amx_blocks`` where the backend has AMX and its policy chose the
  blocks: a two-sequence chunk (rows of unequal starts) gives the row path's outputs within
  the tolerance, and the compiled call carries the switch."""
  rng = np.random.default_rng(7)
  b, t, n, kh, h, z, m = 2, 20, 9, 3, 64, 64, 4
  p = b * m + 2
  k = jnp.asarray(rng.standard_normal((2, p, kh, z, h)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((2, p, kh, z, h)), jnp.bfloat16)
  table = jnp.asarray(rng.permutation(p)[:b * m].reshape(b, m), jnp.int32)
  start = np.asarray([0, 37], np.int32)
  pos_BT = jnp.asarray(start[:, None] + np.arange(t)[None], jnp.int32)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)) * 0.5, jnp.bfloat16)
  native = dataclasses.replace(NATIVE, paged_bf16_dot=True, amx=True, policy=dataclasses.replace(
      NATIVE.policy, attention_amx_blocks=True))
  outs = []
  for backend in (native, dataclasses.replace(native, amx=False)):
    kv = PK.PagedKV(k_pages=k, v_pages=v, page_table=table, lengths=jnp.asarray(start),
                    backend=backend)
    assert kv.native_attention(n, t)
    fn = jax.jit(kv.attend, static_argnums=(0, 3))
    hlo = fn.lower(1, q, pos_BT, m * z).as_text()
    assert ("amx_blocks = 1" in hlo) == backend.amx, hlo[-2000:]
    outs.append(np.asarray(fn(1, q, pos_BT, m * z), np.float64))
  ref = outs[1]
  assert np.max(np.abs(outs[0] - ref)) <= TOL * max(1.0, np.max(np.abs(ref)))
