"""Prediction-based early rejection (Mooncake), simulated clock (launch.lab.sim_early_rejection):
the real scheduler, front end and predictor over a fake engine whose steps cost simulated
seconds, a Poisson trace at 2x the engine's capacity. With early rejection the admitted
requests' p99 TTFT stays within the SLO; without it the queue grows and it does not. Rejections
carry the prediction; the fitted step-cost model finds the simulated costs; the predictor's
error is measured."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys

import pytest

from launch.lab.sim_early_rejection import capacity, simulate
from serving.step_cost import StepCostModel
from tests.refenv import REPO

COSTS = (0.004, 0.0002, 0.0005)
TTFT = 0.25


def test_early_rejection_holds_p99_ttft_at_2x_overload():
  rate = 2 * capacity(COSTS, 96, 12)
  off = simulate(False, rate, 400, COSTS, ttft_s=TTFT)
  on = simulate(True, rate, 400, COSTS, ttft_s=TTFT)
  assert off["rejected"] == 0 and off["admitted"] == 400
  assert off["p99_ttft_ms"] > 4 * TTFT * 1e3  # without it the queue grows without bound
  assert on["p99_ttft_ms"] <= TTFT * 1e3  # with it, admitted requests meet the SLO
  assert 0.2 < on["rejected"] / 400 < 0.8 and on["goodput_rps"] > off["goodput_rps"]
  assert "predicted TTFT" in on["example_rejection"] and "'chat'" in on["example_rejection"]
  a, b, c = on["fitted_costs"]  # the live fit recovers the simulated step costs
  assert a == pytest.approx(COSTS[0], rel=0.2) and b == pytest.approx(COSTS[1], rel=0.2)
  assert c == pytest.approx(COSTS[2], rel=0.5)
  err = on["prediction"]
  assert err["requests"] == on["admitted"] and err["median_abs_rel_error"] < 0.5, err


def test_no_rejection_below_capacity():
  r = simulate(True, 0.5 * capacity(COSTS, 96, 12), 200, COSTS, ttft_s=TTFT)
  assert r["admitted"] == 200 and r["rejected"] == 0 and r["p99_ttft_ms"] <= TTFT * 1e3


def test_step_cost_model_fits_and_forgets():
  m = StepCostModel(forget=0.9)
  rng = random.Random(1)
  for _ in range(200):
    p, d = rng.randrange(0, 300), rng.randrange(0, 32)
    m.observe(p, d, 0.002 + 1e-4 * p + 3e-4 * d)
  assert m.ready and m.cost(100, 10) == pytest.approx(0.002 + 0.01 + 0.003, rel=1e-3)
  for _ in range(200):  # the machine got 2x slower: the fit follows
    p, d = rng.randrange(0, 300), rng.randrange(0, 32)
    m.observe(p, d, 2 * (0.002 + 1e-4 * p + 3e-4 * d))
  assert m.cost(100, 10) == pytest.approx(2 * 0.015, rel=1e-2)


def test_sim_cli_smoke():
  r = subprocess.run([sys.executable, "-m", "launch.lab.sim_early_rejection", "--loads", "2",
                      "--requests", "60"], cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert [(x["load"], x["early_reject"]) for x in out["runs"]] == [(2.0, False), (2.0, True)]
  assert out["runs"][1]["rejected"] > 0 and out["capacity_rps"] > 0


def test_waiting_for_a_slot_costs_decode_steps_not_prefill_chunks():
  """A request queued behind full slots waits ``slot_wait_steps`` decode-only steps, then its
  prompt's chunks: 40 steps of 10 ms (+ two 256-token chunks + the copy step), not 40 steps each
  costed as a 512-token chunk (the over-prediction loadgen found, 4-10x on long prompts)."""
  from serving.api.admission import Load, predict
  model = StepCostModel(forget=1.0)
  for tokens, rows in ((0, 4), (256, 4), (512, 4), (0, 1), (128, 2), (0, 3), (384, 1), (64, 4)):
    model.observe(tokens, rows, 0.004 + 0.001 * tokens + 0.0015 * rows)  # exact: a, b, c
  load = Load(step_s=0.01, backlog_tokens=0, decoding=4, max_step_tokens=260, new_tokens=512,
              model=model, slot_wait_steps=40)
  want = 40 * 0.010 + 2 * (0.004 + 0.256 + 0.006) + (0.004 + 0.0075)
  assert predict(load).ttft_s == pytest.approx(want, rel=1e-3)


def test_long_prompts_drain_in_chunks_and_under_the_tpot_budget():
  """The prediction plans steps as the scheduler does: a prompt advances one ``max_chunk``
  chunk a step (not ``max_step_tokens``), the backlog drains first in at most
  ``max_prefill_chunks`` chunks a step, and while rows decode the TPOT budget caps the step's
  prefill tokens."""
  from serving.api.admission import Load, predict
  model = StepCostModel(forget=1.0)
  for tokens, rows in ((0, 4), (256, 4), (512, 4), (0, 1), (128, 2), (0, 3), (384, 1), (64, 4)):
    model.observe(tokens, rows, 0.004 + 0.001 * tokens + 0.0015 * rows)
  cost = lambda tokens, rows: 0.004 + 0.001 * tokens + 0.0015 * rows
  # 1,000 prompt tokens, chunks of 256, nothing decoding: four steps (256, 256, 256, 232).
  alone = Load(0.01, 0, 0, 512, 1000, model=model, max_chunk=256, max_prefill_chunks=4)
  want = 3 * cost(256, 0) + cost(232, 0) + cost(0, 1)
  assert predict(alone).ttft_s == pytest.approx(want, rel=1e-3)
  # Counted in steps (no fit yet): 4 chunks + the copy step, where 512 tokens a step gave 2 + 1.
  assert predict(dataclasses.replace(alone, model=None)).ttft_s == pytest.approx(5 * 0.01)
  assert predict(dataclasses.replace(alone, model=None, max_chunk=1 << 30)).ttft_s == \
      pytest.approx(3 * 0.01)
  # Behind a 600-token backlog, 2 chunks a step of at most 256: backlog 512, then 88 + 256 of
  # this prompt (its own chunk beside the backlog's last), then 256, 256, 232.
  behind = Load(0.01, 600, 0, 512, 1000, model=model, max_chunk=256, max_prefill_chunks=2)
  want = cost(512, 0) + cost(88 + 256, 0) + 2 * cost(256, 0) + cost(232, 0) + cost(0, 1)
  assert predict(behind).ttft_s == pytest.approx(want, rel=1e-3)
  # Four rows decoding under a TPOT budget of 64 prefill tokens a step: 1000 / 64 -> 16 steps.
  budget = Load(0.01, 0, 4, 512, 1000, model=model, max_chunk=256, max_prefill_chunks=4,
                prefill_limit=64)
  want = 15 * cost(64, 4) + cost(1000 - 15 * 64, 4) + cost(0, 5)
  assert predict(budget).ttft_s == pytest.approx(want, rel=1e-3)
  # Without a fitted model: steps x the measured step time (16 prefill steps + the copy).
  bare = dataclasses.replace(budget, model=None)
  assert predict(bare).ttft_s == pytest.approx(17 * 0.01)


def test_each_step_adds_the_loops_own_time_and_the_step_in_flight_is_waited_out():
  """The fit times engine calls; a step also costs the loop's host phases (``host_s``, the step
  timeline's average), and a new request first waits for the step in flight."""
  from serving.api.admission import Load, predict
  model = StepCostModel(forget=1.0)
  for tokens, rows in ((0, 4), (256, 4), (512, 4), (0, 1), (128, 2), (0, 3), (384, 1), (64, 4)):
    model.observe(tokens, rows, 0.004 + 0.001 * tokens + 0.0015 * rows)
  base = Load(0.01, 0, 0, 512, 1000, model=model, max_chunk=256, max_prefill_chunks=4)
  more = dataclasses.replace(base, host_s=0.003, in_flight_s=0.02)
  # four prefill steps and the copy step, each 3 ms more, and the 20 ms left of the running one
  assert predict(more).ttft_s - predict(base).ttft_s == pytest.approx(5 * 0.003 + 0.02)
  assert predict(more).tpot_s - predict(base).tpot_s == pytest.approx(0.003)
  bare = dataclasses.replace(more, model=None)  # counted in steps: the same additions
  assert predict(bare).ttft_s == pytest.approx(5 * 0.01 + 5 * 0.003 + 0.02)


def test_the_loop_reports_the_step_in_flight():
  from models.text.tokenizer import ByteTokenizer
  from serving.fake_engine import FakeEngine
  from serving.kv_pages import PageBudget, PagePool
  from serving.loop import ServingLoop
  from serving.scheduler import Scheduler
  now = [100.0]
  sched = Scheduler(PagePool(PageBudget(4, 8), max_seq_tokens=32), ByteTokenizer(), max_slots=2,
                    max_step_tokens=16, max_chunk=8)
  loop = ServingLoop(sched, FakeEngine(8, 4, ByteTokenizer.VOCAB_SIZE, 2), clock=lambda: now[0])
  assert loop.in_flight_s() == 0.0  # between steps
  loop.step_s, loop.step_started = 0.05, 100.0
  now[0] = 100.02
  assert loop.in_flight_s() == pytest.approx(0.03)
  now[0] = 100.2  # a step longer than average: nothing more is predicted
  assert loop.in_flight_s() == 0.0


def test_a_prompt_too_long_for_its_target_is_served_unless_the_wait_doubles_it():
  """``judge``: an ordinary request that would miss is refused; one that misses even alone (its
  prompt alone takes longer than the target) is not refused forever: it is admitted while what
  is ahead of it adds less than its own time, refused beyond."""
  from serving.api.admission import Load, SloClass, judge
  slo = SloClass("chat", 0.5, 1.0)
  short = Load(0.01, 3000, 2, 512, 100, max_chunk=256, max_prefill_chunks=2)  # 6 + 1 + 1 steps
  pred, miss = judge(short, slo)
  assert pred.ttft_s == pytest.approx(0.08) and miss is None
  pred, miss = judge(dataclasses.replace(short, backlog_tokens=60_000), slo)
  assert miss is not None and miss.startswith("predicted TTFT")
  long = Load(0.01, 0, 2, 512, 20_000, max_chunk=256, max_prefill_chunks=2)  # 79 steps alone
  assert judge(long, slo) == (pytest.approx(long_pred := judge(long, slo)[0]), None)
  assert long_pred.ttft_s == pytest.approx(0.80)
  assert judge(dataclasses.replace(long, backlog_tokens=20_000), slo)[1] is None  # 1.6 s < 2x
  _, miss = judge(dataclasses.replace(long, backlog_tokens=60_000), slo)  # 3.2 s > 2 x 0.8 s
  assert miss is not None and "over twice" in miss and "nothing ahead" in miss
