"""serving.kv_manager on its own: admit / extend / cache / finish / free / reclaimable with the
radix prefix cache and with the null one, sessions' pins, host-tier moves, cross-shard copies."""

from __future__ import annotations

import pytest

from serving.host_tier import HostStore
from serving.kv_manager import Admission, KVManager, PageMoves, build_kv
from serving.kv_pages import PageBudget, PageCopy, PagePool
from serving.prefix_cache import NullPrefixCache, PrefixCache
from serving.request import Request, Sinks
from serving.sessions import SessionPolicy, Sessions

Z = 4  # page size


def _kv(pages=16, shards=1, cache=True, host_pages=0, sessions=None, generated=True):
  return build_kv(PageBudget(Z, pages // shards, shards), 64, prefix_cache=cache,
                  host_store=HostStore() if host_pages else None, host_pages=host_pages,
                  sessions=sessions, cache_generated=generated)


def _req(rid, prompt, session="", sinks=None):
  return Request(rid, tuple(prompt), session_id=session, sinks=sinks)


def _run(kv, req, tokens=None, generated=()):
  """Admits ``req`` for its whole context, then ``finish``es it with ``generated`` ids."""
  tokens = list(tokens or req.prompt_ids)
  got = kv.admit(req, tokens, len(tokens))
  assert got is not None
  for _ in generated:
    assert kv.extend(req.request_id, 1) is None
  kv.finish(req.request_id, tokens + list(generated))
  return got


def test_admit_extend_free_without_caching():
  kv = _kv(cache=False)
  assert isinstance(kv.prefix_cache, NullPrefixCache) and not kv.caching
  prompt = list(range(10))
  a = _req("a", prompt)
  assert kv.admit(a, prompt, 6) == Admission(0, None)  # a first chunk of 6 positions
  assert "a" in kv and kv.pool.tokens("a") == 6 and kv.pool.table("a") == (0, 1)
  assert kv.extend("a", 4) is None and kv.pool.tokens("a") == 10
  kv.cache("a", prompt)  # nothing is cached
  kv.finish("a", prompt + [1])
  assert "a" not in kv and kv.pool.pages_used == 0 and kv.pool.pages_cached == 0
  b = _req("b", prompt)
  assert kv.admit(b, prompt, 10).start == 0  # the same prompt again: nothing reused
  assert kv.reclaimable(0) == 0 and kv.take_moves() == PageMoves()
  kv.free("b")
  kv.free("b")  # a no-op for an unknown id
  kv.check()


def test_admit_reuses_the_cached_prefix_and_locks_it():
  kv = _kv()
  prompt = list(range(20, 33))  # 13 tokens: 3 whole pages
  _run(kv, _req("a", prompt), generated=[7])
  cache = kv.prefix_cache
  assert isinstance(cache, PrefixCache) and cache.pages == 3 and kv.reclaimable(0) == 3
  assert kv.cached_prefix(prompt + [7]) == 12 and cache.hits == 0  # an estimate: not counted
  b = _req("b", prompt + [1, 2])
  got = kv.admit(b, b.prompt_ids, 4)
  assert got.start == 12 and kv.pool.tokens("b") == 15  # 3 pages reused, 3 positions computed
  assert kv.reclaimable(0) == 0  # locked while "b" holds pages
  assert (cache.hits, cache.misses, cache.hit_tokens) == (1, 1, 12)  # "a" missed, "b" hit
  kv.free("b")
  assert kv.reclaimable(0) == 3
  kv.check()


def test_cache_generated_false_caches_only_the_prompt():
  kv = _kv(generated=False)
  prompt = list(range(8))
  _run(kv, _req("a", prompt), generated=[1, 2, 3, 4, 5])  # 13 written: 3 whole pages
  assert kv.prefix_cache.pages == 2  # the prompt's 2 pages only


def test_extend_reclaims_cached_pages_before_refusing():
  kv = _kv(pages=8)
  _run(kv, _req("a", range(9)))  # 8 written positions: 2 pages cached
  assert kv.pool.pages_free == 6 and kv.reclaimable(0) == 2
  c = _req("c", range(50, 66))
  assert kv.admit(c, c.prompt_ids, 16).start == 0  # 4 pages: 2 left free
  b = _req("b", range(100, 104))
  assert kv.admit(b, b.prompt_ids, 4).start == 0  # 1 free page left
  assert kv.extend("b", 8) is None  # 2 more pages, 1 free: one cached page was evicted
  assert kv.prefix_cache.evicted == 1 and kv.reclaimable(0) == 1
  assert kv.extend("b", 4) is None and kv.prefix_cache.evicted == 2
  refusal = kv.extend("b", 1)  # nothing free, nothing left to reclaim
  assert refusal is not None and refusal.kind == "no_pages" and kv.pool.tokens("b") == 16
  assert kv.extend("b", 1000).kind == "capacity"
  kv.check()


def test_admit_refuses_and_changes_nothing_when_full():
  kv = _kv(pages=4, cache=False)
  a = _req("a", range(16))
  assert kv.admit(a, a.prompt_ids, 16).start == 0
  b = _req("b", range(4))
  assert kv.admit(b, b.prompt_ids, 4) is None and "b" not in kv
  assert kv.can_ever_fit(5 * Z).kind == "budget" and kv.can_ever_fit(16) is None
  kv.check()


def test_sessions_pin_on_finish_and_hand_over_on_admit():
  kv = _kv(sessions=SessionPolicy(idle_s=100.0, max_pinned_pages=8))
  assert isinstance(kv.sessions, Sessions)
  turn1 = list(range(40, 49))
  _run(kv, _req("t1", turn1, session="chat"), generated=[5, 6, 7])
  assert "chat" in kv.sessions and kv.reclaimable(0) == 0  # pinned: not reclaimable
  turn2 = turn1 + [5, 6, 7, 8]
  got = kv.admit(_req("t2", turn2, session="chat"), turn2, 16)
  # 11 positions of turn 1 were written (its last id's never): 2 whole pages reused.
  assert got.start == 8 and got.paused_at is not None and "chat" not in kv.sessions
  kv.finish("t2", turn2 + [9])
  assert "chat" in kv.sessions  # pinned again for the next turn
  kv.drop_cached()
  assert "chat" not in kv.sessions and kv.prefix_cache.pages == 0
  kv.check()


def test_sessions_need_the_managers_own_cache():
  pool = PagePool(PageBudget(Z, 8), 32)
  other = Sessions(PrefixCache(pool), SessionPolicy())
  with pytest.raises(ValueError):
    KVManager(pool, PrefixCache(pool), sessions=other)
  with pytest.raises(ValueError):
    KVManager(pool, None, sessions=other)


def test_host_tier_spills_and_loads_are_the_plans_moves():
  kv = _kv(pages=4, host_pages=4)
  prompt = list(range(60, 69))  # 2 whole pages once written
  _run(kv, _req("a", prompt))
  b = _req("b", range(200, 216))  # the whole pool: the cached pages spill to the host
  assert kv.admit(b, b.prompt_ids, 16).start == 0
  moves = kv.take_moves()
  assert len(moves.spills) == 2 and not moves.loads and kv.prefix_cache.host_pages_used == 2
  kv.free("b")
  c = _req("c", prompt + [1])
  assert kv.admit(c, c.prompt_ids, 10).start == 8  # both pages come back from the host
  loads = kv.take_moves().loads
  assert {ld.key for ld in loads} == {sp.key for sp in moves.spills}
  assert [ld.page for ld in loads] == list(kv.pool.table("c")[:2])
  assert kv.take_moves() == PageMoves() and kv.prefix_cache.host_hits == 1
  kv.check()


def test_a_full_sub_pool_copies_the_prefix_to_another():
  kv = _kv(pages=8, shards=2)
  prompt = list(range(9))
  _run(kv, _req("a", prompt))  # 2 pages cached on shard 0
  hog = _req("hog", range(100, 108))
  assert kv.admit(hog, hog.prompt_ids, 8) is not None and kv.shard_of("hog") == 0
  b = _req("b", prompt + [1])  # its prefix is on shard 0, which has no room for the rest
  got = kv.admit(b, b.prompt_ids, 10)
  assert got.start == 8 and kv.shard_of("b") == 1 and kv.prefix_copied_pages == 2
  moves = kv.take_moves()
  assert moves.copies == tuple(PageCopy(s, d) for s, d in zip(range(0, 2), kv.pool.table("b")))
  kv.check()


def test_sink_rings_neither_use_nor_feed_the_cache():
  kv = _kv(pages=8)
  sinks = Sinks(window=8, sinks=2)
  s = _req("s", range(6), session="chat", sinks=sinks)
  ring = kv.ring_pages(sinks)
  assert kv.can_ever_fit(10**6, sinks) is None  # a ring: any length
  assert kv.admit(s, s.prompt_ids, 6).start == 0 and len(kv.pool.table("s")) == ring
  assert kv.extend("s", 1000) is None  # a ring only counts tokens
  kv.finish("s", list(range(7)))
  assert kv.prefix_cache.pages == 0 and kv.prefix_cache.misses == 0
  kv.check()
