"""Speculative decoding in the scheduler and the page pool, over the fake engine.

The fake engine accepts a draft id where it is the id it computes there (``serving.fake_engine``),
so an oracle proposer (the fake engine's own continuation, with every third proposal corrupted at
its second id) exercises acceptance, partial acceptance and rollback; every request must still
get exactly the reference ids, EOS and max_tokens honoured mid-acceptance, pages consistent
after every step and all freed at the end.
"""

from __future__ import annotations

import numpy as np
import pytest

from models.text.tokenizer import ByteTokenizer
from serving.fake_engine import FakeEngine, next_id, reference
from serving.kv_pages import PageBudget, PagePool
from serving.lifecycle import RequestTrace
from serving.request import Request
from serving.sampling import SamplingParams
from serving.scheduler import Scheduler
from serving.speculative import ContextProposer, DraftQuery, NgramProposer, speculable
from serving.stop import FinishReason, StopCriteria

VOCAB = ByteTokenizer.VOCAB_SIZE
EOS = ByteTokenizer.EOS
SEED = 7


def test_ngram_proposes_what_followed_the_longest_suffix_latest():
  p = NgramProposer(k=3, max_n=3)
  # suffix [1, 2, 3] occurred at 0 (followed by 9, 9) and [2, 3] at 5 (followed by 4): longest
  assert p.propose([1, 2, 3, 9, 9, 2, 3, 4, 1, 2, 3], 3) == (9, 9, 2)
  # only [3] recurs: its latest earlier occurrence is followed by 5, 3
  assert p.propose([3, 7, 3, 5, 3], 3) == (5, 3)
  assert p.propose([1, 2, 3], 3) == ()  # nothing recurs
  assert p.propose([5, 6, 5, 6, 5, 6], 2) == (5, 6)  # k caps the proposal
  assert p.propose([4, 4], 0) == ()
  assert NgramProposer(k=2, min_n=2).propose([3, 7, 3, 5, 3], 2) == ()  # one id is too short
  assert p.propose(list(range(10)) * 3, 3) == (0, 1, 2)  # the latest occurrence, near the end
  with pytest.raises(ValueError):
    NgramProposer(k=0)


def test_ngram_copy_pointer_prefers_the_occurrence_after_the_last_copy():
  """A rewrite copies its source in order: once a proposal copied from source index s and the
  target took a ids of it, the next lookup prefers the first occurrence continuing at s + a or
  later over the latest one; a new key, or one forgotten, starts from the latest."""
  src = [10, 1, 11, 12, 1, 13, 14, 1, 15, 16]  # id 1 recurs: followed by 11, 13, 15
  p = NgramProposer(k=2, max_n=1)
  assert p.propose(src + [1], 2) == (15, 16)  # no pointer: the latest occurrence
  assert p.propose(src + [1], 2, after=2) == (11, 12)
  assert p.propose(src + [1], 2, after=3) == (13, 14)
  ctx = src + [10]  # the rewrite starts: 10 is followed by 1, 11 in the source (index 1)
  assert p.draft([DraftQuery("r", ctx, 2)]) == [(1, 11)]
  ctx = ctx + [1, 11, 12]  # both accepted, then the target's own 12: the pointer passes 11, 12
  ctx = ctx + [1]
  # Two ids appended since the proposal that copied from index 1 ([1, 11] accepted) -- the
  # context grew by 4, the first 2 equal the proposal: pointer at 1 + 2 = 3.
  assert p.draft([DraftQuery("r", ctx, 2)]) == [(13, 14)]
  # No pointer: the latest occurrence, the rewrite's own 1 (index 11), followed by 11, 12.
  assert p.draft([DraftQuery("other", ctx, 2)]) == [(11, 12)]
  p.forget("r")
  assert p.draft([DraftQuery("r", ctx, 2)]) == [(11, 12)]


def test_ngram_suffixes_shorter_than_min_n_count_only_just_ahead_of_the_copy():
  from serving.speculative import NEAR
  src = [10, 1, 11, 12, 1, 13, 14] + [20 + i for i in range(2 * NEAR)] + [1, 15]
  p = NgramProposer(k=2, min_n=2, max_n=3)
  assert p.propose(src + [1], 2) == ()  # one id, no pointer: too short to trust
  assert p.propose(src + [1], 2, after=3) == (13, 14)  # just ahead of the pointer
  assert p.propose(src + [1], 2, after=6) == ()  # the next 1 is more than NEAR ids ahead
  assert p.propose(src + [14, 20], 2, after=0) == (21, 22)  # two ids: trusted anywhere


def test_word_skip_resumes_the_copy_after_an_edited_word():
  """ByteTokenizer: one id a byte, so a word is its bytes and a space starts the next. The
  source says "the cat sat"; the target copied "the c", then wrote its own word ("dog"): no
  suffix recurs, so the copy resumes at the source's next word start, " sat". A sequence whose
  drafts were mostly rejected does not skip; without ``word_start`` there is no skip."""
  from models.text.tokenizer import ByteTokenizer
  from serving.speculative import word_starts
  tok = ByteTokenizer()
  ws = word_starts(tok)
  assert ws[ord(" ")] and ws[ord(".")] and not ws[ord("a")]
  src = tok.encode("the cat sat.")
  p = NgramProposer(k=4, min_n=2, max_n=3, word_start=ws)
  ctx = src + tok.encode("\nthe")
  (d,) = p.draft([DraftQuery("r", ctx, 4)])
  assert bytes(d) == b" cat"  # the suffix "the" recurs: copied from the source
  ctx = ctx + tok.encode(" cQ")  # " c" accepted, then the target's own "Q"
  (d,) = p.draft([DraftQuery("r", ctx, 4)])
  assert bytes(d) == b" sat"  # no suffix "cQ" anywhere: the word skip
  plain = NgramProposer(k=4, min_n=2, max_n=3)
  plain.draft([DraftQuery("r", src + tok.encode("\nthe"), 4)])
  assert plain.draft([DraftQuery("r", ctx, 4)]) == [()]
  doubtful = NgramProposer(k=4, min_n=2, max_n=3, word_start=ws)
  for _ in range(8):  # proposals rejected at their first id, again and again
    doubtful.draft([DraftQuery("r", src + tok.encode("\nthe"), 4)])
  assert doubtful.draft([DraftQuery("r", ctx, 4)]) == [()]


def test_speculable_leaves_out_what_the_verify_call_does_not_compute():
  ok = Request("a", (1,), SamplingParams(temperature=0.7, top_p=0.9))
  assert speculable(ok)
  assert not speculable(Request("b", (1,), speculate=False))
  assert not speculable(Request("c", (1,), SamplingParams(logprobs=2)))
  assert not speculable(Request("d", (1,), SamplingParams(presence_penalty=0.5)))
  assert not speculable(Request("e", (1,), SamplingParams(logit_bias=((3, 5.0),))))


def test_shrink_frees_the_pages_that_empty():
  pool = PagePool(PageBudget(4, 8), max_seq_tokens=32)
  pool.allocate("s", 6)
  assert pool.extend("s", 7) is None  # 13 positions: 4 pages
  assert len(pool.table("s")) == 4
  freed = pool.shrink("s", 9)  # 3 pages hold 9
  assert len(freed) == 1 and len(pool.table("s")) == 3 and pool.tokens("s") == 9
  pool.check()
  assert pool.shrink("s", 9) == []
  with pytest.raises(ValueError):
    pool.shrink("s", 10)


class _Oracle(ContextProposer):
  """Proposes the fake engine's own continuation (seed ``SEED``); every third call corrupts
  its second id, so some rows accept one id, others all."""
  k = 4

  def __init__(self):
    self.calls = 0

  def propose(self, tokens, k):
    self.calls += 1
    ctx, out = list(tokens), []
    for _ in range(min(k, self.k)):
      out.append(next_id(ctx, SEED, VOCAB))
      ctx.append(out[-1])
    if self.calls % 3 == 0 and len(out) > 1:
      out[1] = (out[1] + 1) % VOCAB
    return tuple(out)


def _expected(req):
  ids = reference(list(req.prompt_ids), SEED, req.stop.max_tokens, VOCAB)
  for i, t in enumerate(ids):
    if t == EOS and i + 1 > req.stop.min_tokens:
      return ids[:i + 1]
  return ids


@pytest.mark.parametrize("lag", [0, 1])
def test_random_requests_with_drafts_get_the_reference_ids(lag):
  rng = np.random.default_rng(3 + lag)
  pages, z, slots = 40, 4, 6
  pool = PagePool(PageBudget(z, pages), max_seq_tokens=96)
  proposer = _Oracle()
  sched = Scheduler(pool, ByteTokenizer(), max_slots=slots, max_step_tokens=16, max_chunk=8,
                    proposer=proposer, spec_max_rows=4)
  engine = FakeEngine(pages, z, VOCAB, slots, lag=lag)
  reqs, cancel_at = [], {}
  for i in range(300):
    req = Request(f"r{i}", tuple(int(t) for t in rng.integers(0, 256, int(rng.integers(1, 30)))),
                  SamplingParams(seed=SEED, logprobs=2 if i % 10 == 0 else 0),
                  StopCriteria(max_tokens=int(rng.integers(1, 40)),
                               min_tokens=int(rng.integers(0, 2))),
                  priority=int(rng.integers(0, 3)), speculate=i % 7 != 0)
    reqs.append(req)
    if rng.random() < 0.1:
      cancel_at[req.request_id] = int(rng.integers(0, 600))
    assert sched.add(req, RequestTrace(req.request_id)) is None
  outs = []
  for step in range(20_000):
    outs += sched.drain_outputs()
    if sched.idle:
      break
    for rid, at in list(cancel_at.items()):
      if at <= step:
        sched.cancel(rid)
        del cancel_at[rid]
    plan = sched.schedule()
    pool.check()
    for row in plan.decode:
      if row.draft:  # only rows that may speculate carry drafts, within max_tokens
        req = next(r for r in reqs if r.request_id == row.request_id)
        assert speculable(req)
    outs += sched.drain_outputs()
    res = engine.execute(plan)
    if res is not None:
      outs += sched.update(res)
    pool.check()
    if lag == 0:  # every result is in: a sequence holds exactly the positions it has written
      for rid in pool.sequences:
        seq = sched._seqs[rid]
        assert pool.tokens(rid) == seq.computed, rid
        if seq.decoding and seq.generated:  # its last id's KV: written by the next step
          assert seq.computed == len(seq.tokens) - 1, rid
  else:
    raise AssertionError("did not finish")
  got: dict[str, list[int]] = {}
  final = {}
  for o in outs:
    assert o.request_id not in final
    got.setdefault(o.request_id, []).extend(o.token_ids)
    if o.finished:
      final[o.request_id] = o
  assert set(final) == {r.request_id for r in reqs}
  for r in reqs:
    ids, want, o = got.get(r.request_id, []), _expected(r), final[r.request_id]
    if o.finish_reason == FinishReason.CANCELLED:
      assert ids == want[:len(ids)]
    else:
      assert ids == want, r.request_id
    assert o.usage.completion_tokens == len(ids)
  assert pool.pages_used == 0 and sched.num_running == 0
  counts = sched.spec
  if lag == 0:  # with lag 1 a sequence's last id is in flight when it is planned: no drafts
    assert counts.drafts > 100
    assert 0 < counts.accepted_tokens < counts.draft_tokens
    assert counts.accepted_per_pos[0] >= counts.accepted_per_pos[1] > counts.accepted_per_pos[2]
  assert sum(counts.accepted_per_pos) == counts.accepted_tokens


def test_a_draft_that_runs_past_eos_stops_at_eos():
  """The oracle proposes past EOS; the request ends at EOS, and the positions after it are given
  back with the sequence."""
  pool = PagePool(PageBudget(4, 16), max_seq_tokens=64)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=2, max_step_tokens=16, max_chunk=16,
                    proposer=_Oracle())
  engine = FakeEngine(16, 4, VOCAB, 2)
  # a prompt whose continuation under SEED hits EOS within 40 ids
  rng = np.random.default_rng(0)
  for _ in range(5000):
    prompt = [int(t) for t in rng.integers(0, 256, 5)]
    ids = reference(prompt, SEED, 40, VOCAB)
    if EOS in ids[2:]:
      break
  req = Request("e", tuple(prompt), SamplingParams(seed=SEED), StopCriteria(max_tokens=40))
  assert sched.add(req, RequestTrace("e")) is None
  outs = []
  while not sched.idle:
    outs += sched.drain_outputs()
    outs += sched.update(engine.execute(sched.schedule()))
  outs += sched.drain_outputs()
  got = [t for o in outs for t in o.token_ids]
  assert got == ids[:ids.index(EOS) + 1]
  assert outs[-1].finish_reason == FinishReason.STOP
  assert sched.spec.drafts > 0 and pool.pages_used == 0


class _Failing(_Oracle):
  """Raises on its fourth call."""

  def draft(self, queries):
    if self.calls == 3:
      self.calls += 1
      raise RuntimeError("draft engine fault")
    return super().draft(queries)


def test_a_failing_proposer_costs_only_its_drafts():
  """The proposer raising mid-run: the step decodes without drafts, speculation is off for the
  scheduler from then on, every request still gets its reference ids."""
  pool = PagePool(PageBudget(4, 40), max_seq_tokens=96)
  proposer = _Failing()
  sched = Scheduler(pool, ByteTokenizer(), max_slots=3, max_step_tokens=16, max_chunk=8,
                    proposer=proposer)
  engine = FakeEngine(40, 4, VOCAB, 3, lag=0)
  reqs = [Request(f"f{i}", (10 + i, 20, 30 + i), SamplingParams(seed=SEED),
                  StopCriteria(max_tokens=12, ignore_eos=True)) for i in range(3)]
  for r in reqs:
    assert sched.add(r, RequestTrace(r.request_id)) is None
  got: dict[str, list[int]] = {}
  for _ in range(200):
    if sched.idle:
      break
    for o in sched.drain_outputs() + sched.update(engine.execute(sched.schedule())):
      got.setdefault(o.request_id, []).extend(o.token_ids)
  for o in sched.drain_outputs():
    got.setdefault(o.request_id, []).extend(o.token_ids)
  assert sched.spec.failures == 1 and sched.proposer is None and sched.spec.drafts > 0
  for r in reqs:
    assert got[r.request_id] == reference(list(r.prompt_ids), SEED, 12, VOCAB), r.request_id


def test_synchronous_only_while_few_rows_decode_and_one_may_draft():
  """The driver flushes a lagged engine only while drafting can happen: at most
  ``spec_max_rows`` sequences decoding, at least one of them speculable."""
  def sched_with(reqs, proposer=NgramProposer(k=2)):
    pool = PagePool(PageBudget(4, 64), max_seq_tokens=64)
    s = Scheduler(pool, ByteTokenizer(), max_slots=4, max_step_tokens=64, max_chunk=16,
                  proposer=proposer, spec_max_rows=2)
    for r in reqs:
      assert s.add(r, RequestTrace(r.request_id)) is None
    s.schedule()  # every prompt in one step: all decode from now on
    return s

  greedy = lambda i: Request(f"g{i}", (1, 2, 3), stop=StopCriteria(max_tokens=8))
  penalised = Request("p", (1, 2, 3), SamplingParams(presence_penalty=0.5),
                      StopCriteria(max_tokens=8))
  assert sched_with([greedy(0)]).synchronous
  assert sched_with([greedy(0), penalised]).synchronous
  assert not sched_with([penalised]).synchronous  # nothing may draft: keep the lag
  assert not sched_with([greedy(0), greedy(1), greedy(2)]).synchronous  # over spec_max_rows
  assert not sched_with([greedy(0)], proposer=None).synchronous
