"""serving.kv_pages: the page allocator's budget, refusals, fork copy-on-write and invariants under a
few thousand random operations (numpy RNG, seeded)."""

import numpy as np
import pytest

from models.config import get_preset
from serving.kv_pages import PageBudget, PageCopy, PagePool, page_budget

SMALL = get_preset("small")


def test_budget_from_bytes_never_exceeds_it():
  per_page = 2 * SMALL.num_layers * SMALL.num_kv_heads * 16 * SMALL.head_dim * 2  # bf16
  for budget_bytes in (per_page, 10 * per_page + 1, 1 << 30):
    for shards in (1, 2, 4):
      if budget_bytes // shards < per_page:
        continue
      b = page_budget(SMALL, "bfloat16", 16, budget_bytes=budget_bytes, num_shards=shards)
      assert b.bytes_per_page == per_page
      assert b.bytes <= budget_bytes
      assert (b.pages_per_shard + 1) * per_page * shards > budget_bytes  # rounded down only
  assert page_budget(SMALL, "float32", 32, num_pages=8, num_shards=2).pages_per_shard == 4
  with pytest.raises(ValueError):
    page_budget(SMALL, "bfloat16", 16, budget_bytes=per_page - 1)
  with pytest.raises(ValueError):
    page_budget(SMALL, "bfloat16", 16, num_pages=5, num_shards=2)


def test_can_ever_fit_and_refusals_change_nothing():
  pool = PagePool(PageBudget(page_size=8, pages_per_shard=4, num_shards=2), max_seq_tokens=40)
  assert pool.max_pages_per_seq == 5
  assert pool.can_ever_fit(32) is None
  r = pool.can_ever_fit(33)  # 5 pages: fits the page table, not a 4-page sub-pool
  assert r is not None and r.kind == "budget" and "4" in r.message
  r = pool.can_ever_fit(41)
  assert r is not None and r.kind == "capacity"
  assert pool.allocate("a", 33).kind == "budget" and "a" not in pool
  assert pool.allocate("a", 20, shard=0) is None  # 3 pages
  r = pool.allocate("b", 9, shard=0)
  assert r is not None and r.kind == "no_pages" and "b" not in pool
  assert pool.allocate("b", 9) is None and pool.shard_of("b") == 1  # the emptier sub-pool
  assert pool.extend("a", 12) is None and pool.tokens("a") == 32  # 4 pages: shard 0 is full
  r = pool.extend("a", 1)  # 5 pages: more than the whole sub-pool, not just none free now
  assert r is not None and r.kind == "budget"
  assert pool.tokens("a") == 32 and len(pool.table("a")) == 4
  pool.check()
  with pytest.raises(ValueError):
    pool.allocate("a", 1)
  with pytest.raises(ValueError):
    pool.extend("zz", 1)
  with pytest.raises(ValueError):
    pool.release("zz")


def test_capacity_refusal_keeps_the_sequence_within_its_pages():
  pool = PagePool(PageBudget(page_size=4, pages_per_shard=16), max_seq_tokens=10)
  assert pool.allocate("s", 9) is None
  assert pool.extend("s", 1) is None  # 10 positions, 3 pages
  r = pool.extend("s", 1)
  assert r is not None and r.kind == "capacity" and "10" in r.message
  assert pool.tokens("s") == 10 and len(pool.table("s")) == 3
  pool.check()


def test_fork_copies_exactly_the_partial_last_page():
  pool = PagePool(PageBudget(page_size=4, pages_per_shard=16), max_seq_tokens=64)
  assert pool.allocate("p", 10) is None  # pages: 2 full + 1 partial
  parent = pool.table("p")
  f = pool.fork("p", "c")
  assert f.copy == PageCopy(src=parent[2], dst=pool.table("c")[2])
  assert pool.table("c")[:2] == parent[:2] and pool.table("c")[2] not in parent
  assert [pool.refcount(p) for p in parent] == [2, 2, 1]
  pool.check()
  assert pool.extend("p", 2) is None  # 12 positions: the parent's last page now full
  g = pool.fork("p", "d")
  assert g.copy is None and pool.table("d") == pool.table("p")
  assert [pool.refcount(p) for p in parent] == [3, 3, 2]
  pool.check()
  assert pool.release("p") == []  # every page still held by a child
  assert sorted(pool.release("d")) == [parent[2]]
  assert sorted(pool.release("c")) == sorted(parent[:2] + (f.copy.dst,))
  assert pool.pages_used == 0
  pool.check()


def test_page_table_global_and_local_ids():
  pool = PagePool(PageBudget(page_size=4, pages_per_shard=8, num_shards=2), max_seq_tokens=16)
  assert pool.allocate("a", 5, shard=1) is None
  assert pool.allocate("b", 3, shard=0) is None
  g = pool.page_table(["a", None, "b"])
  assert g.shape == (3, 4) and g.dtype == np.int32
  assert list(g[0, :2]) == list(pool.table("a")) and all(8 <= p < 16 for p in g[0, :2])
  assert list(g[0, 2:]) == [16, 16] and list(g[1]) == [16] * 4  # null page = pool size
  loc = pool.page_table(["a", None, "b"], local=True)
  assert list(loc[0, :2]) == [p - 8 for p in pool.table("a")] and list(loc[1]) == [8] * 4
  assert [(u.shard, u.used, u.free, u.total) for u in pool.usage()] == [(0, 1, 7, 8),
                                                                        (1, 2, 6, 8)]


def test_random_operations_keep_the_invariants():
  rng = np.random.default_rng(1234)
  z, per_shard, shards = 4, 24, 3
  pool = PagePool(PageBudget(page_size=z, pages_per_shard=per_shard, num_shards=shards),
                  max_seq_tokens=40)
  family: dict[int, int] = {}  # seq -> id of the sequence it was forked from, transitively
  tokens: dict[int, int] = {}  # the test's own count of each sequence's positions
  next_id, counts = 0, {"cow": 0, "no_cow": 0, "refused": 0, "released": 0}
  for step in range(3000):
    op = rng.choice(["alloc", "extend", "fork", "release"], p=[0.3, 0.35, 0.15, 0.2])
    live = sorted(tokens)
    if op == "alloc" or not live:
      n = int(rng.integers(0, 60))
      shard = None if rng.random() < 0.5 else int(rng.integers(0, shards))
      before = pool.pages_used
      r = pool.allocate(next_id, n, shard)
      if n > 40:
        assert r is not None and r.kind == "capacity"
      if r is None:
        tokens[next_id], family[next_id] = n, next_id
        assert pool.pages_used == before + pool.pages_for(n)
      else:
        counts["refused"] += 1
        assert pool.pages_used == before and next_id not in pool
      next_id += 1
    elif op == "extend":
      seq = live[int(rng.integers(len(live)))]
      n = int(rng.integers(1, 9))
      r = pool.extend(seq, n)
      if tokens[seq] + n > 40:
        assert r is not None and r.kind == "capacity"
      elif pool.pages_for(tokens[seq] + n) > per_shard:
        assert r is not None and r.kind == "budget"
      if r is None:
        tokens[seq] += n
      else:
        counts["refused"] += 1
    elif op == "fork":
      seq = live[int(rng.integers(len(live)))]
      parent = pool.table(seq)
      r = pool.fork(seq, next_id)
      if hasattr(r, "kind"):
        assert r.kind == "no_pages" and next_id not in pool
        counts["refused"] += 1
      else:
        partial = tokens[seq] % z != 0
        assert (r.copy is not None) == partial
        counts["cow" if partial else "no_cow"] += 1
        child = pool.table(next_id)
        full = tokens[seq] // z
        assert child[:full] == parent[:full]
        if partial:
          assert r.copy.src == parent[-1] and r.copy.dst == child[-1]
          assert pool.refcount(child[-1]) == 1
        tokens[next_id], family[next_id] = tokens[seq], family[seq]
      next_id += 1
    else:
      seq = live[int(rng.integers(len(live)))]
      table = pool.table(seq)
      freed = pool.release(seq)
      del tokens[seq]
      assert set(freed) <= set(table)
      assert all(pool.refcount(p) == 0 for p in freed)
      assert all(pool.refcount(p) > 0 for p in set(table) - set(freed))
      counts["released"] += len(freed)
    # Invariants after every operation.
    pool.check()
    assert pool.pages_used + pool.pages_free == per_shard * shards
    assert all(u.used <= per_shard for u in pool.usage())  # the budget is never exceeded
    assert {s: pool.tokens(s) for s in pool.sequences} == tokens
    holders: dict[int, set[int]] = {}
    for s in pool.sequences:
      for p in pool.table(s):
        holders.setdefault(p, set()).add(family[s])
    assert all(len(f) == 1 for f in holders.values()), "a page shared outside a fork family"
  assert min(counts.values()) > 20, counts  # every path was exercised
  for seq in list(tokens):
    pool.release(seq)
  assert pool.pages_used == 0 and pool.pages_free == per_shard * shards
  pool.check()
