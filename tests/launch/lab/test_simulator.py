"""The capacity simulator (launch.lab.simulator): hand-checkable event-model cases, the lean model
against the real scheduler on a simulated clock, the cost-model step times, capacity search,
the Splitwise direction, workloads, and the CLI's files. The live-engine check is in
tests/launch/lab/test_simulator_live.py."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest

from launch.lab.loadgen_lib.slo import Slo
from launch.lab.simulator import capacity, workload
from launch.lab.simulator.cluster import Pool, SimDeployment, SimRequest, simulate
from launch.lab.simulator.instance import EngineSpec
from launch.lab.simulator.step_time import CostModelStepTime, LinearStepTime, kv_capacity_tokens
from models.config import get_shape
from partitioning import cost_model
from partitioning.calibration import Calibration
from partitioning.hardware import get_hardware
from tests.refenv import REPO

A = 0.01  # seconds per step
FLAT = LinearStepTime(A, 0.0, 0.0)
SPEC = EngineSpec(max_slots=4, max_step_tokens=64, max_chunk=64, max_prefill_chunks=4)


def _one(reqs, spec=SPEC, st=FLAT, kv=10_000, **kw):
  return simulate(reqs, SimDeployment.interleaved(1, spec, st, kv), **kw).records


# -- the event model, by hand ---------------------------------------------------------------------


def test_one_request_prefills_in_chunks_then_decodes_a_token_per_step():
  (r,) = _one([SimRequest(0.0, 100, 5)])  # 100 tokens: chunks of 64 + 36, then 4 decode steps
  assert r.ttft_s == pytest.approx(2 * A)
  assert r.tpot_s == pytest.approx(A) and r.e2e_s == pytest.approx(6 * A)
  (r,) = _one([SimRequest(0.0, 100, 1)])  # one token: done at the prompt's last step
  assert r.ttft_s == r.e2e_s == pytest.approx(2 * A) and r.tpot_s is None


def test_the_token_budget_is_shared_decode_first_then_prefill_fcfs():
  # Two prompts of 40 arrive together; budget 64: step 0 = a 40 + b 24, step 1 = a's decode
  # row + b's last 16 (a gets its 2nd token), step 2 = both decode.
  a, b = _one([SimRequest(0.0, 40, 3), SimRequest(0.0, 40, 3)])
  assert a.ttft_s == pytest.approx(A) and b.ttft_s == pytest.approx(2 * A)
  assert a.e2e_s == pytest.approx(3 * A) and b.e2e_s == pytest.approx(4 * A)


def test_step_time_follows_the_step_composition():
  st = LinearStepTime(0.001, 0.0001, 0.002)  # a + b * prefill tokens + c * decode rows
  (r,) = _one([SimRequest(0.0, 50, 3)], st=st)
  assert r.ttft_s == pytest.approx(0.001 + 50 * 0.0001)
  assert r.tpot_s == pytest.approx(0.001 + 0.002)


def test_slots_and_kv_make_requests_wait_and_oversized_ones_are_rejected():
  one_slot = EngineSpec(max_slots=1, max_step_tokens=64, max_chunk=64)
  a, b = _one([SimRequest(0.0, 10, 4), SimRequest(0.0, 10, 4)], spec=one_slot)
  assert a.e2e_s == pytest.approx(4 * A)
  assert b.queue_s == pytest.approx(4 * A) and b.ttft_s == pytest.approx(5 * A)
  # KV for one request (10 + 4 tokens) at a time: the same serialisation through pages.
  a, b = _one([SimRequest(0.0, 10, 4), SimRequest(0.0, 10, 4)], kv=20)
  assert b.ttft_s == pytest.approx(5 * A)
  (c,) = _one([SimRequest(0.0, 30, 4)], kv=20)
  assert c.status == "rejected" and c.ttft_s is None


def test_prefix_cache_hits_skip_prefill_tokens():
  (r,) = _one([SimRequest(0.0, 200, 2, cached_tokens=192)])  # 8 tokens left: one step
  assert r.ttft_s == pytest.approx(A)
  (r,) = _one([SimRequest(0.0, 200, 2, cached_tokens=0)])  # 200 tokens: 4 chunks of <= 64
  assert r.ttft_s == pytest.approx(4 * A)


def test_disaggregated_moves_kv_over_the_link_before_decoding():
  pre = Pool("prefill", 1, EngineSpec(max_slots=4, max_step_tokens=128, max_chunk=128),
             LinearStepTime(0.02, 0.0, 0.0), 10_000)
  dec = Pool("decode", 1, EngineSpec(max_slots=4, max_step_tokens=4, max_chunk=1),
             LinearStepTime(0.005, 0.0, 0.0), 10_000)
  dep = SimDeployment.disaggregated(pre, dec, link_bytes_per_s=1e6, kv_bytes_per_token=100.0,
                                 link_latency_s=0.001)
  (r,) = simulate([SimRequest(0.0, 100, 5)], dep).records
  transfer = 0.001 + 100 * 100.0 / 1e6  # latency + 10 kB at 1 MB/s
  assert r.ttft_s == pytest.approx(0.02)  # the prefill pool samples the first token
  assert r.e2e_s == pytest.approx(0.02 + transfer + 4 * 0.005)  # then 4 decode steps
  assert r.tpot_s == pytest.approx((transfer + 4 * 0.005) / 4)
  assert r.instance == "prefill0" and r.decode_instance == "decode0"
  # One link per prefill instance, FIFO: two prompts prefilled in one step, the second
  # transfer (7 ms) waits for the first, then decodes its one token (5 ms) alone.
  a, b = simulate([SimRequest(0.0, 60, 2), SimRequest(0.0, 60, 2)], dep).records
  assert a.ttft_s == b.ttft_s == pytest.approx(0.02)
  assert a.e2e_s == pytest.approx(0.02 + 0.007 + 0.005)
  assert b.e2e_s - a.e2e_s == pytest.approx(0.007)


def test_dispatch_spreads_requests_over_instances():
  dep = SimDeployment.interleaved(2, SPEC, FLAT, 10_000)
  recs = simulate([SimRequest(0.0, 40, 3), SimRequest(0.0, 40, 3)], dep).records
  assert {r.instance for r in recs} == {"mixed0", "mixed1"}
  assert all(r.ttft_s == pytest.approx(A) for r in recs)  # no sharing of a budget


def test_early_rejection_refuses_what_would_miss_ttft():
  slo = Slo("t", ttft_s=0.1, tpot_s=1.0)
  burst = [SimRequest(0.001 * i, 200, 2) for i in range(60)]  # each prompt: 4 steps of 10 ms
  spec = EngineSpec(max_slots=64, max_step_tokens=64, max_chunk=64)
  dep = SimDeployment.interleaved(1, spec, FLAT, 100_000)
  off = simulate(burst, dep, slo).records
  on = simulate(burst, SimDeployment.interleaved(1, spec, FLAT, 100_000, early_reject=True),
                slo).records
  assert all(r.status == "ok" for r in off)
  assert max(r.ttft_s for r in off) > 1.0  # 60 x 4 steps queued
  admitted = [r for r in on if r.status == "ok"]
  assert 0 < len(admitted) < 60
  assert max(r.ttft_s for r in admitted) <= 0.1 * 1.5  # the predictor's error, not the queue
  # Slots full: one slot held for 50 decode steps (0.5 s); the next request's predicted wait
  # for the slot (Scheduler.slot_wait_steps' estimate) misses the TTFT target.
  one = EngineSpec(max_slots=1, max_step_tokens=64, max_chunk=64)
  a, b = simulate([SimRequest(0.0, 10, 51), SimRequest(0.15, 10, 2)],
                  SimDeployment.interleaved(1, one, FLAT, 10_000, early_reject=True), slo).records
  assert a.status == "ok" and b.status == "rejected"


# -- the lean model against the real scheduler -----------------------------------------------------


def _real_scheduler(requests, costs, slots, step_tokens, chunk, chunks):
  """The real Scheduler + ServingLoop over the FakeEngine on a simulated clock (the engine
  charges a + b * prefill tokens + c * rows per step, launch.lab.sim_early_rejection)."""
  import prometheus_client as prom

  from launch.lab.sim_early_rejection import SimClock, timed_engine
  from models.text.tokenizer import ByteTokenizer
  from serving.kv_pages import PageBudget, PagePool
  from serving.lifecycle import Metrics
  from serving.loop import ServingLoop
  from serving.request import Request
  from serving.scheduler import Scheduler
  from serving.stop import StopCriteria

  clock = SimClock()
  pool = PagePool(PageBudget(16, 4096), max_seq_tokens=1024)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=slots, max_step_tokens=step_tokens,
                    max_chunk=chunk, max_prefill_chunks=chunks)
  loop = ServingLoop(sched, timed_engine(clock, costs, 4096, 16, ByteTokenizer.VOCAB_SIZE, slots),
                     Metrics(prom.CollectorRegistry()), clock=clock)
  i = 0
  while i < len(requests) or not loop.idle:
    if i < len(requests) and requests[i].arrival_s <= clock.t:
      r = requests[i]
      loop.submit(Request(f"r{i}", tuple([7] * r.prompt_len),
                                stop=StopCriteria(r.output_len, ignore_eos=True)), lambda o: None)
      i += 1
    elif not loop.step() and i < len(requests):
      clock.t = max(clock.t, requests[i].arrival_s)
  ttft, tpot = [], []
  for i, r in enumerate(requests):
    toks = loop.traces[f"r{i}"].token_times()
    ttft.append(toks[0] - r.arrival_s)
    tpot.append((toks[-1] - toks[0]) / (len(toks) - 1))
  return ttft, tpot


@pytest.mark.parametrize("rate", [5.0, 60.0])  # light load; overloaded (a growing queue)
def test_lean_model_matches_the_real_scheduler_on_a_simulated_clock(rate):
  costs = (0.004, 0.0002, 0.0005)
  reqs = workload.from_profiles(workload.parse_mix("interactive"), rate, 150, seed=3,
                                length_scale=0.25)
  ttft, tpot = _real_scheduler(reqs, costs, slots=8, step_tokens=128, chunk=64, chunks=4)
  spec = EngineSpec(max_slots=8, max_step_tokens=128, max_chunk=64, max_prefill_chunks=4)
  recs = simulate(reqs, SimDeployment.interleaved(1, spec, LinearStepTime(*costs), 10**6)).records
  from launch.lab.loadgen_lib.report import percentile
  for q in (0.5, 0.9):
    assert percentile([r.ttft_s for r in recs], q) == pytest.approx(percentile(ttft, q), rel=0.2)
    assert percentile([r.tpot_s for r in recs], q) == pytest.approx(percentile(tpot, q), rel=0.2)


# -- step times from the cost model ----------------------------------------------------------------


def test_cost_model_step_time_is_the_planned_layouts_cost_with_buckets_and_calibration():
  model, hw = get_shape("llama-3-70b"), get_hardware("h100")
  st = CostModelStepTime.build(model, hw, 4, "bf16", max_slots=64, prefill_tokens=512)
  d = st.decode
  want = cost_model.step_cost(model, hw, d.layout, d.attention, d.mesh, "decode", 64, 1024)
  assert st.decode_s(40, 1000) == pytest.approx(want.latency_s)  # 40 rows -> 64, 1000 -> 1024
  p = st.prefill
  want_p = cost_model.step_cost(model, hw, p.layout, p.attention, p.mesh, "prefill", 1, 512)
  assert st.seconds(512, 40, 1000) == pytest.approx(want_p.latency_s + want.latency_s)
  slow = Calibration(hardware="h100", flops_fraction=0.5, hbm_fraction=0.5, link_fraction=0.5,
                     layer_overhead_s=1e-5)
  cal = CostModelStepTime.build(model, hw, 4, "bf16", max_slots=64, calibration=slow)
  assert cal.decode_s(40, 1000) == pytest.approx(
      slow.apply(cost_model.step_cost(model, hw, cal.decode.layout, cal.decode.attention,
                                      cal.decode.mesh, "decode", 64, 1024), 80).latency_s)
  assert cal.decode_s(40, 1000) > 1.9 * st.decode_s(40, 1000)


def test_kv_capacity_is_the_hbm_left_after_weights_over_the_kv_shards():
  model, hw = get_shape("llama-3-70b"), get_hardware("h100")
  st = CostModelStepTime.build(model, hw, 4, "bf16")
  per_chip = 80e9 * 0.9 - model.param_count() * 2 / 4
  shards = cost_model.attention_batch_chips(st.decode.layout, st.decode.attention, st.decode.mesh)
  per_token = 80 * 2 * 8 * 128 * 2  # layers x (K, V) x kv heads x head dim x bf16
  assert st.kv_capacity_tokens() == int(per_chip * shards // per_token)
  assert kv_capacity_tokens(model, hw, st.decode, "bf16", reserve=0.99) == 0  # weights alone


# -- capacity and the Splitwise direction ----------------------------------------------------------


def test_capacity_search_brackets_the_slo_and_scales_with_instances():
  slo = Slo("t", ttft_s=0.5, tpot_s=0.05)
  spec = EngineSpec(max_slots=16, max_step_tokens=256, max_chunk=128)
  st = LinearStepTime(0.005, 0.00005, 0.0005)
  make = lambda r: workload.from_profiles(workload.parse_mix("interactive"), r,
                                          max(300, math.ceil(r * 20)), seed=1, length_scale=0.5)
  one = capacity.find_capacity(make, SimDeployment.interleaved(1, spec, st, 10**6), slo)
  best = one["best_rate_per_s"]
  rows = one["rows"]
  assert rows[best]["meets_slo_p99"]
  assert any(not s["meets_slo_p99"] and r > best for r, s in rows.items())
  # Throughput bound: prompt tokens cost b each and a row-step c, per token of output.
  p, o = workload.mean_tokens(make(1.0))
  ceiling = 1 / (st.b * p + (st.a / spec.max_slots + st.c) * o)
  assert 0.3 * ceiling < best < 1.2 * ceiling
  four = capacity.find_capacity(make, SimDeployment.interleaved(4, spec, st, 10**6), slo)
  # Four instances serve about four times as much (a little more: one queue feeds four).
  assert 3.5 * best < four["best_rate_per_s"] < 5.0 * best


def test_cost_per_million_tokens():
  # 8 chips at $3/h serving 10 requests/s of 100 tokens: $24/h over 3.6M tokens/h.
  assert capacity.cost_per_million(10.0, 100.0, 8, 3.0) == pytest.approx(24 / 3.6)
  assert capacity.cost_per_million(None, 100.0, 8, 3.0) is None
  assert capacity.default_splits(8) == (1, 2, 3, 4, 5, 6, 7)
  assert capacity.default_splits(2) == (1,) and capacity.default_splits(1) == ()


def test_disaggregated_beats_interleaved_at_equal_chips_on_prompt_heavy_tight_tpot():
  """Splitwise (Patel et al., ISCA 2024): splitting prefill and decode onto their own machines
  serves more at the same chips when prompts are long and the TPOT target is tight (a mixed
  step's prefill chunk stretches every decoding row's TPOT)."""
  from launch.lab.simulator.deploy import ClusterSpec, Planner
  planner = Planner(ClusterSpec(get_shape("llama-3-70b"), get_hardware("h100"), 32, "bf16"))
  assert planner.instances == 8  # 8 x 4 GPUs
  slo = Slo("tight", ttft_s=2.0, tpot_s=0.025)
  mix = workload.parse_mix("long_context:0.3,interactive:0.7")
  make = lambda r: workload.from_profiles(mix, r, 500, seed=0)
  inter = capacity.find_capacity(make, planner.interleaved(), slo)["best_rate_per_s"]
  rows = capacity.sweep_split(make, 8, planner.disaggregated, slo, splits=(4, 5))
  disagg = max(r["best_rate_per_s"] or 0 for r in rows)
  assert inter and disagg > 1.5 * inter, (inter, rows)
  # With a loose TPOT target the interleaved deployment is no longer TPOT-bound.
  loose = Slo("loose", ttft_s=2.0, tpot_s=0.2)
  inter_loose = capacity.find_capacity(make, planner.interleaved(), loose)["best_rate_per_s"]
  assert inter_loose > 1.5 * inter


# -- workloads ----------------------------------------------------------------------------------


def test_profiles_mix_rates_and_cached_prefixes():
  mix = workload.parse_mix("long_context:3,interactive:1")
  assert mix == (("long_context", 0.75), ("interactive", 0.25))
  slow = workload.from_profiles(mix, 2.0, 200, seed=5)
  fast = workload.from_profiles(mix, 8.0, 200, seed=5)
  assert [r.prompt_len for r in slow] == [r.prompt_len for r in fast]  # same requests
  longer = workload.from_profiles(mix, 2.0, 500, seed=5)  # a longer run extends it
  assert longer[:200] == slow
  assert [r.arrival_s for r in fast] == pytest.approx([r.arrival_s / 4 for r in slow])
  assert sum(r.prompt_len > 1024 for r in slow) > 100  # mostly long_context
  shared = workload.from_profiles(workload.parse_mix("shared_prefix"), 1.0, 5, page_size=16)
  assert shared[0].cached_tokens == 0 and all(r.cached_tokens == 1024 for r in shared[1:])
  hit = workload.from_profiles(workload.parse_mix("interactive"), 1.0, 50, prefix_hit_rate=0.5)
  assert all(r.cached_tokens % 16 == 0 and r.cached_tokens < r.prompt_len for r in hit)
  assert sum(r.cached_tokens for r in hit) > 0.3 * sum(r.prompt_len for r in hit)
  with pytest.raises(ValueError, match="multi-turn"):
    workload.parse_mix("multi_turn")
  with pytest.raises(ValueError, match="not one of"):
    workload.parse_mix("nope")


def test_trace_rows_rescale_to_a_rate(tmp_path):
  from launch.lab.loadgen_lib.workload import load_trace
  path = tmp_path / "t.csv"
  path.write_text("arrival_s,prompt_len,output_len\n1.0,10,5\n2.0,20,6\n3.0,30,7\n")
  rows = load_trace(str(path))
  reqs = workload.from_trace(rows, rate=2.0)  # 2 gaps over 2 s = 1/s -> 2/s
  assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.5, 1.0])
  assert [(r.prompt_len, r.output_len) for r in reqs] == [(10, 5), (20, 6), (30, 7)]


# -- the CLI's logic and files ------------------------------------------------------------------


def test_comparison_grid_writes_its_files(tmp_path):
  from launch.lab.simulator import report
  from launch.lab.simulator.compare import GridSpec, best_by_mode, compare
  grid = GridSpec(get_shape("llama-3-70b"), (get_hardware("h100"),), (8, 16), ("int8",),
                  workload.parse_mix("interactive"), Slo("s", 2.0, 0.05), duration_s=2.0,
                  min_requests=60, cell_instances=4, splits=(0.5,))
  comp = compare(grid)
  # int8 70B: 2-GPU instances, so 8 chips = one cell of 4; 16 chips = two cells of 4.
  by = best_by_mode(comp.rows)
  assert set(by) == {("h100", "int8", 8), ("h100", "int8", 16)}
  for mode in ("interleaved", "disaggregated"):
    assert by[("h100", "int8", 16)][mode] == pytest.approx(2 * by[("h100", "int8", 8)][mode])
  out = report.write(str(tmp_path), comp, {"model": "llama-3-70b"})
  for name in ("capacity.csv", "splits.csv", "runs.csv", "simulate.json", "capacity.png",
               "splits.png"):
    assert os.path.getsize(tmp_path / name) > 0, name
  rows = list(csv.DictReader(open(tmp_path / "capacity.csv")))
  assert len(rows) == 4 and {r["mode"] for r in rows} == {"interleaved", "disaggregated"}
  assert all(float(r["usd_per_m_output"]) > 0 for r in rows)
  assert json.load(open(tmp_path / "simulate.json"))["model"] == out["model"] == "llama-3-70b"
  splits = list(csv.DictReader(open(tmp_path / "splits.csv")))
  assert [(s["prefill"], s["decode"]) for s in splits] == [("2", "2")]


def test_cli_rejects_bad_flags_with_one_line():
  env = {**os.environ, "PYTHONPATH": REPO}
  r = subprocess.run([sys.executable, "-m", "launch.lab.simulate", "--out", "/tmp/x",
                      "--weights", "fp4"], capture_output=True, text=True, timeout=60, cwd=REPO,
                     env=env)
  assert r.returncode == 2 and r.stderr.strip().startswith("error:") and "fp4" in r.stderr
