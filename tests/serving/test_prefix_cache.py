"""serving.prefix_cache and the scheduler's use of it, over the hand-checkable FakeEngine (whose ids
depend on every (position, id) read back through the page table, so a wrongly shared, stale or
overwritten page changes the output): reuse, locking, LRU eviction under a small budget,
invariants at every step, sharded sub-pools, and the real engine with the cache on and off."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_preset
from models.step import UnshardedStep
from tests.cpu_policies import NATIVE
from models.text.tokenizer import ByteTokenizer
from models.weights import init_params
from serving import stack
from serving.fake_engine import FakeEngine, reference
from models.paged_kv import page_bytes
from serving.kv_pages import PageBudget, PagePool
from serving.lifecycle import RequestTrace
from serving.prefix_cache import PrefixCache
from serving.request import Request
from serving.sampling import SamplingParams
from serving.scheduler import Scheduler
from serving.stop import FinishReason, StopCriteria
from tests.sched_steps import step as run_step

VOCAB = ByteTokenizer.VOCAB_SIZE
Z = 4  # page size


def _setup(pages=32, slots=4, shards=1, cache=True, chunk=8, step_tokens=16, lag=1,
           max_seq=64):
  pool = PagePool(PageBudget(Z, pages // shards, shards), max_seq_tokens=max_seq)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=slots, max_step_tokens=step_tokens,
                    max_chunk=chunk, prefix_cache=PrefixCache(pool) if cache else None)
  return pool, sched, FakeEngine(pages, Z, VOCAB, slots, lag=lag)


def _run(sched, engine, reqs, check=True, max_steps=2000):
  """Runs ``reqs`` (added at their step: list of (step, Request)) to completion."""
  outs: dict[str, list[int]] = {}
  finals = {}
  pending = sorted(reqs, key=lambda x: x[0])
  for step in range(max_steps):
    while pending and pending[0][0] <= step:
      _, r = pending.pop(0)
      assert sched.add(r, RequestTrace(r.request_id)) is None
    if sched.idle and not pending:
      for res in engine.flush():
        sched.update(res)
      break
    got = run_step(sched, engine)
    for o in got:
      outs.setdefault(o.request_id, []).extend(o.token_ids)
      if o.finished:
        finals[o.request_id] = o
    if check:
      sched.kv.check()
  else:
    raise AssertionError("not idle")
  return outs, finals


def _req(rid, prompt, n=6, seed=0):
  return Request(rid, tuple(prompt), SamplingParams(seed=seed),
                 StopCriteria(max_tokens=n, ignore_eos=True))


def test_cache_match_insert_lock_evict():
  pool = PagePool(PageBudget(Z, 8), max_seq_tokens=32)
  cache = PrefixCache(pool)
  toks = list(range(1, 12))  # 11 tokens: 2 whole pages, 3 leave a token
  assert pool.allocate("a", 11) is None
  table = pool.table("a")
  assert cache.insert(toks, table, 0) == 2 and cache.pages == 2
  assert cache.insert(toks, table, 0) == 0  # already there
  assert cache.reclaimable(0) == 0  # "a" still holds both pages: dropping them frees nothing,
  assert cache.evict(0, 2) == 0 and cache.pages == 2  # so they stay cached
  m = cache.match(toks + [99], 0)
  assert m.pages == table[:2] and m.tokens(Z) == 8
  assert cache.match(toks[:8], 0).tokens(Z) == 4  # 8 tokens: one page, the last token left
  assert cache.match([7] + toks, 0).nodes == ()
  pool.release("a")
  assert pool.pages_used == 0 and pool.pages_cached == 2 and pool.pages_free == 6
  pool.check()
  assert cache.reclaimable(0) == 2
  cache.lock(m)
  assert cache.reclaimable(0) == 0 and cache.evict(0, 2) == 0  # locked: nothing goes
  cache.unlock(m)
  hits, misses = cache.hits, cache.misses
  quiet = cache.match(toks, 0, count=False)
  assert (cache.hits, cache.misses) == (hits, misses)  # counted only when recorded
  cache.record(quiet)
  cache.record(None)
  assert (cache.hits, cache.misses) == (hits + 1, misses + 1)
  assert cache.evict(0, 1) == 1 and cache.pages == 1  # the leaf first
  assert cache.match(toks, 0).tokens(Z) == 4
  assert cache.evict(0, 5) == 1 and cache.pages == 0 and pool.pages_free == 8
  pool.check()
  cache.check()
  with pytest.raises(ValueError):
    cache.unlock(m)


def test_shared_prefixes_reuse_pages_and_give_the_same_ids():
  pool, sched, eng = _setup()
  base = list(range(30, 43))  # 13 tokens: 3 whole pages
  reqs = [(0, _req("a", base + [1, 2], seed=1))]
  reqs += [(12 + i, _req(f"b{i}", base + [5 + i, 6, 7], seed=2 + i)) for i in range(3)]
  reqs += [(40, _req("same", base + [1, 2], seed=1))]  # the whole prompt again
  outs, finals = _run(sched, eng, reqs)
  for _, r in reqs:
    assert outs[r.request_id] == reference(list(r.prompt_ids), r.sampling.seed, 6, VOCAB)
  assert finals["a"].usage.cached_tokens == 0
  assert [finals[f"b{i}"].usage.cached_tokens for i in range(3)] == [12, 12, 12]
  # "a" ended with prompt + 5 generated ids written: 20 positions = 5 pages cached; its replay
  # reuses 3 full prompt pages (15 prompt tokens, the last one is recomputed).
  assert finals["same"].usage.cached_tokens == 12
  assert pool.pages_used == 0 and pool.pages_cached > 0
  c = sched.kv.prefix_cache
  assert c.hits == 4 and c.misses == 1 and c.hit_tokens == 48


def test_multiturn_continuation_reuses_generated_pages():
  pool, sched, eng = _setup()
  turn1 = list(range(50, 59))
  out1, _ = _run(sched, eng, [(0, _req("t1", turn1, n=8, seed=3))])
  turn2 = turn1 + out1["t1"] + [77, 78]  # the next turn extends prompt + answer
  out2, fin2 = _run(sched, eng, [(0, _req("t2", turn2, n=4, seed=4))])
  assert out2["t2"] == reference(turn2, 4, 4, VOCAB)
  assert fin2["t2"].usage.cached_tokens == (9 + 8 - 1) // Z * Z  # written: all but the last id


def test_eviction_under_a_small_budget_never_breaks_a_running_sequence():
  rng = random.Random(0)
  pool, sched, eng = _setup(pages=24, slots=3)
  prefixes = [[rng.randrange(256) for _ in range(rng.choice([5, 9, 13]))] for _ in range(4)]
  reqs = []
  for i in range(40):
    p = prefixes[rng.randrange(4)] + [rng.randrange(256) for _ in range(rng.randrange(1, 6))]
    reqs.append((rng.randrange(200), _req(f"r{i}", p, n=rng.randrange(1, 10), seed=i)))
  outs, finals = _run(sched, eng, reqs)
  for _, r in reqs:
    assert outs[r.request_id] == reference(list(r.prompt_ids), r.sampling.seed,
                                           r.stop.max_tokens, VOCAB), r.request_id
    assert finals[r.request_id].finish_reason is FinishReason.LENGTH
  c = sched.kv.prefix_cache
  assert c.evicted > 0 and c.hits > 0  # the budget forced evictions, and reuse still happened
  assert pool.pages_used == 0


def test_cancellations_and_preemption_with_the_cache():
  rng = random.Random(1)
  pool, sched, eng = _setup(pages=16, slots=4, step_tokens=12)
  base = [9] * 10
  reqs = [(rng.randrange(30), _req(f"r{i}", base + [i, i + 1], n=rng.randrange(3, 12), seed=i))
          for i in range(16)]
  for _, r in reqs:
    pass
  added = {}
  outs: dict[str, list[int]] = {}
  for step in range(3000):
    for t, r in reqs:
      if t == step:
        sched.add(r, RequestTrace(r.request_id))
        added[r.request_id] = r
    if step in (8, 15, 22):
      sched.cancel(f"r{step % 16}")
    if sched.idle and len(added) == len(reqs):
      break
    got = run_step(sched, eng)
    for o in got:
      outs.setdefault(o.request_id, []).extend(o.token_ids)
    pool.check()
    sched.kv.prefix_cache.check()
  for rid, r in added.items():  # cancelled ones: a prefix of the reference
    want = reference(list(r.prompt_ids), r.sampling.seed, r.stop.max_tokens, VOCAB)
    assert outs.get(rid, []) == want[:len(outs.get(rid, []))], rid
  assert pool.pages_used == 0 and sched.idle


def test_sharded_pools_go_to_the_shard_holding_the_prefix():
  pool, sched, eng = _setup(pages=32, shards=2)
  base = list(range(60, 73))
  outs, finals = _run(sched, eng, [(0, _req("a", base + [1], seed=1)),
                                   (10, _req("b", base + [2], seed=2)),
                                   (10, _req("c", list(range(100, 113)), seed=3))])
  for rid, p, sd in (("a", base + [1], 1), ("b", base + [2], 2), ("c", list(range(100, 113)), 3)):
    assert outs[rid] == reference(p, sd, 6, VOCAB)
  assert finals["b"].usage.cached_tokens == 12 and finals["c"].usage.cached_tokens == 0


def test_the_real_engine_gives_the_same_ids_with_the_cache_on_and_off():
  cfg = get_preset("tiny")
  params = init_params(cfg, jax.random.key(0), jnp.float32)
  tok = ByteTokenizer()
  base = list(range(40, 77))  # 37 tokens: 2 pages of 16
  prompts = [base + [i, i + 3] for i in range(4)] + [base + [0, 3]]
  runs = {}
  for on in (False, True):
    loop = stack.build(UnshardedStep(cfg, backend=NATIVE), params, tok, stack.ServingConfig(
        max_slots=4, page_size=16, kv_pages=32, max_chunk=32, max_prefill_chunks=2,
        max_context=128, prefix_cache=on))
    got: dict[str, list[int]] = {}
    finals = {}

    def cb(o):
      got.setdefault(o.request_id, []).extend(o.token_ids)
      if o.finished:
        finals[o.request_id] = o

    loop.submit(Request("r0", tuple(prompts[0]), stop=StopCriteria(8, ignore_eos=True)), cb)
    loop.run_until_idle()  # r0's pages are cached before the others arrive
    for i, p in enumerate(prompts[1:], start=1):
      loop.submit(Request(f"r{i}", tuple(p), stop=StopCriteria(8, ignore_eos=True)), cb)
    loop.run_until_idle()
    runs[on] = (got, {k: f.usage.cached_tokens for k, f in finals.items()})
    assert loop.scheduler.kv.pool.pages_used == 0
  assert runs[True][0] == runs[False][0]
  assert set(runs[False][1].values()) == {0}
  assert runs[True][1] == {"r0": 0, "r1": 32, "r2": 32, "r3": 32, "r4": 32}


def test_a_running_sequence_shares_its_prompt_as_soon_as_it_is_written():
  pool, sched, eng = _setup()
  base = list(range(20, 33))
  outs, finals = _run(sched, eng, [(0, _req("long", base + [1], n=30, seed=1)),
                                   (6, _req("next", base + [2], n=3, seed=2))])
  assert outs["next"] == reference(base + [2], 2, 3, VOCAB)
  assert outs["long"] == reference(base + [1], 1, 30, VOCAB)
  assert finals["next"].usage.cached_tokens == 12  # while "long" was still decoding


def test_1000_random_requests_with_shared_prefixes_cancels_and_evictions():
  """Every page is free, cached (the cache's alone, unlocked) or owned by a sequence, and the
  counts add up after every step; every output equals its reference (cancelled ones: a prefix
  of it); the cache evicted and hit along the way."""
  rng = random.Random(7)
  pool, sched, eng = _setup(pages=48, slots=6, step_tokens=24, chunk=8)
  prefixes = [[rng.randrange(256) for _ in range(rng.choice([4, 7, 12, 17]))] for _ in range(12)]
  arrivals: dict[int, list[Request]] = {}
  reqs = {}
  for i in range(1000):
    p = rng.choice(prefixes) + [rng.randrange(256) for _ in range(rng.randrange(0, 6))]
    r = _req(f"r{i}", p, n=rng.randrange(1, 9), seed=i)
    reqs[r.request_id] = r
    arrivals.setdefault(i // 3 + rng.randrange(3), []).append(r)
  outs: dict[str, list[int]] = {}
  cancels = 0
  for step in range(20000):
    for r in arrivals.pop(step, []):
      assert sched.add(r, RequestTrace(r.request_id)) is None
    if rng.random() < 0.05 and sched._running:
      sched.cancel(rng.choice(sched._running).req.request_id)
      cancels += 1
    if sched.idle and not arrivals:
      break
    got = run_step(sched, eng)
    for o in got:
      outs.setdefault(o.request_id, []).extend(o.token_ids)
    pool.check()
    sched.kv.prefix_cache.check()
    u = pool.usage()[0]
    assert u.used + u.cached + u.free == u.total
    locked_pages = {n.page for n in sched.kv.prefix_cache._walk(sched.kv.prefix_cache._roots[0])
                    if n.locks}
    owned = {p for s in pool.sequences for p in pool.table(s)}
    assert locked_pages <= owned  # a locked (reused) page always has a running owner
  else:
    raise AssertionError("not idle")
  for rid, r in reqs.items():
    want = reference(list(r.prompt_ids), r.sampling.seed, r.stop.max_tokens, VOCAB)
    assert outs.get(rid, []) == want[:len(outs.get(rid, []))], rid
  c = sched.kv.prefix_cache
  assert cancels > 20 and c.evicted > 50 and c.hits > 300
  assert pool.pages_used == 0 and pool.pages_cached + pool.pages_free == 48


def test_a_hit_is_a_shorter_prefill_in_the_trace():
  pool, sched, eng = _setup()
  base = list(range(10, 23))
  traces = {}
  for rid, suffix in (("a", [1]), ("b", [2])):
    r = _req(rid, base + suffix)
    traces[rid] = RequestTrace(rid)
    assert sched.add(r, traces[rid]) is None
    while not sched.idle:
      plan = sched.schedule()
      for c in plan.prefill:  # what ServingLoop records
        traces[c.request_id].record("prefill_start", f"{c.start}-{c.start + len(c.token_ids)}")
      res = eng.execute(plan)
      if res is not None:
        sched.update(res)
      if plan.empty:
        for x in eng.flush():
          sched.update(x)
  starts = lambda rid: [e.detail for e in traces[rid].events if e.kind == "prefill_start"]
  assert starts("a") == ["0-8", "8-14"] and starts("b") == ["12-14"]


def test_control_a_wrong_page_in_the_cache_changes_the_output(monkeypatch):
  """The comparisons above can fail: cache each block under its neighbour's page and the ids of
  a request reusing them differ from the reference."""
  original = PrefixCache.insert

  def shifted(self, tokens, pages, shard, ns=0):
    return original(self, tokens, list(pages[1:]) + list(pages[:1]), shard, ns)

  monkeypatch.setattr(PrefixCache, "insert", shifted)
  pool, sched, eng = _setup()
  base = list(range(30, 43))
  outs, _ = _run(sched, eng, [(0, _req("a", base + [1], seed=1)),
                              (20, _req("b", base + [2], seed=2))], check=False)
  assert outs["a"] == reference(base + [1], 1, 6, VOCAB)
  assert outs["b"] != reference(base + [2], 2, 6, VOCAB)


def _host_setup(pages=16, host_pages=32):
  from serving.host_tier import HostStore
  pool = PagePool(PageBudget(Z, pages), max_seq_tokens=64)
  store = HostStore()
  sched = Scheduler(pool, ByteTokenizer(), max_slots=3, max_step_tokens=16, max_chunk=8,
                    prefix_cache=PrefixCache(pool, host_pages=host_pages))
  return pool, sched, FakeEngine(pages, Z, VOCAB, 3, lag=1, host_store=store), store


def test_host_tier_round_trips_give_the_same_ids():
  """A device pool of 16 pages, a host tier of 32: conversations whose prefixes are pushed to
  the host by other traffic come back from it (device page scribbled at the spill, so a missed
  load would change the ids)."""
  rng = random.Random(4)
  pool, sched, eng, store = _host_setup()
  prefixes = [[rng.randrange(256) for _ in range(13)] for _ in range(6)]
  reqs = []
  for i in range(60):
    p = prefixes[i % 6] + [rng.randrange(256) for _ in range(rng.randrange(1, 4))]
    reqs.append((i * 6, _req(f"r{i}", p, n=4, seed=i)))
  outs, finals = _run(sched, eng, reqs)
  for _, r in reqs:
    assert outs[r.request_id] == reference(list(r.prompt_ids), r.sampling.seed, 4, VOCAB)
  c = sched.kv.prefix_cache
  assert c.spilled > 0 and c.loaded > 0 and c.host_hits > 0 and c.host_hit_tokens > 0
  assert len(store) == c.host_pages_used  # the store holds exactly the host nodes' pages
  assert c.host_pages_used <= 32


def test_host_tier_is_bounded_and_forgets_its_oldest():
  rng = random.Random(5)
  pool, sched, eng, store = _host_setup(pages=16, host_pages=4)
  reqs = [(i * 8, _req(f"r{i}", [rng.randrange(256) for _ in range(13)], n=3, seed=i))
          for i in range(30)]
  outs, _ = _run(sched, eng, reqs)
  for _, r in reqs:
    assert outs[r.request_id] == reference(list(r.prompt_ids), r.sampling.seed, 3, VOCAB)
  c = sched.kv.prefix_cache
  assert c.host_evicted > 0 and c.host_pages_used <= 4 and len(store) == c.host_pages_used


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_the_real_engine_with_host_tier_round_trips(kv_dtype):
  """Tiny model, a device pool of 10 pages of 16: other traffic pushes a shared prefix to the
  host tier and it comes back for the requests that reuse it; the greedy ids equal a run with
  no cache at all (and a big pool). Also over an int8 pool (values and scales move together;
  quantization is deterministic, so a lost or misplaced scale would change the ids)."""
  cfg = get_preset("tiny")
  params = init_params(cfg, jax.random.key(0), jnp.float32)
  tok = ByteTokenizer()
  rng = random.Random(2)
  base = list(range(40, 77))  # 37 tokens: 2 whole pages
  waves = [[base + [1, 4]],
           [[rng.randrange(256) for _ in range(40)] for _ in range(4)],  # evicts base's pages
           [base + [i, i + 3] for i in range(2, 5)]]
  runs = {}
  for name, pages, host in (("plain", 64, 0), ("tiered", 10, 1 << 20)):
    loop = stack.build(UnshardedStep(cfg, backend=NATIVE), params, tok, stack.ServingConfig(
        max_slots=2, page_size=16, kv_pages=pages, max_chunk=32, max_prefill_chunks=1,
        max_context=64, prefix_cache=host > 0, host_tier_bytes=host, kv_dtype=kv_dtype))
    got: dict[str, list[int]] = {}
    k = 0
    for wave in waves:
      for p in wave:
        loop.submit(Request(f"r{k}", tuple(p), stop=StopCriteria(6, ignore_eos=True)),
                    lambda o: got.setdefault(o.request_id, []).extend(o.token_ids))
        k += 1
      loop.run_until_idle()
    runs[name] = got
    if host:
      c = loop.scheduler.kv.prefix_cache
      assert c.spilled > 0 and c.loaded >= 2 and c.host_hits >= 1, (
          c.spilled, c.loaded, c.evicted, c.host_capacity, loop.scheduler.kv.pool.pages_cached)
      loop.scheduler.kv.pool.check()
      c.check()
      store = loop.engine.host_store  # a host entry is exactly a page's bytes (int8: + scales)
      store.materialize()
      assert len(store) and store.nbytes == len(store) * page_bytes(cfg, 16, kv_dtype)
  assert runs["tiered"] == runs["plain"]


def test_spilled_pages_leave_the_device_at_the_next_step_whatever_it_plans():
  """The real engine: a step that spills starts the device -> host copies; the next step,
  though it plans no spill, forget or load, finishes them (host arrays, device buffers
  dropped), so a spill holds device memory for one step only."""
  from serving.engine import Engine, EngineConfig
  from serving.host_tier import HostStore
  from serving.prefix_cache import PageSpill
  from serving.scheduler import StepPlan
  cfg = get_preset("tiny")
  params = init_params(cfg, jax.random.key(0), jnp.float32)
  store = HostStore()
  eng = Engine(UnshardedStep(cfg, backend=NATIVE), params, EngineConfig(
      max_slots=2, num_pages=8, page_size=16, max_seq_tokens=64), host_store=store)
  table = np.full((2, eng.config.pages_per_seq), 8, np.int32)
  eng.execute(StepPlan(0, (), (), (), table, spills=(PageSpill(1, 7), PageSpill(2, 8))))
  assert store.pending == 2 and len(store) == 2
  eng.execute(StepPlan(1, (), (), (), table))  # nothing for the host tier
  assert store.pending == 0 and len(store) == 2
  assert store.nbytes == 2 * page_bytes(cfg, 16, "float32")
  eng.execute(StepPlan(2, (), (), (), table))
  assert store.pending == 0 and 7 in store and 8 in store


def test_a_full_shard_copies_the_prefix_into_another():
  pool, sched, eng = _setup(pages=16, shards=2)
  base = list(range(60, 73))  # 3 whole pages of 4
  outs, _ = _run(sched, eng, [(0, _req("a", base + [1], n=2, seed=1))])
  home = sched.kv.prefix_cache.best_shard(base + [2])
  free = pool.usage()[home].free
  assert pool.allocate("filler", free * Z, shard=home) is None  # the home shard is now full
  sched.kv.prefix_cache.lock(sched.kv.prefix_cache.match(base + [1], home, count=False))  # keep them
  outs, finals = _run(sched, eng, [(0, _req("b", base + [2], n=5, seed=2))], check=False)
  assert outs["b"] == reference(base + [2], 2, 5, VOCAB)
  assert finals["b"].usage.cached_tokens == 12 and sched.kv.prefix_copied_pages == 3
  assert eng.copied == 3  # the engine ran the three page copies


def test_the_copy_path_is_checked_by_the_output(monkeypatch):
  """Control: a copy that does not happen (the fake engine skips it) changes b's ids."""
  pool, sched, eng = _setup(pages=16, shards=2)
  base = list(range(60, 73))
  _run(sched, eng, [(0, _req("a", base + [1], n=2, seed=1))])
  home = sched.kv.prefix_cache.best_shard(base + [2])
  assert pool.allocate("filler", pool.usage()[home].free * Z, shard=home) is None
  sched.kv.prefix_cache.lock(sched.kv.prefix_cache.match(base + [1], home, count=False))
  monkeypatch.setattr(type(eng), "_copy", lambda self, c: None)
  outs, _ = _run(sched, eng, [(0, _req("b", base + [2], n=5, seed=2))], check=False)
  assert outs["b"] != reference(base + [2], 2, 5, VOCAB)


def _mixed_run(seed: int, shards: int, host: int, sessions_on: bool, n: int = 400) -> None:
  """One random run over everything the cache meets: sub-pools, the host tier, pinned sessions,
  priorities, cancellations, a tight pool and lagged results; invariants after every step and
  every output against the reference (a sequence reading a page the cache gave away, spilled or
  reloaded wrongly reads different ids)."""
  from serving.host_tier import HostStore
  from serving.sessions import SessionPolicy, Sessions
  rng = random.Random(seed)
  clock = [0.0]
  pages = 32
  pool = PagePool(PageBudget(Z, pages // shards, shards), max_seq_tokens=48)
  cache = PrefixCache(pool, host_pages=host)
  sessions = (Sessions(cache, SessionPolicy(rng.choice([5.0, 50.0]), 6), lambda: clock[0])
              if sessions_on else None)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=5, max_step_tokens=rng.choice([8, 16, 24]),
                    max_chunk=rng.choice([4, 8]), prefix_cache=cache, sessions=sessions,
                    max_prefill_chunks=2)
  engine = FakeEngine(pages, Z, VOCAB, 5, lag=1, host_store=HostStore())
  prefixes = [[rng.randrange(256) for _ in range(rng.choice([4, 7, 12, 17]))] for _ in range(6)]
  reqs, arrivals = {}, {}
  for i in range(n):
    prompt = rng.choice(prefixes) + [rng.randrange(256) for _ in range(rng.randrange(0, 6))]
    r = Request(f"r{i}", tuple(prompt), SamplingParams(seed=i),
                StopCriteria(max_tokens=rng.randrange(1, 12), ignore_eos=True),
                priority=rng.randrange(2), session_id=rng.choice(["", "", "s1", "s2"]))
    reqs[r.request_id] = r
    arrivals.setdefault(i // 2 + rng.randrange(3), []).append(r)
  outs, finals = {}, {}
  for step in range(20_000):
    clock[0] += 0.5
    for r in arrivals.pop(step, []):
      assert sched.add(r, RequestTrace(r.request_id)) is None
    if rng.random() < 0.05 and sched._seqs:
      sched.cancel(rng.choice(sorted(sched._seqs)))
    if sched.idle and not arrivals:
      break
    for o in run_step(sched, engine):
      outs.setdefault(o.request_id, []).extend(o.token_ids)
      if o.finished:
        finals[o.request_id] = o
    pool.check()
    cache.check()
  else:
    raise AssertionError(f"not idle: {sched.num_waiting} waiting, {sched.num_running} running")
  for res in engine.flush():
    sched.update(res)
  for rid, r in reqs.items():
    want = reference(list(r.prompt_ids), r.sampling.seed, r.stop.max_tokens, VOCAB)
    got = outs.get(rid, [])
    assert got == want[:len(got)] and rid in finals, rid
  assert pool.pages_used == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shards,host,sessions_on", [(2, 6, True), (2, 6, False), (1, 6, True),
                                                     (2, 0, True)])
def test_random_runs_with_shards_host_tier_and_sessions(seed, shards, host, sessions_on):
  _mixed_run(seed, shards, host, sessions_on)
