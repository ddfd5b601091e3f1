"""A server stays in service: nothing that only observes the loop can end it, a failed loop ends
every request and restarts (or is declared dead), and early rejection cannot lock an idle server
into refusing everything. All on the FakeEngine (hand-checkable tokens), most on a simulated
clock."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import prometheus_client as prom
import pytest

from models.text.tokenizer import ByteTokenizer
from serving.api import admission
from serving.step_cost import StepCostModel
from serving.api.auth import KeyInfo
from serving.fake_engine import FakeEngine, reference
from serving.api.frontend import Frontend, FrontendConfig
from serving.api.stream import ServiceError, Status
from serving.kv_pages import PageBudget, PagePool
from serving.lifecycle import Metrics
from serving.loop import ServingLoop
from serving.request import Request
from serving.sampling import SamplingParams
from serving.scheduler import Scheduler
from serving.stop import FinishReason, StopCriteria
from serving.api.usage import UsageLog
from serving.api.validation import GenerateArgs, Limits

TOK = ByteTokenizer()
VOCAB = ByteTokenizer.VOCAB_SIZE
ANON = KeyInfo("anonymous")


# -- the step-cost model cannot raise ---------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 8])
def test_step_cost_model_survives_20000_identical_steps(rows):
  """The old fit's prior decayed away and ``np.linalg.solve`` raised "Singular matrix" after
  ~4,800 identical steps; the ridge term is never forgotten."""
  m = StepCostModel()
  for _ in range(20_000):
    m.observe(0, rows, 0.01)
  assert m.cost(0, rows) == pytest.approx(0.01, rel=1e-3)
  assert all(math.isfinite(c) for c in m.coef)


def test_step_cost_model_ignores_what_is_not_a_duration_and_bounds_an_outlier():
  m = StepCostModel()
  rng = np.random.default_rng(0)
  for _ in range(200):
    p, d = int(rng.integers(0, 256)), int(rng.integers(1, 32))
    m.observe(p, d, 0.005 + 1e-5 * p + 5e-4 * d)
  before = m.cost(0, 8)
  for bad in (math.nan, math.inf, -math.inf, -1.0):
    m.observe(0, 8, bad)
  assert m.ignored == 4 and m.cost(0, 8) == pytest.approx(before, rel=1e-9)
  m.observe(0, 8, 0.0)
  m.observe(0, 8, 1e300)  # counted as at most clamp x the prediction
  assert math.isfinite(m.cost(0, 8)) and m.cost(0, 8) < 1.25 * before
  m.observe(0, 8, 5.0)  # a 5-s step (~550x the fit) moves it by tens of percent at most
  assert m.cost(0, 8) < 1.5 * before


# -- observers cannot end the loop ------------------------------------------------------------

def _loop(slots=4, pages=64, page_size=4, clock=time.monotonic, rebuild=True):
  reg = prom.CollectorRegistry()

  def make():
    pool = PagePool(PageBudget(page_size, pages), max_seq_tokens=64)
    return Scheduler(pool, TOK, max_slots=slots, max_step_tokens=32, max_chunk=16)
  loop = ServingLoop(make(), FakeEngine(pages, page_size, VOCAB, slots, lag=1), Metrics(reg),
                     clock=clock, rebuild=make if rebuild else None)
  return loop, reg


def _request(rid: str, seed: int, n: int = 12) -> Request:
  return Request(rid, (1 + seed, 2, 3), SamplingParams(seed=seed),
                 StopCriteria(max_tokens=n, ignore_eos=True))


def _errors(reg, part: str) -> float:
  return reg.get_sample_value("phaseserve_internal_errors_total", {"part": part}) or 0.0


def test_observer_faults_cost_at_most_their_own_request():
  """Mid-run, the step-cost model, the metrics, one request's lifecycle clock and one
  request's output callback raise: each is logged and counted by part, the callback's request
  is cancelled (its pages freed), every other request finishes with its reference tokens."""
  loop, reg = _loop()
  outs: dict[str, list] = {}
  on = lambda rid: (lambda o: outs.setdefault(rid, []).append(o))
  calls = {"observe": 0, "metrics": 0}
  observe, metrics_observe = loop.cost_model.observe, loop.metrics.observe

  def bad_observe(*a, **k):
    calls["observe"] += 1
    if calls["observe"] in (3, 4):
      raise FloatingPointError("injected: cost model")
    return observe(*a, **k)

  def bad_metrics(trace):
    calls["metrics"] += 1
    if calls["metrics"] == 1:
      raise RuntimeError("injected: metrics")
    return metrics_observe(trace)
  loop.cost_model.observe, loop.metrics.observe = bad_observe, bad_metrics

  class BadClock:  # request "t"'s trace clock fails on its 3rd reading
    n = 0

    def __call__(self):
      BadClock.n += 1
      if BadClock.n == 3:
        raise OSError("injected: lifecycle clock")
      return time.monotonic()
  from serving.lifecycle import RequestTrace
  for i in range(4):
    loop.submit(_request(f"r{i}", i), on(f"r{i}"))
  loop.submit(_request("t", 7), on("t"), RequestTrace("t", BadClock(), loop.guard.report))
  seen = []

  def bad_callback(o):
    seen.append(o)
    if len(seen) == 2:
      raise RuntimeError("injected: stream callback")
  loop.submit(_request("cb", 9, n=40), bad_callback)
  loop.run_until_idle()
  for rid, seed in [(f"r{i}", i) for i in range(4)] + [("t", 7)]:
    ids = [t for o in outs[rid] for t in o.token_ids]
    assert ids == reference([1 + seed, 2, 3], seed, 12, VOCAB), rid
    assert outs[rid][-1].finish_reason is FinishReason.LENGTH
  assert seen[-1].finish_reason is FinishReason.CANCELLED  # only the broken consumer's request
  assert loop.failed is None and loop.scheduler.kv.pool.pages_used == 0
  for part, n in (("cost_model", 2), ("metrics", 1), ("lifecycle", 1), ("stream_callback", 1)):
    assert loop.guard.counts[part] == n and _errors(reg, part) == n, part


def test_usage_log_and_prediction_faults_are_counted_and_the_request_still_ends(tmp_path):
  loop, reg = _loop()
  usage = UsageLog(str(tmp_path / "usage.jsonl"))
  limits = Limits(max_context=64, default_max_tokens=8)
  fe = Frontend(loop, TOK, FrontendConfig(limits), reg, usage)

  def broken_write(record):
    raise OSError("injected: disk full")
  usage.write = broken_write
  real_predict = admission.predict
  loop.start()
  fe.set_state("serving")
  try:
    admission.predict = lambda load: 1 / 0
    s = fe.generate(GenerateArgs(token_ids=[5, 6], max_tokens=4, ignore_eos=True, seed=3), ANON)
    admission.predict = real_predict
    ids = [t for _, o in s.events() for t in o.token_ids]
    assert ids == reference([5, 6], 3, 4, VOCAB) and s.status is Status.OK
    assert fe.live == 0
  finally:
    admission.predict = real_predict
    loop.stop(timeout=5)
  assert loop.guard.counts["usage"] == 1 and _errors(reg, "usage") == 1
  assert loop.guard.counts["cost_model"] == 1


# -- a failed loop ends everything, then restarts or stays dead ------------------------------

def _break_schedule_once(loop):
  real = loop.scheduler.schedule
  state = {"armed": True}

  def schedule():
    if state["armed"] and loop.scheduler.num_running >= 2:
      state["armed"] = False
      raise KeyError("injected scheduler bug")
    return real()
  loop.scheduler.schedule = schedule


def _wait(cond, timeout=10.0):
  deadline = time.monotonic() + timeout
  while not cond():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.005)


@pytest.mark.parametrize("rebuild", [True, False])
def test_an_internal_error_ends_every_request_then_the_loop_restarts_or_stays_dead(rebuild):
  loop, reg = _loop(rebuild=rebuild)
  _break_schedule_once(loop)
  first: dict[str, list] = {}
  done = threading.Event()

  def on(rid):
    def cb(o):
      first.setdefault(rid, []).append(o)
      if len(first) == 6 and all(v[-1].finished for v in first.values()):
        done.set()
    return cb
  for i in range(6):  # 4 run (slots), 2 wait: all end with an error status
    loop.submit(_request(f"a{i}", i, n=30), on(f"a{i}"))
  old_pool = loop.scheduler.kv.pool
  loop.start()
  try:
    assert done.wait(10)
    assert all(v[-1].finish_reason is FinishReason.ERROR for v in first.values())
    assert "injected scheduler bug" in first["a0"][-1].message
    assert reg.get_sample_value("phaseserve_loop_failures_total", {"kind": "internal"}) == 1
    after: list = []
    loop.submit(_request("b", 11), after.append)
    _wait(lambda: after and after[-1].finished)
    if rebuild:  # a fresh scheduler on the same engine serves the next request correctly
      assert [t for o in after for t in o.token_ids] == reference([12, 2, 3], 11, 12, VOCAB)
      assert loop.restarts == 1 and loop.dead is None and loop.scheduler.kv.pool is not old_pool
      assert loop.scheduler.kv.pool.pages_used == 0
      assert reg.get_sample_value("phaseserve_loop_restarts_total") == 1
    else:
      assert after[-1].finish_reason is FinishReason.ERROR and loop.dead
  finally:
    loop.stop(timeout=5)


def test_the_watchdog_fails_a_loop_that_stops_going_round():
  """Not only a hung engine call: a loop stuck anywhere (here a deadlock in planning) stops its
  beat; the watchdog ends every live stream UNAVAILABLE and the state turns failed."""
  loop, reg = _loop()
  fe = Frontend(loop, TOK, FrontendConfig(Limits(max_context=64, default_max_tokens=8),
                                          watchdog_s=0.3), reg)
  release = threading.Event()
  real = loop.scheduler.schedule
  loop.scheduler.schedule = lambda: (release.wait(30), real())[1]
  loop.start()
  fe.set_state("serving")
  fe.start_watchdog(0.02)
  try:
    s = fe.generate(GenerateArgs(token_ids=[1], max_tokens=4), ANON)
    with pytest.raises(ServiceError) as e:
      list(s.events())
    assert e.value.status is Status.UNAVAILABLE and "has not completed a step" in e.value.message
    assert fe.state == "failed" and loop.dead
    assert reg.get_sample_value("phaseserve_loop_failures_total", {"kind": "hung"}) == 1
  finally:
    release.set()
    fe.stop_watchdog()
    loop.stop(timeout=5)


# -- early rejection never locks up -----------------------------------------------------------

class SimClock:
  def __init__(self):
    self.t = 100.0

  def __call__(self) -> float:
    return self.t


def test_one_slow_step_then_idle_then_single_requests_are_all_admitted():
  """On a simulated clock: steps of 10 ms, one of 5 s (a compile, a stall), 5 s idle, then
  single requests under the interactive class (40 ms TPOT): every one is admitted. Before,
  the 5-s sample put the fitted TPOT over the target, every request was refused, no step ran
  and the estimate never changed."""
  clock = SimClock()
  loop, reg = _loop(clock=clock)
  fe = Frontend(loop, TOK, FrontendConfig(Limits(max_context=64, default_max_tokens=8,
                                                 default_slo_class="interactive")), reg)
  fe.set_state("serving")
  execute = loop.engine.execute
  slow = {"next": False}

  def timed(plan):
    clock.t += 5.0 if slow["next"] else 0.010
    slow["next"] = False
    return execute(plan)
  loop.engine.execute = timed

  def serve(n_tokens: int):
    s = fe.generate(GenerateArgs(token_ids=[1, 2, 3], max_tokens=n_tokens, ignore_eos=True), ANON)
    loop.run_until_idle()
    assert [o for _, o in s.events()][-1].finished and s.status is Status.OK
  serve(30)  # a fitted estimate: ~10 ms per step
  assert loop.cost_model.ready
  s = fe.generate(GenerateArgs(token_ids=[4, 5], max_tokens=20, ignore_eos=True), ANON)
  for _ in range(5):
    loop.step()
  slow["next"] = True  # one 5-s step in the middle of a generation
  loop.run_until_idle()
  assert s.status is Status.OK or not s.ended
  clock.t += 5.0  # idle
  for _ in range(10):
    serve(4)
    clock.t += 0.5
  assert reg.get_sample_value("phaseserve_rejections_total", {"reason": "slo"}) in (None, 0.0)
  assert loop.cost_model.cost(0, 1) < 0.040


def test_an_old_estimate_is_still_used_while_the_server_is_busy():
  """The idle rule admits only on an idle server: with requests queued or running, an estimate
  that misses is acted on (early rejection still protects the running requests)."""
  clock = SimClock()
  loop, reg = _loop(clock=clock)
  fe = Frontend(loop, TOK, FrontendConfig(
      Limits(max_context=64, default_max_tokens=8, default_slo_class="interactive")), reg)
  fe.set_state("serving")
  for _ in range(20):
    loop.cost_model.observe(0, 1, 0.5)  # a machine far slower than the target
  clock.t += 60.0
  s = fe.generate(GenerateArgs(token_ids=[1], max_tokens=50, ignore_eos=True), ANON)  # idle
  loop.step()
  with pytest.raises(ServiceError) as e:  # busy now: the estimate applies
    fe.generate(GenerateArgs(token_ids=[2], max_tokens=4), ANON)
  assert e.value.status is Status.REJECTED and "rejected early: predicted" in e.value.message
  s.cancel(Status.CANCELLED, "test over")
  loop.run_until_idle()
