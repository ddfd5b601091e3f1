"""serving.step_timeline: each busy step's phases, wall and loop-thread CPU, and their export.

Unit part on scripted clocks (exact arithmetic); then the timeline inside a ``ServingLoop`` over
``FakeEngine`` (lag 1) with Prometheus metrics: every busy step is recorded, the exported totals
equal the timeline's, and the rows it counts are the tokens the requests got.
"""

from __future__ import annotations

import itertools

import prometheus_client as prom
import pytest

from models.text.tokenizer import ByteTokenizer
from serving.fake_engine import FakeEngine
from serving.kv_pages import PageBudget, PagePool
from serving.lifecycle import Metrics
from serving.loop import ServingLoop
from serving.request import Request
from serving.sampling import SamplingParams
from serving.scheduler import Scheduler
from serving.step_timeline import PHASES, StepTimeline, summarize
from serving.stop import StopCriteria

VOCAB = ByteTokenizer.VOCAB_SIZE


def _scripted(walls, cpus):
  w, c = iter(walls), iter(cpus)
  return StepTimeline(clock=lambda: next(w), cpu_clock=lambda: next(c))


def test_phases_wait_and_between_on_scripted_clocks():
  # step 1: begin 0, admit 1, plan 3, execute 10 (wait 6 of it), update 11, deliver 12
  # step 2: begin 15 (between 3), admit 15, plan 15, execute 20 (no wait), deliver 21
  walls = [0, 1, 3, 10, 11, 12, 15, 15, 15, 20, 21]
  cpus = [0, 1, 2, 3, 4, 4.5, 5, 5, 5, 9, 9.5]
  tl = _scripted(walls, cpus)
  tl.begin(); tl.mark("admit"); tl.mark("plan"); tl.mark("execute")
  tl.mark("update"); tl.mark("deliver")
  r1 = tl.end(prefill_tokens=16, decode_rows=2, wait_s=6.0)
  assert r1.wall == {"between": 0.0, "admit": 1, "plan": 2, "dispatch": 1, "wait": 6,
                     "update": 1, "deliver": 1}
  assert r1.cpu["dispatch"] == 1 and r1.cpu["wait"] == 0 and r1.cpu["deliver"] == 0.5
  assert r1.step_s == 12
  tl.begin(); tl.mark("admit"); tl.mark("plan"); tl.mark("execute"); tl.mark("deliver")
  r2 = tl.end(prefill_tokens=0, decode_rows=3, wait_s=99.0)  # a wait is capped by the call
  assert r2.wall["between"] == 3 and r2.cpu["between"] == 0.5
  assert r2.wall["wait"] == 5 and r2.wall["dispatch"] == 0
  assert tl.steps == 2 and tl.decode_rows == 5 and tl.prefill_tokens == 16
  assert tl.decode_only_steps == 1 and tl.decode_only_s == 6
  assert tl.totals_wall["wait"] == 11 and tl.totals_wall["between"] == 3
  # host phases: step 1 admit 1 + plan 2 + update 1 + deliver 1 = 5; step 2: 3 + 1 = 4
  assert tl.host_s == pytest.approx(0.9 * 5 + 0.1 * 4)


def test_an_idle_step_breaks_the_between_chain():
  tl = _scripted([0, 1, 2, 50, 51, 52, 60], [0] * 7)
  tl.begin(); tl.mark("execute"); tl.end(0, 1)
  tl.begin(); tl.idle()  # the loop found nothing: its wait for work is not loop overhead
  tl.begin(); tl.mark("execute")
  assert tl.end(0, 1).wall["between"] == 0.0


def test_summary_splits_decode_only_steps_by_batch_and_drops_compiles():
  tl = _scripted((x / 1000 for x in itertools.count()), itertools.repeat(0.0))
  for rows, prefill, compiled in [(2, 0, False), (2, 0, False), (4, 0, False), (4, 32, False),
                                  (4, 0, True)]:
    tl.begin(); tl.mark("execute"); tl.end(prefill, rows, compiled=compiled)
  s = summarize(tl.records)
  assert s["steps"] == 4  # the compiling step is not a sample
  assert set(s["decode_only_ms"]) == {"2", "4"}
  assert s["decode_only_ms"]["2"]["steps"] == 2 and s["with_prefill_ms"]["steps"] == 1
  shares = [v["share"] for v in s["phases_ms"].values()]
  assert sum(shares) == pytest.approx(1.0)
  assert tl.decode_only_steps == 3  # 2 + 1 at four rows; the compile is not counted
  assert summarize([]) == {"steps": 0}


def _request(rid: str, seed: int, n: int) -> Request:
  return Request(rid, tuple(range(1 + seed, 12 + seed)), SamplingParams(seed=seed),
                 StopCriteria(max_tokens=n, ignore_eos=True))


def test_the_loop_records_every_busy_step_and_exports_it():
  registry = prom.CollectorRegistry()
  pool = PagePool(PageBudget(4, 64), max_seq_tokens=64)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=4, max_step_tokens=16, max_chunk=8)
  loop = ServingLoop(sched, FakeEngine(64, 4, VOCAB, 4, lag=1), Metrics(registry))
  outs: list = []
  lengths = {"a": 9, "b": 5, "c": 12}
  for i, (rid, n) in enumerate(lengths.items()):
    loop.submit(_request(rid, i, n), outs.append)
  busy = 0
  while not loop.idle or busy == 0:
    busy += loop.step()
  for _ in range(3):
    loop.step()  # idle steps add nothing
  tl = loop.timeline
  assert tl.steps == busy == len(tl.records)
  # Each request's first id comes from its last prefill chunk, the others from decode rows.
  assert tl.decode_rows == sum(n - 1 for n in lengths.values())
  assert tl.prefill_tokens == 3 * 11
  got = {p: registry.get_sample_value("phaseserve_step_phase_seconds_total", {"phase": p})
         for p in PHASES}
  assert got == pytest.approx(tl.totals_wall)
  assert all(v >= 0 for v in got.values()) and got["dispatch"] > 0
  assert registry.get_sample_value("phaseserve_steps_total") == busy
  assert registry.get_sample_value("phaseserve_step_rows_decoded_total") == tl.decode_rows
  assert registry.get_sample_value("phaseserve_decode_only_steps_total") == tl.decode_only_steps
  s = summarize(tl.records)
  assert s["steps"] == busy and sum(v["steps"] for v in s["decode_only_ms"].values()) == \
      tl.decode_only_steps
