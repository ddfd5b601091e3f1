"""Packed prefill (``serving.engine_calls.packed_call``: a step's chunks end to end, a token a
row) against the rectangular one (``prefill_call``: a row a chunk, padded to the longest) on the
tiny model from the same pool state: the sampled rows' logits agree within a tolerance relative
to their magnitude and every page the chunks write holds the same keys and values; the engine
packs exactly where attention is the native kernel on one kv shard; the packed sizes pad at
most a quarter of a call's tokens (below 64: at most 15)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_preset
from models.step import UnshardedStep
from models.weights import init_params
from serving.engine import Engine, EngineConfig
from serving.engine_calls import packed_call, prefill_call
from serving.engine_shapes import decode_rows, pack, packed, packed_sizes
from serving.step_plan import PrefillChunk
from tests.cpu_policies import NATIVE, needs_kernel

CFG = get_preset("tiny").replace(max_seq_len=128)
SLOTS, PAGE, PAGES_PER_SEQ = 4, 8, 16
RTOL = {"float32": 1e-5, "bfloat16": 1e-2}  # of the largest |logit|: kernels by row count may differ


def _engine(dtype: str, kv_dtype: str) -> Engine:
  params = init_params(CFG, jax.random.key(3), jnp.dtype(dtype))
  engine = Engine(UnshardedStep(CFG, backend=NATIVE), params, EngineConfig(
      max_slots=SLOTS, num_pages=SLOTS * PAGES_PER_SEQ, page_size=PAGE,
      max_seq_tokens=CFG.max_seq_len, kv_dtype=kv_dtype))
  table = np.arange(SLOTS * PAGES_PER_SEQ, dtype=np.int32).reshape(SLOTS, PAGES_PER_SEQ)
  pool = engine.prefill_pool
  pool.kv = pool.kv.replace(page_table=jax.device_put(table, pool.kv.page_table.sharding))
  return engine


def _rect(pool, chunks, t):
  """``prefill_call`` of ``chunks`` [(slot, start, ids)], one row each, padded to ``t``."""
  r = len(chunks)
  toks = np.zeros((r, t), np.int32)
  for i, (_, _, ids) in enumerate(chunks):
    toks[i, :len(ids)] = ids
  slots = np.array([c[0] for c in chunks], np.int32)
  start = np.array([c[1] for c in chunks], np.int32)
  lens = np.array([len(c[2]) for c in chunks], np.int32)
  return prefill_call(pool.params, pool.kv, toks, slots, start, lens, step=pool.step,
                      attend_len=CFG.max_seq_len)


def _packed(pool, chunks, n, rows):
  p = pack([PrefillChunk(f"r{i}", slot, tuple(int(t) for t in ids), start, True)
            for i, (slot, start, ids) in enumerate(chunks)], n, rows, SLOTS)
  return packed_call(pool.params, pool.kv, p.tokens_N, p.slot_N, p.pos_N, p.slots_R, p.end_R,
                     p.last_R, step=pool.step, attend_len=CFG.max_seq_len)


def _pages(kv):
  return [np.asarray(jnp.asarray(a, jnp.float32)) for a in jax.tree.leaves((kv.k_pages, kv.v_pages))]


@needs_kernel
@pytest.mark.parametrize("dtype,kv_dtype", [("float32", "float32"), ("bfloat16", "int8")])
def test_packed_equals_rectangular(dtype, kv_dtype):
  engine = _engine(dtype, kv_dtype)
  assert engine.packed
  pool = engine.prefill_pool
  rng = np.random.default_rng(0)
  ids = lambda k: rng.integers(0, CFG.vocab_size, k).astype(np.int32)
  # Earlier chunks of slots 0 and 2 (the continuation chunks below attend to them).
  pool.kv, _ = _rect(pool, [(0, 0, ids(21)), (2, 0, ids(5))], 32)
  chunks = [(0, 21, ids(13)), (1, 0, ids(30)), (2, 5, ids(1)), (3, 0, ids(7))]
  copy = lambda kv: jax.tree.map(jnp.copy, kv)
  base = copy(pool.kv)  # never donated: each call below runs on a copy of it
  rect_kv, rect_RV = _rect(pool, chunks, 32)
  pool.kv = copy(base)
  pack_kv, pack_RV = _packed(pool, chunks, packed(51), rows=4)
  assert packed(51) == 64
  rect_RV, pack_RV = np.asarray(rect_RV, np.float32), np.asarray(pack_RV, np.float32)
  scale = np.abs(rect_RV).max(axis=1, keepdims=True)
  np.testing.assert_array_less(np.abs(pack_RV - rect_RV),
                                np.broadcast_to(RTOL[dtype] * scale + 1e-30, rect_RV.shape))
  assert np.array_equal(np.asarray(pack_kv.lengths), [34, 30, 6, 7])
  assert np.array_equal(np.asarray(pack_kv.lengths), np.asarray(rect_kv.lengths))
  for a, b in zip(_pages(pack_kv), _pages(rect_kv)):  # [L, P, K, Z, H] (scales [.., 1])
    tol = RTOL[dtype] * max(float(np.abs(b).max()), 1e-30)
    np.testing.assert_array_less(np.abs(a - b), tol + 1e-30)
  # The control: a chunk at the wrong position changes its logits beyond the tolerance.
  pool.kv = copy(base)
  _, moved_RV = _packed(pool, [(0, 20, chunks[0][2])] + chunks[1:], packed(51), rows=4)
  moved_RV = np.asarray(moved_RV, np.float32)
  assert np.abs(moved_RV[0] - rect_RV[0]).max() > 3 * RTOL[dtype] * scale[0, 0]


@needs_kernel
def test_padding_tokens_write_nothing():
  """A packed call of padding only (the warm-up's) changes no page and no length."""
  engine = _engine("float32", "float32")
  pool = engine.prefill_pool
  pool.kv, _ = _rect(pool, [(1, 0, np.arange(9, dtype=np.int32))], 16)
  before = _pages(pool.kv), np.asarray(pool.kv.lengths)
  kv, _ = _packed(pool, [], 32, rows=2)
  after = _pages(kv), np.asarray(kv.lengths)
  assert all(np.array_equal(a, b) for a, b in zip(before[0], after[0]))
  assert np.array_equal(before[1], after[1])


def test_the_engine_packs_only_over_the_native_kernel_on_one_shard():
  params = init_params(CFG, jax.random.key(3), jnp.float32)
  kw = dict(max_slots=4, num_pages=64, page_size=8, max_seq_tokens=CFG.max_seq_len)
  native = NATIVE.paged_attention
  assert Engine(UnshardedStep(CFG, backend=NATIVE), params, EngineConfig(**kw)).packed == native
  assert not Engine(UnshardedStep(CFG), params, EngineConfig(**kw)).packed  # XLA's attention
  sinks = Engine(UnshardedStep(CFG, backend=NATIVE), params, EngineConfig(**kw, sinks=True))
  assert not sinks.packed  # a sink pool's gather path reads whole rows


def test_pack_lays_chunks_end_to_end():
  chunks = [PrefillChunk("a", 2, (5, 6, 7), 10, False), PrefillChunk("b", 0, (8,), 0, True)]
  p = pack(chunks, 16, 4, null_slot=9)
  assert p.tokens_N[:5].tolist() == [5, 6, 7, 8, 0] and p.slot_N[:5].tolist() == [2, 2, 2, 0, 9]
  assert p.pos_N[:5].tolist() == [10, 11, 12, 0, -1] and (p.pos_N[4:] == -1).all()
  assert p.slots_R.tolist() == [2, 0, 9, 9] and p.end_R[:2].tolist() == [13, 1]
  assert p.last_R[:2].tolist() == [2, 3] and p.want_R.tolist() == [False, True, False, False]


def test_packed_sizes_waste_at_most_a_quarter():
  assert packed_sizes(512) == [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384,
                               448, 512]
  for n in range(1, 5000):
    p = packed(n)
    assert p >= n and ((p - n) * 4 <= p or p - n < 16), n
    assert packed(p) == p  # a size is its own bucket
  assert packed_sizes(100) == [16, 32, 48, 64, 80, 96, 112]  # the last covers 100
  assert packed_sizes(40, floor=4) == [4, 8, 16, 32, 48]  # a draft engine's small catch-ups
  assert [packed(n, 4) for n in (1, 4, 5, 9, 17)] == [4, 4, 8, 16, 32]


def test_decode_rows_are_powers_of_two_and_24():
  assert sorted({decode_rows(n, 64) for n in range(1, 65)}) == [1, 2, 4, 8, 16, 24, 32, 64]
  for n in range(1, 300):
    r = decode_rows(n, 1024)
    assert r >= n and (r < 2 * n or r == 1), n
    assert decode_rows(r, 1024) == r  # a size is its own bucket
  assert [decode_rows(n, 64) for n in (16, 17, 24, 25)] == [16, 24, 24, 32]
  assert decode_rows(50, 40) == 40  # never past the slots


@needs_kernel
def test_decode_rows_packed_whatever_the_slots():
  """A decode step over slots {1, 3} runs 2 rows (not ``bucket(max slot + 1)``), and each row's
  greedy id is the one its slot gets decoding alone from the same state."""
  from serving.step_plan import DecodeRow
  engine = _engine("float32", "float32")
  pool = engine.prefill_pool
  rng = np.random.default_rng(1)
  pool.kv, _ = _rect(pool, [(1, 0, rng.integers(0, CFG.vocab_size, 9).astype(np.int32)),
                            (3, 0, rng.integers(0, CFG.vocab_size, 12).astype(np.int32))], 16)
  pool.last_X = jnp.asarray([0, 7, 0, 11], jnp.int32)
  base_kv, base_last = jax.tree.map(jnp.copy, pool.kv), jnp.copy(pool.last_X)

  def decode(rows):
    pool.kv, pool.last_X = jax.tree.map(jnp.copy, base_kv), jnp.copy(base_last)
    part = engine.generate(rows)
    return {rid: int(np.asarray(part.ids)[i]) for rid, i, _ in part.rows}
  both = decode([DecodeRow("a", 1, 9), DecodeRow("b", 3, 12)])
  assert ("decode", 2, CFG.max_seq_len) in engine.program_set.shapes
  assert not any(k[0] == "decode" and k[1] > 2 for k in engine.program_set.shapes)
  assert both == {**decode([DecodeRow("a", 1, 9)]), **decode([DecodeRow("b", 3, 12)])}
