"""models.paged_kv through models.transformer: paged prefill (chunked, ragged, pages scattered over
the pool) and decode equal the contiguous KVCache (logits and KV contents), for float and int8
weights; padding and unbacked positions write nothing; a row at its page capacity is stopped by
the allocator and cannot write outside its pages; a fork's copy-on-write page decodes correctly.

Tolerance (f32): ``max|paged - contiguous| <= 1e-5 * max(1, max|contiguous|)``. Paged prefill
gathers the same values into the same [B, K, S, H] shape and runs the same arithmetic; paged
decode (a pool made for the native backend) runs ``models.cpu.paged_attention`` (the same products summed in another
order, page by page), so the decode logits differ by rounding only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import paged_kv as PK
from models import transformer as T
from models.config import get_preset
from models.cpu.backend import CpuBackend
from models.kv_cache import init_cache
from models.weights import init_params, quantize
from serving.kv_pages import PageBudget, PagePool
from tests.cpu_policies import NATIVE

CFG = get_preset("tiny").replace(num_kv_heads=2)  # GQA: K > 1 exercises the [B,M,K,Z,H] swap
C_PAGED = 1e-5
PARAMS = init_params(CFG, jax.random.key(0))


def assert_close(got, ref, c: float = C_PAGED) -> None:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  assert got.shape == ref.shape, (got.shape, ref.shape)
  err = float(np.max(np.abs(got - ref)))
  bound = c * max(1.0, float(np.max(np.abs(ref))))
  assert err <= bound, f"max |diff| {err:.3g} > {c:g} * max(1, max|ref|) = {bound:.3g}"


def _valid_kv_close(paged: PK.PagedKV, cache, c: float = C_PAGED) -> None:
  """K/V of every row's valid positions (< its length) agree."""
  as_cache = PK.to_cache(paged, cache.max_len)
  np.testing.assert_array_equal(paged.lengths, cache.lengths)
  for row, n in enumerate(np.asarray(cache.lengths)):
    assert_close(as_cache.k[:, row, :, :n], cache.k[:, row, :, :n], c)
    assert_close(as_cache.v[:, row, :, :n], cache.v[:, row, :, :n], c)


@pytest.mark.parametrize("weights", ["float", "int8"])
def test_paged_prefill_and_decode_equal_contiguous(weights):
  params = PARAMS if weights == "float" else quantize(PARAMS, CFG)
  z, m, p = 8, 6, 32  # page size, table width (48 positions), pool pages
  rng = np.random.default_rng(0)
  # Pages scattered over the pool, page 0 in no table; row 1 has two null entries.
  ids = rng.permutation(np.arange(1, p))[:16]
  table = np.full((3, m), p, np.int32)
  table[0], table[1, :4], table[2] = ids[:6], ids[6:10], ids[10:16]
  kv = PK.init_paged(CFG, 3, p, z, m, backend=NATIVE).replace(page_table=jnp.asarray(table))
  cache = init_cache(CFG, 3, z * m)
  toks = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 40)), jnp.int32)
  prompt = np.array([21, 9, 30])
  # Two chunks of 16 (ragged; row 1 ends in chunk 1 and sits out chunk 2), attend_len 20 reads
  # 3 pages and slices, 48 reads every page.
  for lo, attend_len in ((0, 20), (16, 48)):
    lens = jnp.asarray(np.clip(prompt - lo, 0, 16), jnp.int32)
    chunk = jnp.where(jnp.arange(16)[None] < lens[:, None], toks[:, lo:lo + 16], 0)
    ref, cache = T.jit_prefill(params, chunk, cache, None, lens, cfg=CFG, attend_len=attend_len)
    got, kv = T.jit_prefill(params, chunk, kv, None, lens, cfg=CFG, attend_len=attend_len)
    assert isinstance(kv, PK.PagedKV)
    assert_close(got, ref)
  _valid_kv_close(kv, cache)
  for step in range(5):
    nxt = toks[jnp.arange(3), jnp.asarray(prompt + step)]
    ref, cache = T.jit_decode_step(params, nxt, cache, cfg=CFG, attend_len=48)
    got, kv = T.jit_decode_step(params, nxt, kv, cfg=CFG, attend_len=48)
    assert_close(got, ref)
  np.testing.assert_array_equal(kv.lengths, prompt + 5)
  _valid_kv_close(kv, cache)
  # Every unassigned page, page 0 included, was never written (padding went nowhere).
  unused = np.setdiff1d(np.arange(p), table[table < p])
  assert 0 in unused
  assert not np.any(np.asarray(kv.k_pages)[:, unused]) and not np.any(
      np.asarray(kv.v_pages)[:, unused])


def test_row_at_capacity_is_stopped_and_never_writes_outside_its_pages():
  z = 4
  pool = PagePool(PageBudget(page_size=z, pages_per_shard=12), max_seq_tokens=12)
  lens = np.array([8, 12, 5])  # row 1 fills its 3 pages exactly
  for row, n in enumerate(lens):
    assert pool.allocate(row, int(n)) is None
  kv = PK.init_paged(CFG, 3, 12, z, pool.max_pages_per_seq).replace(
      page_table=jnp.asarray(pool.page_table([0, 1, 2])))
  toks = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (3, 16)), jnp.int32)
  _, kv = T.jit_prefill(PARAMS, toks, kv, jnp.zeros(3, jnp.int32),
                        jnp.asarray(lens, jnp.int32), cfg=CFG, attend_len=12)
  # The engine's check before the next decode step: row 1 is refused, with a reason.
  refusals = [pool.extend(row, 1) for row in range(3)]
  assert refusals[0] is None and refusals[2] is None
  assert refusals[1] is not None and refusals[1].kind == "capacity"
  assert "capacity" in refusals[1].message and pool.tokens(1) == 12
  pool.check()
  kv = kv.replace(page_table=jnp.asarray(pool.page_table([0, 1, 2])))
  ones = jnp.ones(3, jnp.int32)
  np.testing.assert_array_equal(PK.unbacked(kv, None, ones, 1), [0, 1, 0])
  before_k, before_v = np.array(kv.k_pages), np.array(kv.v_pages)  # copies
  # Even a step that wrongly keeps row 1 active drops its write: pages outside rows 0 and 2's
  # write positions are bit-identical afterwards.
  for active in ([1, 0, 1], [1, 1, 1]):
    fresh = jax.tree.map(jnp.copy, kv)  # the step donates its store
    _, after = T.jit_decode_step(PARAMS, toks[:, 0], fresh, cfg=CFG, attend_len=12,
                                 active_B=jnp.asarray(active))
    written = np.zeros(before_k.shape[1:2] + before_k.shape[3:4], bool)  # [P, Z]
    for row in (0, 2):
      pos = int(lens[row])
      written[pool.table(row)[pos // z], pos % z] = True
    changed = np.any(np.asarray(after.k_pages) != before_k, axis=(0, 2, 4))
    assert not np.any(changed & ~written), np.argwhere(changed & ~written)
    assert np.all(changed[written])  # rows 0 and 2 did write
    same_v = np.asarray(after.v_pages)[:, ~written.any(axis=1)]
    np.testing.assert_array_equal(same_v, before_v[:, ~written.any(axis=1)])


def test_fork_copy_on_write_decodes_like_two_contiguous_rows():
  z = 4
  pool = PagePool(PageBudget(page_size=z, pages_per_shard=10), max_seq_tokens=16)
  prompt = np.random.default_rng(2).integers(0, CFG.vocab_size, 10)  # 2 full pages + 2 tokens
  assert pool.allocate("parent", 10) is None
  kv = PK.init_paged(CFG, 2, 10, z, pool.max_pages_per_seq, backend=NATIVE).replace(
      page_table=jnp.asarray(pool.page_table(["parent", None])))
  toks = jnp.zeros((2, 16), jnp.int32).at[0, :10].set(jnp.asarray(prompt))
  _, kv = T.jit_prefill(PARAMS, toks, kv, None, jnp.array([10, 0], jnp.int32), cfg=CFG,
                        attend_len=16)
  forked = pool.fork("parent", "child")
  assert forked.copy is not None
  kv = PK.copy_pages(kv, jnp.array([forked.copy.src]), jnp.array([forked.copy.dst]))
  for seq in ("parent", "child"):
    assert pool.extend(seq, 1) is None
  pool.check()
  kv = kv.replace(page_table=jnp.asarray(pool.page_table(["parent", "child"])),
                  lengths=jnp.array([10, 10], jnp.int32))
  shared = list(pool.table("parent")[:2])
  before = np.array(kv.k_pages)[:, shared]
  cache = init_cache(CFG, 2, 16)
  both = jnp.tile(jnp.asarray(prompt, jnp.int32)[None], (2, 1))
  _, cache = T.jit_prefill(PARAMS, both, cache, None, jnp.array([10, 10], jnp.int32), cfg=CFG,
                           attend_len=16)
  nxt = jnp.array([3, 7], jnp.int32)  # the two samples diverge
  ref, cache = T.jit_decode_step(PARAMS, nxt, cache, cfg=CFG, attend_len=16)
  got, kv = T.jit_decode_step(PARAMS, nxt, kv, cfg=CFG, attend_len=16)
  assert_close(got, ref)
  assert np.abs(np.asarray(ref[0] - ref[1])).max() > 1e-3  # the rows really differ
  _valid_kv_close(kv, cache)
  np.testing.assert_array_equal(np.asarray(kv.k_pages)[:, shared], before)  # shared: read-only


def test_copy_pages_padding_and_page_bytes():
  kv = PK.init_paged(CFG, 1, 4, 2, 2)
  kv = kv.replace(k_pages=kv.k_pages.at[:, 1].set(1.0), v_pages=kv.v_pages.at[:, 1].set(2.0))
  out = PK.copy_pages(kv, jnp.array([1, 1]), jnp.array([3, 4]))  # 4 = padding: copies nothing
  np.testing.assert_array_equal(np.asarray(out.k_pages)[:, 3], 1.0)
  np.testing.assert_array_equal(np.asarray(out.v_pages)[:, 3], 2.0)
  np.testing.assert_array_equal(np.asarray(out.k_pages)[:, [0, 2]], 0.0)
  assert PK.page_bytes(CFG, 16, jnp.bfloat16) == 2 * 2 * 2 * 16 * 16 * 2
  with pytest.raises(ValueError):
    kv.read(0, 5)  # more than the 4-position capacity


@pytest.mark.parametrize("t,native", [(2, True), (1, False)], ids=["chunk", "decode_gather"])
def test_a_reused_pages_stale_nan_past_the_end_adds_nothing(t, native):
  """A page freed by a sequence whose values went non-finite is reused: positions past the new
  owner's end still hold NaN / Inf. Masked, they must add nothing (a zero probability times NaN
  is NaN): the output equals that of a clean pool."""
  cfg = get_preset("tiny").replace(num_layers=1)
  rng = np.random.default_rng(0)
  kv = PK.init_paged(cfg, 1, 2, 8, 2, jnp.float32, backend=NATIVE if native else CpuBackend())
  kv = kv.replace(page_table=jnp.asarray([[0, 1]], jnp.int32))
  shape = (1, 10, cfg.num_kv_heads, cfg.head_dim)
  clean = kv.write(0, jnp.arange(10, dtype=jnp.int32)[None],
                   jnp.asarray(rng.standard_normal(shape), jnp.float32),
                   jnp.asarray(rng.standard_normal(shape), jnp.float32))
  stale = clean.replace(v_pages=clean.v_pages.at[0, 1, :, 4].set(jnp.nan).at[0, 1, :, 6]
                        .set(jnp.inf), k_pages=clean.k_pages.at[0, 1, :, 5].set(jnp.nan))
  q = jnp.asarray(rng.standard_normal((1, t, cfg.num_heads, cfg.head_dim)), jnp.float32)
  pos = jnp.arange(10 - t, 10, dtype=jnp.int32)[None]  # sees keys <= 9; stale at 12, 13, 14
  got = stale.attend(0, q, pos, 16)
  assert bool(jnp.isfinite(got).all())
  want = np.asarray(clean.attend(0, q, pos, 16))
  np.testing.assert_allclose(np.asarray(got), want, rtol=0,
                             atol=1e-6 * max(1.0, float(np.abs(want).max())))  # relative


def test_negative_table_entries_read_as_zeros():
  """The contract: a table entry outside [0, P) is the null page (zeros); JAX's fill mode alone
  would wrap a negative index onto a real page."""
  cfg = get_preset("tiny").replace(num_layers=1)
  kv = PK.init_paged(cfg, 1, 3, 4, 2, jnp.float32)
  kv = kv.replace(k_pages=jnp.ones_like(kv.k_pages), v_pages=jnp.ones_like(kv.v_pages))
  for entry in (3, -1, -3):
    k, v = kv.replace(page_table=jnp.asarray([[0, entry]], jnp.int32)).read(0, 8)
    assert float(jnp.abs(k[:, :, 4:]).sum()) == 0 and float(jnp.abs(v[:, :, 4:]).sum()) == 0
    assert float(k[:, :, :4].sum()) == k[:, :, :4].size
