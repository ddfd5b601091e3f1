"""serving.sessions through the scheduler over the FakeEngine: a paused session's KV survives other
traffic's evictions within its idle time and the pinned-page budget, the next turn (ids
extending the previous prompt + answer) resumes from it with the same ids as one request with
the concatenated prompt, and the trace shows the pause and the resume."""

from __future__ import annotations

import random

from models.text.tokenizer import ByteTokenizer
from serving.fake_engine import FakeEngine, reference
from serving.kv_pages import PageBudget, PagePool
from serving.lifecycle import RequestTrace
from serving.prefix_cache import PrefixCache
from serving.request import Request
from serving.sampling import SamplingParams
from serving.scheduler import Scheduler
from serving.sessions import SessionPolicy, Sessions
from serving.stop import StopCriteria
from tests.sched_steps import step as run_step

VOCAB = ByteTokenizer.VOCAB_SIZE
Z = 4


class Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


def _setup(pages=24, idle_s=100.0, budget=16, pin=True):
  pool = PagePool(PageBudget(Z, pages), max_seq_tokens=64)
  cache = PrefixCache(pool)
  clock = Clock()
  sessions = Sessions(cache, SessionPolicy(idle_s, budget), clock) if pin else None
  sched = Scheduler(pool, ByteTokenizer(), max_slots=4, max_step_tokens=16, max_chunk=8,
                    prefix_cache=cache, sessions=sessions)
  return pool, sched, FakeEngine(pages, Z, VOCAB, 4, lag=1), clock


def _serve(sched, eng, reqs, traces=None):
  outs: dict[str, list[int]] = {}
  finals = {}
  for r in reqs:
    tr = RequestTrace(r.request_id, sched.kv.sessions.clock if sched.kv.sessions else lambda: 0.0)
    if traces is not None:
      traces[r.request_id] = tr
    assert sched.add(r, tr) is None
  for _ in range(10_000):  # bounded: a request that can never be admitted fails, not hangs
    if sched.idle:
      break
    got = run_step(sched, eng)
    for o in got:
      outs.setdefault(o.request_id, []).extend(o.token_ids)
      if o.finished:
        finals[o.request_id] = o
    sched.kv.pool.check()
    sched.kv.prefix_cache.check()
  else:
    raise AssertionError(f"not idle after 10,000 steps: {sched.num_waiting} waiting")
  for x in eng.flush():
    sched.update(x)
  return outs, finals


def _req(rid, prompt, n=6, seed=0, session=""):
  return Request(rid, tuple(prompt), SamplingParams(seed=seed),
                 StopCriteria(max_tokens=n, ignore_eos=True), session_id=session)


def _other_traffic(rng, k):
  return [_req(f"x{k}-{i}", [rng.randrange(256) for _ in range(14)], n=6, seed=i)
          for i in range(6)]


def _conversation(pin: bool):
  rng = random.Random(3)
  pool, sched, eng, clock = _setup(pin=pin)
  turn1 = list(range(30, 41))
  out1, _ = _serve(sched, eng, [_req("t1", turn1, n=8, seed=1, session="chat-1")])
  clock.t = 10.0  # a tool call runs...
  _serve(sched, eng, _other_traffic(rng, 0))  # ...while others fill the pool
  turn2 = turn1 + out1["t1"] + [7, 7, 7]
  traces = {}
  out2, fin2 = _serve(sched, eng, [_req("t2", turn2, n=5, seed=2, session="chat-1")], traces)
  return turn2, out2["t2"], fin2["t2"], traces["t2"], sched


def test_a_paused_session_resumes_from_its_pinned_kv():
  turn2, ids, final, trace, sched = _conversation(pin=True)
  assert ids == reference(turn2, 2, 5, VOCAB)  # = one request with the concatenated prompt
  assert final.usage.cached_tokens == (11 + 8 - 1) // Z * Z  # every written page of turn 1
  kinds = [e.kind for e in trace.events]
  assert "paused" in kinds and "resume" in kinds
  paused = next(e for e in trace.events if e.kind == "paused")
  resume = next(e for e in trace.events if e.kind == "resume")
  assert paused.t == 0.0 and resume.t == 10.0 and paused.detail == "chat-1"
  assert "chat-1" in sched.kv.sessions  # pinned again after turn 2
  # Control: without pinning, the other traffic evicted turn 1's pages (same ids, less reuse).
  turn2b, ids_b, final_b, _, _ = _conversation(pin=False)
  assert ids_b == ids and final_b.usage.cached_tokens < final.usage.cached_tokens


def test_idle_sessions_expire_and_the_budget_unpins_the_oldest():
  pool, sched, eng, clock = _setup(idle_s=5.0, budget=5)
  _serve(sched, eng, [_req("a", list(range(10, 21)), n=6, session="A")])  # 16 written: 4 pages
  clock.t = 1.0
  _serve(sched, eng, [_req("b", list(range(50, 61)), n=6, session="B")])
  assert "A" not in sched.kv.sessions and "B" in sched.kv.sessions  # 8 pages > 5: A, the oldest, went
  assert sched.kv.sessions.unpinned_for_budget == 1 and sched.kv.sessions.pinned_pages == 4
  clock.t = 7.0
  sched.schedule()  # expiry runs at planning
  assert "B" not in sched.kv.sessions and sched.kv.sessions.expired == 1
  assert pool.pages_cached == 8 and pool.pages_used == 0  # unpinned pages stay cached
  assert sched.kv.prefix_cache.evict(0, 8) == 8


def test_a_prefix_shared_by_sessions_counts_once_against_the_budget():
  """Two sessions with a common 16-token system prompt pin 6 pages each, 4 of them the same
  pages: 8 distinct pages fit a budget of 9 (counted per session, 12 would unpin the first).
  A shared page still counts while another session holds it."""
  pool, sched, eng, clock = _setup(pages=24, budget=9)
  system = list(range(100, 116))  # 4 whole pages of 4
  _serve(sched, eng, [_req("a", system + [1, 2, 3], n=6, session="A")])  # 24 written: 6 pages
  clock.t = 1.0
  _serve(sched, eng, [_req("b", system + [4, 5, 6], n=6, session="B")])
  s = sched.kv.sessions
  assert "A" in s and "B" in s and s.unpinned_for_budget == 0
  assert s.pinned_pages == 8 and pool.pages_cached == 8
  assert s.take("A") == 0.0
  assert s.pinned_pages == 6  # B's own 2 and the 4 shared ones, which B still holds
  assert sched.kv.prefix_cache.evict(0, 8) == 2  # only A's own pages were unpinned
  s.take("B")
  assert s.pinned_pages == 0 and sched.kv.prefix_cache.evict(0, 8) == 6


def test_the_budget_unpins_by_distinct_pages():
  """Budget 7 < 8 distinct pages: the oldest session goes, and the 4 pages it shared stay
  counted for the session left."""
  pool, sched, eng, clock = _setup(pages=24, budget=7)
  system = list(range(100, 116))
  _serve(sched, eng, [_req("a", system + [1, 2, 3], n=6, session="A")])
  clock.t = 1.0
  _serve(sched, eng, [_req("b", system + [4, 5, 6], n=6, session="B")])
  s = sched.kv.sessions
  assert "A" not in s and "B" in s and s.unpinned_for_budget == 1 and s.pinned_pages == 6


def test_a_pinned_shard_is_not_chosen_for_a_new_sequence():
  """Two sub-pools; a session pins 5 of shard 0's 6 pages. A new prompt with no cache hit goes
  to shard 1 (empty), not to shard 0, whose pinned pages look reclaimable but are locked: it
  runs at once instead of waiting out the session's idle time, and each lookup counts once."""
  pool = PagePool(PageBudget(Z, 6, num_shards=2), max_seq_tokens=24)
  cache = PrefixCache(pool)
  clock = Clock()
  sessions = Sessions(cache, SessionPolicy(idle_s=300.0, max_pinned_pages=16), clock)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=4, max_step_tokens=16, max_chunk=8,
                    prefix_cache=cache, sessions=sessions)
  eng = FakeEngine(12, Z, VOCAB, 4, lag=1)
  _serve(sched, eng, [_req("turn1", range(30, 45), n=6, session="chat")])
  shard0 = pool.usage()[0]
  assert (shard0.free, shard0.cached) == (1, 5) and cache.reclaimable(0) == 0
  outs, finals = _serve(sched, eng, [_req("other", range(100, 106), n=4, seed=1),
                                     _req("other2", range(120, 123), n=4, seed=2)])
  assert outs["other"] == reference(list(range(100, 106)), 1, 4, VOCAB)
  assert outs["other2"] == reference(list(range(120, 123)), 2, 4, VOCAB)
  assert clock.t == 0.0 and "chat" in sched.kv.sessions  # no idle time had to pass
  assert cache.misses == 3 and cache.hits == 0  # turn1, other, other2: once each
