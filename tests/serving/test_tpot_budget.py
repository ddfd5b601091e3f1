"""The TPOT-aware prefill budget (``serving.api.admission.tpot_prefill_limit``,
``Scheduler.prefill_limit``, ``ServingConfig.tpot_target_ms``): the fitted step-cost model
inverted, the scheduler's prefill tokens capped only in steps that decode, and, on a simulated
engine whose step time is a + b * prefill tokens + c * decode rows, decode steps kept within
the target once the model is fitted (they are not without it) with every request's ids intact;
the step metrics (``phaseserve_step_*``, ``phaseserve_prefill_limit_tokens``) report them.
"""

from __future__ import annotations

import prometheus_client as prom
import pytest

from models.text.tokenizer import ByteTokenizer
from serving.step_cost import StepCostModel, tpot_prefill_limit
from serving.fake_engine import FakeEngine, reference
from serving.kv_pages import PageBudget, PagePool
from serving.lifecycle import Metrics, RequestTrace
from serving.loop import ServingLoop
from serving.request import Request
from serving.sampling import SamplingParams
from serving.scheduler import Scheduler
from serving.stop import StopCriteria

VOCAB = ByteTokenizer.VOCAB_SIZE
COSTS = (0.004, 0.0002, 0.0005)  # s per step, per prefill token, per decode row


def _fitted(costs=COSTS) -> StepCostModel:
  a, b, c = costs
  m = StepCostModel()
  for p, d in [(0, 4), (128, 4), (256, 0), (64, 8), (0, 8), (200, 2), (32, 1), (100, 6)]:
    m.observe(p, d, a + b * p + c * d)
  return m


def test_prefill_room_inverts_the_fit():
  m = _fitted()
  assert m.ready
  # (0.040 - 0.004 - 4 * 0.0005) / 0.0002 = 170 tokens; the fit is exact up to its prior.
  assert abs(m.prefill_room(4, 0.040) - 170) <= 1
  assert m.prefill_room(100, 0.040) == 0  # the decodes alone take 54 ms
  assert StepCostModel().prefill_room(4, 0.040) is None  # not fitted yet
  limit = tpot_prefill_limit(m, 0.040, floor=32)
  assert limit(4) == 128 and limit(100) == 32  # 170 rounded down to a power of two; the floor
  assert tpot_prefill_limit(m, 0.040, floor=200)(4) == 200
  assert tpot_prefill_limit(StepCostModel(), 0.040, 32)(4) is None
  with pytest.raises(ValueError):
    tpot_prefill_limit(m, 0.0, 32)
  with pytest.raises(ValueError):
    tpot_prefill_limit(m, 0.04, 0)


def _request(rid: str, prompt: int, out: int, seed: int) -> Request:
  return Request(rid, tuple((seed * 7 + i) % 200 + 1 for i in range(prompt)),
                 SamplingParams(seed=seed), StopCriteria(max_tokens=out, ignore_eos=True))


def test_scheduler_caps_prefill_only_in_steps_that_decode():
  calls = []
  pool = PagePool(PageBudget(8, 64), max_seq_tokens=256)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=4, max_step_tokens=128, max_chunk=64,
                    prefill_limit=lambda rows: calls.append(rows) or 10)
  sched.add(_request("a", 60, 8, 1), RequestTrace("a"))
  sched.add(_request("c", 60, 8, 3), RequestTrace("c"))
  first = sched.schedule()  # nothing decodes: no limit asked, both prompts in one step
  assert not first.decode and sum(len(c.token_ids) for c in first.prefill) == 120
  assert calls == []
  eng = FakeEngine(64, 8, VOCAB, 4)
  sched.update(eng.execute(first))
  sched.add(_request("b", 100, 8, 2), RequestTrace("b"))
  plan = sched.schedule()  # "a" and "c" decode: prefill capped at 10 tokens
  assert len(plan.decode) == 2 and calls == [2]
  assert sum(len(c.token_ids) for c in plan.prefill) == 10


class _SimClock:
  def __init__(self):
    self.t = 0.0

  def __call__(self) -> float:
    return self.t


class _TimedEngine(FakeEngine):
  """Advances the clock by the previous step's cost at each call (the lag-1 engine's wait)."""

  def __init__(self, clock: _SimClock, steps: list):
    super().__init__(512, 16, VOCAB, 8, lag=1)
    self.clock, self.log, self._pending = clock, steps, 0.0

  def execute(self, plan):
    self.clock.t += self._pending
    a, b, c = COSTS
    p = sum(len(ch.token_ids) for ch in plan.prefill)
    self._pending = 0.0 if plan.empty else a + b * p + c * len(plan.decode)
    if not plan.empty:
      self.log.append((p, len(plan.decode), self._pending))
    return super().execute(plan)


def _serve(tpot_ms: float) -> tuple[list, dict, dict]:
  """Four short requests decode while four 600-token prompts arrive; returns the steps
  (prefill tokens, decode rows, seconds), the ids by request and the expected ids."""
  clock, steps = _SimClock(), []
  pool = PagePool(PageBudget(16, 512), max_seq_tokens=1024)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=8, max_step_tokens=512, max_chunk=256)
  reg = prom.CollectorRegistry()
  loop = ServingLoop(sched, _TimedEngine(clock, steps), Metrics(reg), clock=clock)
  if tpot_ms:
    sched.prefill_limit = tpot_prefill_limit(loop.cost_model, tpot_ms / 1e3, floor=16)
  outs: dict[str, list[int]] = {}
  reqs = [_request(f"d{i}", 24, 60, i) for i in range(4)]
  reqs += [_request(f"p{i}", 600, 8, 10 + i) for i in range(4)]
  for r in reqs[:4]:
    loop.submit(r, lambda o, rid=r.request_id: outs.setdefault(rid, []).extend(o.token_ids))
  for _ in range(12):  # the short ones are decoding (and the model has been fitted) ...
    loop.step()
  for r in reqs[4:]:  # ... when the long prompts arrive
    loop.submit(r, lambda o, rid=r.request_id: outs.setdefault(rid, []).extend(o.token_ids))
  loop.run_until_idle()
  want = {r.request_id: reference(list(r.prompt_ids), r.sampling.seed, r.stop.max_tokens, VOCAB)
          for r in reqs}
  # The step metrics: one sample per busy call, the last step's composition and budget.
  assert reg.get_sample_value("phaseserve_step_seconds_count") == len(steps)
  limit = reg.get_sample_value("phaseserve_prefill_limit_tokens")
  assert limit == -1 if not tpot_ms else limit >= 16
  assert reg.get_sample_value("phaseserve_step_decode_rows") >= 1
  return steps, outs, want


def test_decode_steps_stay_within_the_target_on_a_timed_engine():
  target = 0.030
  plain, outs, want = _serve(0)
  assert outs == want
  # Without the budget a decoding step carries up to 512 - rows prefill tokens: ~110 ms.
  assert max(s for p, d, s in plain if d) > 3 * target
  steps, outs, want = _serve(target * 1e3)
  assert outs == want  # the same ids: only the split of the prompts into steps changed
  late = [(p, d, s) for p, d, s in steps[12:] if d]
  assert late and all(s <= target * 1.01 or p <= 16 for p, d, s in late), late
  assert any(p > 16 for p, d, s in late)  # prompts still advance beside the decodes
