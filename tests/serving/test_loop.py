"""serving.loop: a cancel that reaches the loop before its request is admitted is not lost."""

from __future__ import annotations

from models.text.tokenizer import ByteTokenizer
from serving.fake_engine import FakeEngine, reference
from serving.kv_pages import PageBudget, PagePool
from serving.loop import ServingLoop
from serving.request import Request
from serving.sampling import SamplingParams
from serving.scheduler import Scheduler
from serving.stop import FinishReason, StopCriteria

VOCAB = ByteTokenizer.VOCAB_SIZE


def _request(rid: str, seed: int) -> Request:
  return Request(rid, (1 + seed, 2, 3), SamplingParams(seed=seed),
                 StopCriteria(max_tokens=20, ignore_eos=True))


def test_cancel_between_admission_and_planning_ends_the_request():
  """A handler thread submits and its client cancels at once, both after the loop's admission
  of this step and before its plan (forced here by wrapping ``schedule``): the scheduler does not
  know the id yet, so the loop keeps the cancel and applies it at the next admission."""
  pool = PagePool(PageBudget(4, 32), max_seq_tokens=64)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=4, max_step_tokens=16, max_chunk=8)
  loop = ServingLoop(sched, FakeEngine(32, 4, VOCAB, 4, lag=1))
  outs: dict[str, list] = {}
  on = lambda rid: (lambda o: outs.setdefault(rid, []).append(o))
  loop.submit(_request("a", 1), on("a"))
  plan = sched.schedule

  def interleaved():
    if "b" not in loop.traces and "b" not in outs:
      loop.submit(_request("b", 2), on("b"))
      loop.cancel("b")
    return plan()

  sched.schedule = interleaved
  loop.run_until_idle()
  (b,) = outs["b"]
  assert b.finish_reason is FinishReason.CANCELLED and not b.token_ids
  assert b.usage.prompt_tokens == 3 and b.usage.completion_tokens == 0
  assert [e.kind for e in loop.traces["b"].events] == ["arrival", "finished"]
  a_ids = [t for o in outs["a"] for t in o.token_ids]
  assert a_ids == reference([2, 2, 3], 1, 20, VOCAB)  # the other request is untouched
  assert pool.pages_used == 0 and sched.idle
  assert not loop._arriving and not loop._cancelled_early  # nothing kept for later


def test_cancel_after_the_end_keeps_nothing():
  pool = PagePool(PageBudget(4, 32), max_seq_tokens=64)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=4, max_step_tokens=16, max_chunk=8)
  loop = ServingLoop(sched, FakeEngine(32, 4, VOCAB, 4, lag=0))
  outs: list = []
  loop.submit(_request("a", 1), outs.append)
  loop.run_until_idle()
  loop.cancel("a")  # a late cancel (the client went away after the end)
  loop.run_until_idle()
  assert outs[-1].finish_reason is FinishReason.LENGTH
  assert not loop._cancelled_early


def test_a_scheduler_bug_fails_every_stream_instead_of_hanging_them():
  """An exception outside the engine call (here: the scheduler's plan) on the background
  thread: every request ends as ``error``, ``failed`` is set, later submissions end at once."""
  import threading
  pool = PagePool(PageBudget(4, 32), max_seq_tokens=64)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=2, max_step_tokens=16, max_chunk=8)
  loop = ServingLoop(sched, FakeEngine(32, 4, VOCAB, 2, lag=1))
  done = {rid: threading.Event() for rid in "abc"}
  finals = {}

  def on(rid):
    def cb(o):
      if o.finished:
        finals[rid] = o
        done[rid].set()
    return cb

  calls = [0]
  plan = sched.schedule

  def buggy():
    calls[0] += 1
    if calls[0] == 3:
      raise KeyError("a scheduler bug")
    return plan()

  sched.schedule = buggy
  for rid in "ab":
    loop.submit(_request(rid, ord(rid)), on(rid))
  loop.start()
  try:
    assert done["a"].wait(10) and done["b"].wait(10)
    assert loop.failed and "KeyError" in loop.failed
    loop.submit(_request("c", 3), on("c"))
    assert done["c"].wait(10)
    assert {r: o.finish_reason for r, o in finals.items()} == {
        "a": FinishReason.ERROR, "b": FinishReason.ERROR, "c": FinishReason.ERROR}
  finally:
    loop.stop(timeout=5)
