"""serving.scheduler over the hand-checkable FakeEngine: continuous batching, chunked prefill,
preemption under a small page budget, cancellations, rejections, priorities, lagged results."""

from __future__ import annotations

import numpy as np
import pytest

from models.text.tokenizer import ByteTokenizer
from serving.fake_engine import FakeEngine, reference
from serving.kv_pages import PageBudget, PagePool
from serving.lifecycle import RequestTrace
from serving.request import Request
from serving.sampling import SamplingParams
from serving.scheduler import Scheduler
from serving.stop import FinishReason, StopCriteria

VOCAB = ByteTokenizer.VOCAB_SIZE  # the fake engine's ids include EOS (257): natural stops
EOS = ByteTokenizer.EOS


def _setup(pages=24, page_size=4, slots=6, step_tokens=16, chunk=8, max_waiting=2000, lag=0,
           max_seq=96):
  pool = PagePool(PageBudget(page_size, pages), max_seq_tokens=max_seq)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=slots, max_step_tokens=step_tokens,
                    max_chunk=chunk, max_waiting=max_waiting)
  return pool, sched, FakeEngine(pages, page_size, VOCAB, slots, lag=lag)


def _expected(req: Request) -> list[int]:
  ids = reference(list(req.prompt_ids), req.sampling.seed, req.stop.max_tokens, VOCAB)
  for i, t in enumerate(ids):
    if t == EOS and i + 1 > req.stop.min_tokens:
      return ids[:i + 1]
  return ids


def _drive(sched, engine, pool, cancel_at=None, rng=None, max_steps=100_000):
  """Runs to idle, checking the pool's invariants after every step; cancels at random."""
  outs = []
  pending_cancel = dict(cancel_at or {})
  for step in range(max_steps):
    outs += sched.drain_outputs()
    if sched.idle:
      return outs, step
    for rid, at in list(pending_cancel.items()):
      if at <= step:
        sched.cancel(rid)
        del pending_cancel[rid]
    plan = sched.schedule()
    pool.check()
    assert pool.pages_used <= pool.budget.num_pages
    outs += sched.drain_outputs()
    res = engine.execute(plan)
    if res is not None:
      outs += sched.update(res)
  raise AssertionError("did not finish")


def _collect(outs):
  by_id: dict[str, list[int]] = {}
  final = {}
  for o in outs:
    assert o.request_id not in final, f"output after the end for {o.request_id}"
    by_id.setdefault(o.request_id, []).extend(o.token_ids)
    if o.finished:
      final[o.request_id] = o
  return by_id, final


@pytest.mark.parametrize("lag", [0, 1])
def test_thousand_random_requests(lag):
  rng = np.random.default_rng(lag)
  pool, sched, engine = _setup(lag=lag)
  reqs, cancel_at = [], {}
  for i in range(1000):
    plen = int(rng.integers(1, 30))
    req = Request(f"r{i}", tuple(int(t) for t in rng.integers(0, 256, plen)),
                  SamplingParams(seed=int(rng.integers(0, 2**32))),
                  StopCriteria(max_tokens=int(rng.integers(1, 40)),
                               min_tokens=int(rng.integers(0, 2))),
                  priority=int(rng.integers(0, 3)))
    reqs.append(req)
    if rng.random() < 0.15:
      cancel_at[req.request_id] = int(rng.integers(0, 3000))
  traces = {r.request_id: RequestTrace(r.request_id) for r in reqs}
  for req in reqs:
    assert sched.add(req, traces[req.request_id]) is None
  outs, steps = _drive(sched, engine, pool, cancel_at, rng)
  by_id, final = _collect(outs)
  assert set(final) == {r.request_id for r in reqs}  # none lost, none duplicated
  n_cancelled = 0
  for req in reqs:
    got, want, o = by_id.get(req.request_id, []), _expected(req), final[req.request_id]
    if o.finish_reason == FinishReason.CANCELLED:
      n_cancelled += 1
      assert got == want[:len(got)]
    else:
      assert got == want, req.request_id
      assert o.finish_reason == (FinishReason.STOP if want[-1] == EOS and
                                 len(want) > req.stop.min_tokens else FinishReason.LENGTH)
    assert o.usage.completion_tokens == len(got)
  assert n_cancelled > 50
  assert pool.pages_used == 0 and sched.num_running == 0 and sched.num_waiting == 0
  assert all(not r.tokens for r in engine.flush())  # nothing left in flight
  assert sum(e.kind == 'preempted' for t in traces.values() for e in t.events) > 0


def test_long_prompts_that_fill_the_pool_together_do_not_deadlock():
  """Two prompts, each fitting the pool alone, admitted together: chunk by chunk they take the
  whole pool with neither done. The earlier one preempts the later (still in its prompt), which
  is recomputed after: both finish with the reference tokens."""
  pool, sched, engine = _setup(pages=4, page_size=4, slots=4, step_tokens=8, chunk=4, max_seq=16)
  reqs = [Request(rid, tuple(range(base, base + 12)), SamplingParams(seed=1),
                  StopCriteria(max_tokens=2, ignore_eos=True)) for rid, base in (("a", 10), ("b", 50))]
  traces = {r.request_id: RequestTrace(r.request_id) for r in reqs}
  for r in reqs:
    assert sched.add(r, traces[r.request_id]) is None
  outs, steps = _drive(sched, engine, pool, max_steps=200)
  by_id, final = _collect(outs)
  for r in reqs:
    assert by_id[r.request_id] == reference(list(r.prompt_ids), 1, 2, VOCAB)
  assert [e.kind for e in traces["b"].events].count("preempted") >= 1
  assert [e.kind for e in traces["a"].events].count("preempted") == 0


@pytest.mark.parametrize("lag", [0, 1])
def test_random_long_prompts_on_a_small_pool_all_finish(lag):
  """Prompts up to the pool's size, chunked, mixed priorities: nothing waits forever."""
  rng = np.random.default_rng(10 + lag)
  pool, sched, engine = _setup(pages=12, page_size=4, slots=4, step_tokens=12, chunk=4,
                               max_seq=48, lag=lag)
  reqs = []
  for i in range(60):
    plen = int(rng.integers(8, 40))
    reqs.append(Request(f"L{i}", tuple(int(t) for t in rng.integers(0, 256, plen)),
                        SamplingParams(seed=i),
                        StopCriteria(max_tokens=int(rng.integers(1, 48 - plen + 1)),
                                     ignore_eos=True),
                        priority=int(rng.integers(0, 2))))
  for r in reqs:
    assert sched.add(r, RequestTrace(r.request_id)) is None
  outs, _ = _drive(sched, engine, pool, max_steps=20_000)
  by_id, final = _collect(outs)
  for r in reqs:
    assert by_id[r.request_id] == reference(list(r.prompt_ids), r.sampling.seed,
                                            r.stop.max_tokens, VOCAB), r.request_id
  assert pool.pages_used == 0 and sched.num_running == 0


def test_preemption_recomputes_the_same_tokens():
  pool, sched, engine = _setup(pages=10, page_size=4, slots=4, step_tokens=32, chunk=16)
  reqs = [Request(f"p{i}", tuple(range(1 + i, 13 + i)), SamplingParams(seed=i),
                  StopCriteria(max_tokens=20, ignore_eos=True)) for i in range(4)]
  traces = {r.request_id: RequestTrace(r.request_id) for r in reqs}
  for r in reqs:
    sched.add(r, traces[r.request_id])
  outs, _ = _drive(sched, engine, pool)
  by_id, final = _collect(outs)
  for r in reqs:
    assert by_id[r.request_id] == reference(list(r.prompt_ids), r.sampling.seed, 20, VOCAB)
  kinds = [e.kind for t in traces.values() for e in t.events]
  assert kinds.count("preempted") >= 1 and kinds.count("resumed") == kinds.count("preempted")


def test_rejections_at_arrival():
  pool, sched, engine = _setup(pages=4, page_size=4, max_waiting=2, max_seq=64)
  too_long = Request("long", tuple(range(60)), stop=StopCriteria(max_tokens=10))
  out = sched.add(too_long, RequestTrace("long"))
  assert out.finish_reason == FinishReason.REJECTED and "context" in out.message
  never_fits = Request("big", tuple(range(20)), stop=StopCriteria(max_tokens=10))  # 8 pages > 4
  out = sched.add(never_fits, RequestTrace("big"))
  assert out.finish_reason == FinishReason.REJECTED and out.message
  for i in range(2):
    assert sched.add(Request(f"ok{i}", (1, 2), stop=StopCriteria(max_tokens=4)),
                     RequestTrace(f"ok{i}")) is None
  out = sched.add(Request("full", (1, 2), stop=StopCriteria(max_tokens=4)), RequestTrace("full"))
  assert out.finish_reason == FinishReason.REJECTED and "queue is full" in out.message
  with pytest.raises(ValueError):
    sched.add(Request("ok0", (1,)), RequestTrace("dup"))


def test_cancel_frees_pages_before_the_next_step():
  pool, sched, engine = _setup()
  sched.add(Request("a", tuple(range(10)), stop=StopCriteria(max_tokens=30, ignore_eos=True)),
            RequestTrace("a"))
  for _ in range(3):
    sched.update(engine.execute(sched.schedule()))
  assert pool.pages_used > 0
  sched.cancel("a")
  plan = sched.schedule()
  assert pool.pages_used == 0 and plan.empty
  outs = sched.drain_outputs()
  assert [o.finish_reason for o in outs] == [FinishReason.CANCELLED]


def test_priority_then_fcfs_and_chunked_prefill_budget():
  pool, sched, engine = _setup(slots=1, step_tokens=8, chunk=8)
  sched.add(Request("low", tuple(range(20)), priority=2), RequestTrace("low"))
  sched.add(Request("high", tuple(range(20)), priority=0), RequestTrace("high"))
  plan = sched.schedule()
  assert [c.request_id for c in plan.prefill] == ["high"]
  assert plan.num_tokens == 8 and not plan.prefill[0].sample
  sched.update(engine.execute(plan))
  plan = sched.schedule()
  assert [(c.start, len(c.token_ids)) for c in plan.prefill] == [(8, 8)]


def test_chunks_never_exceed_the_step_budget_and_decodes_come_first():
  pool, sched, engine = _setup(pages=64, slots=4, step_tokens=10, chunk=8, max_seq=200)
  for i in range(4):
    sched.add(Request(f"s{i}", tuple(range(3 + 9 * i)),
                      stop=StopCriteria(max_tokens=12, ignore_eos=True)), RequestTrace(f"s{i}"))
  while not sched.idle:
    plan = sched.schedule()
    assert plan.num_tokens <= 10
    decoding = {r.request_id for r in plan.decode}
    assert not decoding & {c.request_id for c in plan.prefill}
    sched.update(engine.execute(plan))
