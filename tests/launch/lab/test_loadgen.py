"""launch.lab.loadgen: arrival processes, profiles, traces, statistics and the capacity search's resume
as pure Python; the OpenAI path against a deterministic fake SSE server (a thread on 127.0.0.1,
free port, shut down); the phaseserve and JetStream paths and a resumed ``--find_capacity``
against one real ``launch.server --model tiny`` process (reaped). Seconds, not minutes."""

from __future__ import annotations

import csv
import dataclasses
import http.server
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from launch.lab import server_steps
from launch.lab.loadgen_lib import app, capacity, drivers, report, runner, workload
from launch.lab.loadgen_lib.arrivals import Arrivals, arrival_times_s
from launch.lab.loadgen_lib.slo import PRESETS, Slo, parse_slo
from tests.grpc_harness import ServerProc
from tests.refenv import REPO
from tests.cli_env import CLI_XLA_FLAGS

SMALL = ("--model", "tiny", "--max_context", "128", "--max_slots", "4", "--kv_pages", "48",
         "--page_size", "16", "--max_chunk", "32", "--max_prefill_chunks", "1",
         "--early_reject=false")
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)


def _cli(*args: str, timeout: float = 120) -> dict:
  r = subprocess.run([sys.executable, "-m", "launch.lab.loadgen", "--progress=false", *args],
                     cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def _read_csv(path) -> tuple[list[str], list[dict]]:
  with open(path, newline="") as f:
    rows = list(csv.DictReader(f))
  with open(path, newline="") as f:
    header = next(csv.reader(f))
  return header, rows


def _is_png(path) -> bool:
  with open(path, "rb") as f:
    return f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 1000


# ----- pure Python -----

def test_slo_presets_are_mlperf_v5():
  assert PRESETS["interactive"] == Slo("interactive", 0.45, 0.04)
  assert PRESETS["server"] == Slo("server", 2.0, 0.2)
  assert PRESETS["long"] == Slo("long", 6.0, 0.175)
  s = parse_slo("server", 10)
  assert (s.ttft_s, s.tpot_s) == (20.0, 2.0)
  assert parse_slo("0.1:0.01") == Slo("custom", 0.1, 0.01)
  assert s.met(19.0, 1.9) and not s.met(21.0, 0.1) and not s.met(1.0, 2.1) and s.met(1.0, None)
  with pytest.raises(ValueError):
    parse_slo("fast")


@pytest.mark.parametrize("process,cv", [("poisson", 1.0), ("gamma", 3.0), ("onoff", None)])
def test_arrival_processes_rate_burstiness_and_seed(process, cv):
  cfg = Arrivals(process, 10.0, cv or 1.0, 1.0, 1.0)
  t = arrival_times_s(cfg, 4000, 0, np.random.default_rng(1))
  assert len(t) == 4000 and np.all(np.diff(t) >= 0)  # gamma gaps may underflow to 0
  rate = (len(t) - 1) / (t[-1] - t[0])
  assert 9.0 < rate < 11.0, rate
  gaps = np.diff(t)
  got_cv = gaps.std() / gaps.mean()
  if cv is None:
    assert got_cv > 1.5  # on/off bursts clump arrivals
  else:
    assert abs(got_cv - cv) < 0.15 * cv, got_cv
  assert np.array_equal(t, arrival_times_s(cfg, 4000, 0, np.random.default_rng(1)))
  assert not np.array_equal(t, arrival_times_s(cfg, 4000, 0, np.random.default_rng(2)))
  bounded = arrival_times_s(cfg, 0, 5.0, np.random.default_rng(1))
  assert bounded.max() <= 5.0 and 25 < len(bounded) < 75


def test_poisson_times_scale_with_the_rate():
  a = arrival_times_s(Arrivals("poisson", 2.0), 50, 0, np.random.default_rng(0))
  b = arrival_times_s(Arrivals("poisson", 4.0), 50, 0, np.random.default_rng(0))
  np.testing.assert_allclose(a, 2 * b)


def test_profiles_lengths_shared_prefix_turns_and_clipping():
  times = np.arange(40) * 0.1
  for name, prof in workload.PROFILES.items():
    wl = workload.build_sessions(workload.WorkloadConfig(name, 0.5, 1000), times,
                                 np.random.default_rng(0))
    assert len(wl.sessions) == 40 and wl.clipped == 0
    for s in wl.sessions:
      t0 = s.turns[0]
      lo = max(1, round(prof.prompt.lo * 0.5)) + round(prof.shared_prefix_len * 0.5)
      hi = round(prof.prompt.hi * 0.5) + round(prof.shared_prefix_len * 0.5)
      assert lo <= len(t0.new_ids) <= hi
      assert round(prof.output.lo * 0.5) <= t0.max_tokens <= round(prof.output.hi * 0.5)
      assert all(100 <= i < 1000 for t in s.turns for i in t.new_ids)
      assert prof.min_turns <= len(s.turns) <= prof.max_turns
      assert (s.session_id != "") == (len(s.turns) > 1)
      assert all(t.pause_s > 0 for t in s.turns[1:]) and s.turns[0].pause_s == 0
  shared = workload.build_sessions(workload.WorkloadConfig("shared_prefix", 0.5, 1000), times,
                                   np.random.default_rng(0))
  heads = {s.turns[0].new_ids[:512] for s in shared.sessions}
  assert len(heads) == 1 and len({s.turns[0].new_ids for s in shared.sessions}) == 40
  mt = workload.build_sessions(workload.WorkloadConfig("multi_turn", 1.0, 1000), times,
                               np.random.default_rng(0))
  assert sum(len(s.turns) for s in mt.sessions) > 2 * 40
  # clipping: every session's predicted context fits, and the clipped ones are counted
  clip = workload.build_sessions(workload.WorkloadConfig("multi_turn", 1.0, 1000, 300), times,
                                 np.random.default_rng(0))
  assert clip.clipped > 0
  for s in clip.sessions:
    assert sum(len(t.new_ids) + t.max_tokens for t in s.turns) <= 300
  long = workload.build_sessions(workload.WorkloadConfig("long_context", 1.0, 1000, 2048),
                                 times, np.random.default_rng(0))
  assert long.clipped >= 30 and all(len(s.turns[0].new_ids) + s.turns[0].max_tokens <= 2048
                                    for s in long.sessions)


def test_trace_jsonl_and_csv(tmp_path):
  rows = [(0.5, 10, 4), (0.0, 20, 8), (1.25, 5, 2)]
  (tmp_path / "t.jsonl").write_text("".join(
      json.dumps({"arrival_s": a, "prompt_len": p, "output_len": o}) + "\n" for a, p, o in rows))
  (tmp_path / "t.csv").write_text("arrival_s,prompt_len,output_len\n" + "".join(
      f"{a},{p},{o}\n" for a, p, o in rows))
  a = workload.load_trace(str(tmp_path / "t.jsonl"))
  assert a == workload.load_trace(str(tmp_path / "t.csv"))
  assert [r.arrival_s for r in a] == [0.0, 0.5, 1.25] and a[0].prompt_len == 20
  wl = workload.build_sessions(workload.WorkloadConfig("trace", 1.0, 500), np.asarray(
      [r.arrival_s for r in a]), np.random.default_rng(0), a)
  assert [(len(s.turns[0].new_ids), s.turns[0].max_tokens) for s in wl.sessions] == \
      [(20, 8), (10, 4), (5, 2)]
  (tmp_path / "bad.jsonl").write_text('{"arrival_s": 0, "prompt_len": 3}\n')
  with pytest.raises(ValueError, match="bad.jsonl:1"):
    workload.load_trace(str(tmp_path / "bad.jsonl"))


def test_a_trace_is_replayed_as_recorded_and_rescaled_for_capacity(tmp_path):
  trace = tuple(workload.TraceRow(1.0 + 2.0 * i, 10, 4) for i in range(5))  # 0.5/s from 1 s
  cfg = app.LoadgenConfig(drivers.DriverConfig("openai", "x"), str(tmp_path),
                          workload=workload.WorkloadConfig("trace", 1.0, 500))
  as_is = app._workload(cfg, 1.0, trace)
  assert [s.arrival_s for s in as_is.sessions] == [0.0, 2.0, 4.0, 6.0, 8.0]
  fast = app._workload(dataclasses.replace(cfg, find_capacity=True), 4.0, trace)
  np.testing.assert_allclose([s.arrival_s for s in fast.sessions], [0, 0.25, 0.5, 0.75, 1.0])


def _rec(status="ok", ttft=0.1, tpot=0.01, out=10, slo=PRESETS["interactive"]):
  ok = status == "ok"
  return runner.RequestRecord(0, 0, 0.0, 0.0, status, "", 8, 8, 0, out, out if ok else 0,
                              "length", ttft if ok else None, tpot if ok else None, 0.2,
                              None, None, None, None, None, ok and slo.met(ttft, tpot))


def test_summary_percentiles_goodput_rejections_errors():
  slo = PRESETS["interactive"]
  recs = [_rec(ttft=0.01 * (i + 1)) for i in range(100)]  # ttft 10 .. 1000 ms
  s = report.summarize(runner.RunResult(tuple(recs), 10.0, 0.0, 0), slo)
  assert s["ttft_s"]["p50"] == pytest.approx(0.50) and s["ttft_s"]["p90"] == pytest.approx(0.90)
  assert s["ttft_s"]["p99"] == pytest.approx(0.99)
  assert s["good"] == 45 and s["goodput_rps"] == pytest.approx(4.5)  # ttft <= 450 ms
  assert s["throughput_rps"] == pytest.approx(10.0) and not s["meets_slo_p99"]
  spread = [dataclasses.replace(r, session=i, scheduled_s=0.5 * i) for i, r in enumerate(recs)]
  assert report.summarize(runner.RunResult(tuple(spread), 60.0, 0.0, 0), slo)[
      "offered_sessions_per_s"] == pytest.approx(2.0)
  recs = [_rec(ttft=0.1) for _ in range(97)] + [_rec("RESOURCE_EXHAUSTED"), _rec("http_429"),
                                                 _rec("INTERNAL")]
  s = report.summarize(runner.RunResult(tuple(recs), 2.0, 0.0, 0), slo)
  assert (s["sent"], s["ok"], s["rejected"], s["errors"]) == (100, 97, 2, 1)
  assert s["rejected_by_status"] == {"RESOURCE_EXHAUSTED": 1, "http_429": 1}
  assert s["errors_by_status"] == {"INTERNAL": 1}
  assert not s["meets_slo_p99"] and s["p99_ttft_all_s"] is None  # 3% failed: p99 is a failure
  s = report.summarize(runner.RunResult(tuple(recs[:97] * 2)[:99] + (recs[99],), 2.0, 0.0, 0),
                       slo)
  assert s["meets_slo_p99"] and s["p99_ttft_all_s"] == pytest.approx(0.1)  # 1 in 100 failed
  # The same 100 sent, and 2 later turns never sent after a session's failed turn: 3 of 102
  # failed, so p99 is a failure.
  s = report.summarize(runner.RunResult(tuple(recs[:97] * 2)[:99] + (recs[99],), 2.0, 0.0, 2),
                       slo)
  assert s["turns_not_sent"] == 2 and not s["meets_slo_p99"]


def _fake_measure(store: capacity.RateStore, capacity_rps: float, calls: list[float],
                  crash_after: int | None = None):
  def measure(rate: float) -> dict:
    if crash_after is not None and len(calls) >= crash_after:
      raise KeyboardInterrupt  # the run is killed mid-search
    calls.append(rate)
    s = {"fingerprint": store.fingerprint, "meets_slo_p99": rate <= capacity_rps}
    os.makedirs(store.dir(rate), exist_ok=True)
    report.write_json(os.path.join(store.dir(rate), "summary.json"), s)
    return s
  return measure


def test_capacity_search_doubles_bisects_and_resumes_without_redoing(tmp_path):
  search = capacity.Search(start_rate=1.0, max_rate=64.0, steps=3)
  store = capacity.RateStore(str(tmp_path / "a"), "fp")
  calls: list[float] = []
  full = capacity.find_capacity(search, store, _fake_measure(store, 5.0, calls))
  assert calls == [1.0, 2.0, 4.0, 8.0, 6.0, 5.0, 5.5] and full["best_rate_per_s"] == 5.0
  # killed after 4 rates, then resumed: the 4 finished rates are read back, only 3 measured
  store = capacity.RateStore(str(tmp_path / "b"), "fp")
  first: list[float] = []
  with pytest.raises(KeyboardInterrupt):
    capacity.find_capacity(search, store, _fake_measure(store, 5.0, first, crash_after=4))
  assert first == [1.0, 2.0, 4.0, 8.0]
  again: list[float] = []
  res = capacity.find_capacity(search, store, _fake_measure(store, 5.0, again))
  assert again == [6.0, 5.0, 5.5] and res["reused"] == [1.0, 2.0, 4.0, 8.0]
  assert res["best_rate_per_s"] == 5.0 and list(res["rows"]) == sorted(calls)
  # a failing start halves down to a pass first
  low: list[float] = []
  store = capacity.RateStore(str(tmp_path / "c"), "fp")
  res = capacity.find_capacity(capacity.Search(8.0, 64.0, 3), store,
                               _fake_measure(store, 1.5, low))
  assert low == [8.0, 4.0, 2.0, 1.0] and res["best_rate_per_s"] == 1.0
  with pytest.raises(ValueError, match="another configuration"):
    capacity.RateStore(str(tmp_path / "a"), "other").get(1.0)
  # a max_rate finer than the rates' 4 digits still ends the doubling (it looped forever)
  top: list[float] = []
  store = capacity.RateStore(str(tmp_path / "d"), "fp")
  res = capacity.find_capacity(capacity.Search(50.0, 123.45678, 2), store,
                               _fake_measure(store, 1e9, top))
  assert top == [50.0, 100.0, 123.5] and res["best_rate_per_s"] == 123.5
  # a start past the bound is refused: it would be measured and could be reported as capacity
  with pytest.raises(ValueError, match="max rate"):
    capacity.find_capacity(capacity.Search(100.0, 64.0, 2), store, _fake_measure(store, 1e9, []))


# ----- the OpenAI path against a fake OpenAI-compatible SSE server -----

class _FakeOpenAI(http.server.ThreadingHTTPServer):
  """/v1/completions: every 5th request 429; else ``max_tokens`` chunks " tok<i>", the first
  after ``first_s``, then one per ``step_s``, a usage chunk and [DONE]."""
  daemon_threads = True

  def __init__(self, first_s: float, step_s: float):
    super().__init__(("127.0.0.1", 0), _Handler)
    self.first_s, self.step_s = first_s, step_s
    self.reject_every = 5
    self.truncate_after: int | None = None  # close the body after this many chunks, no [DONE]
    self.lock = threading.Lock()
    self.bodies: list[dict] = []
    self.received: list[float] = []
    self.live = 0
    self.max_live = 0


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"

  def log_message(self, *args):
    pass

  def do_POST(self):
    srv: _FakeOpenAI = self.server
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    with srv.lock:
      srv.bodies.append(body)
      srv.received.append(time.monotonic())
      n = len(srv.bodies)
      srv.live += 1
      srv.max_live = max(srv.max_live, srv.live)
    try:
      if self.path != "/v1/completions" or (srv.reject_every and n % srv.reject_every == 0):
        msg = b'{"error": {"message": "rate limited"}}'
        self.send_response(429 if self.path == "/v1/completions" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(msg)))
        self.end_headers()
        self.wfile.write(msg)
        return
      self.send_response(200)
      self.send_header("Content-Type", "text/event-stream")
      self.send_header("Connection", "close")
      self.end_headers()
      time.sleep(srv.first_s)
      for i in range(body["max_tokens"]):
        if i:
          time.sleep(srv.step_s)
        if srv.truncate_after is not None and i == srv.truncate_after:
          self.close_connection = True
          return  # the body ends here: a close-delimited stream cut off
        chunk = {"choices": [{"index": 0, "text": f" tok{i}", "finish_reason": None}]}
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.flush()
      usage = {"prompt_tokens": len(body["prompt"].split()),
               "completion_tokens": body["max_tokens"], "total_tokens": 0}
      self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
      self.wfile.write(b"data: [DONE]\n\n")
      self.wfile.flush()
      self.close_connection = True
    finally:
      with srv.lock:
        srv.live -= 1


@pytest.fixture
def fake_openai():
  srv = _FakeOpenAI(first_s=0.2, step_s=0.01)
  thread = threading.Thread(target=srv.serve_forever, daemon=True)
  thread.start()
  try:
    yield srv
  finally:
    srv.shutdown()
    srv.server_close()
    thread.join(10)


def test_openai_cli_open_loop_against_a_fake_sse_server(fake_openai, tmp_path):
  out = tmp_path / "oa"
  res = _cli("--api", "openai", "--target", f"127.0.0.1:{fake_openai.server_address[1]}",
             "--model", "fake", "--profile", "interactive", "--length_scale", "0.05", "--rate",
             "20", "--num_requests", "10", "--warmup_requests", "0", "--out", str(out))
  assert (res["sent"], res["ok"], res["rejected"], res["errors"]) == (10, 8, 2, 0)
  # open loop: 10 arrivals in ~0.5 s while each answer takes >= 0.25 s; serially >= 2 s
  srv = fake_openai
  assert srv.max_live >= 2 and srv.received[-1] - srv.received[0] < 1.6
  assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and
             b["model"] == "fake" and b["ignore_eos"] for b in srv.bodies)
  header, rows = _read_csv(out / "requests.csv")
  assert tuple(header) == runner.COLUMNS and len(rows) == 10
  ok = [r for r in rows if r["status"] == "ok"]
  assert len(ok) == 8 and {r["status"] for r in rows} == {"ok", "http_429"}
  for r in ok:
    # The server sleeps 0.2 s, then 10 ms per token: those bound TTFT and e2e from below. TPOT's
    # floor is half the step: a late first read on a loaded machine moves time from TPOT into
    # TTFT (all tokens in one burst would give ~0).
    assert float(r["ttft_s"]) >= 0.2 and 0.005 <= float(r["tpot_s"]) < 0.06
    assert r["output_tokens"] == r["max_tokens"] and int(r["prompt_tokens"]) == \
        int(r["prompt_len"])
    assert float(r["e2e_s"]) >= 0.2 + 0.01 * (int(r["output_tokens"]) - 1)
  summary = json.loads((out / "summary.json").read_text())
  assert summary["rejected_by_status"] == {"http_429": 2}
  assert summary["ttft_s"]["p50"] >= 0.2 and summary["slo"]["name"] == "interactive"
  assert summary["good"] == 8 - sum(float(r["ttft_s"]) > 0.45 for r in ok)
  assert _is_png(out / "latency.png")


def test_openai_stream_cut_off_before_done_is_an_error(fake_openai):
  """A close-delimited body that ends after 3 of 16 chunks, with no finish_reason, usage or
  [DONE], is ``stream_truncated``, never an ``ok`` request (it would count in goodput)."""
  import asyncio
  fake_openai.reject_every, fake_openai.truncate_after = 0, 3
  target = f"http://127.0.0.1:{fake_openai.server_address[1]}"

  async def one():
    driver = drivers.make_driver(drivers.DriverConfig("openai", target, model="fake"))
    try:
      return await driver.generate([1, 2], "a b", 16, "")
    finally:
      await driver.close()

  out = asyncio.run(one())
  assert out.status == "stream_truncated" and out.output_tokens == 3, out
  fake_openai.truncate_after = None
  assert asyncio.run(one()).status == "ok"  # the same server, the whole stream: ok


def test_openai_multi_turn_prompts_extend_the_previous_turn(fake_openai, tmp_path):
  cfg = app.LoadgenConfig(
      drivers.DriverConfig("openai", f"http://127.0.0.1:{fake_openai.server_address[1]}"),
      str(tmp_path / "mt"), Arrivals("poisson", 50.0),
      workload.WorkloadConfig("multi_turn", 0.05, 0, 0, 0.02), num_requests=3,
      warmup_requests=0, progress=False)
  fake_openai.first_s, fake_openai.reject_every = 0.01, 0
  s = app.run(cfg)
  bodies = fake_openai.bodies
  assert s["ok"] == s["sent"] == len(bodies) > 3 and s["turns_not_sent"] == 0
  answer = lambda b: "".join(f" tok{i}" for i in range(b["max_tokens"]))
  later = [p for p in bodies if any(p is not q and p["prompt"].startswith(q["prompt"] + answer(q))
                                    for q in bodies)]
  # every turn after a session's first is a previous prompt + its answer + new words
  assert len(later) == len(bodies) - 3


# ----- phaseserve and JetStream against a real server -----

@pytest.fixture(scope="module")
def server(tmp_path_factory):
  srv = ServerProc.start(tmp_path_factory.mktemp("loadgen_server"), *SMALL)
  try:
    yield srv
  finally:
    assert srv.stop() == 0, srv.log()


def _cfg(server, out, api="phaseserve", profile="interactive", rate=8.0, n=12, **kw):
  return app.LoadgenConfig(drivers.DriverConfig(api, server.target), str(out),
                           Arrivals("poisson", rate),
                           workload.WorkloadConfig(profile, 0.1, 0, -1, kw.pop("pause", None)),
                           num_requests=n, progress=False, **kw)


def test_phaseserve_run_with_server_timings(server, tmp_path):
  s = app.run(_cfg(server, tmp_path / "ps"))
  assert (s["sent"], s["ok"], s["rejected"], s["errors"]) == (12, 12, 0, 0)
  assert s["warmup_statuses"] == ["ok", "ok"] and s["config"]["workload"]["max_context"] == 128
  _, rows = _read_csv(tmp_path / "ps" / "requests.csv")
  for r in rows:
    assert r["output_tokens"] == r["max_tokens"] and r["finish_reason"] == "length"
    assert int(r["prompt_tokens"]) == int(r["prompt_len"])
    assert float(r["queue_s"]) >= 0 and float(r["prefill_s"]) > 0
    # the client's clock starts before the server's and ends after it
    assert float(r["ttft_s"]) >= float(r["server_ttft_s"]) - 1e-3
    assert float(r["e2e_s"]) >= float(r["server_e2e_s"]) - 1e-3
  assert s["queue_s"]["p50"] is not None and s["server_ttft_s"]["p99"] is not None


def test_phaseserve_multi_turn_sessions_resume_from_the_cache(server, tmp_path):
  s = app.run(_cfg(server, tmp_path / "mt", profile="multi_turn", rate=4.0, n=3, pause=0.02))
  assert s["ok"] == s["sent"] > 3 and s["errors"] == 0
  _, rows = _read_csv(tmp_path / "mt" / "requests.csv")
  by = {(int(r["session"]), int(r["turn"])): r for r in rows}
  later = [k for k in by if k[1] > 0]
  assert later
  for sess, turn in later:
    prev, cur = by[(sess, turn - 1)], by[(sess, turn)]
    assert int(cur["prompt_len"]) > int(prev["prompt_len"]) + int(prev["output_tokens"])
    # the previous turn's prompt + answer come back from the pinned pages (whole pages only)
    assert int(cur["cached_tokens"]) >= (int(prev["prompt_len"]) + int(prev["output_tokens"])
                                         - 1) // 16 * 16 > 0


def test_jetstream_run(server, tmp_path):
  s = app.run(_cfg(server, tmp_path / "js", api="jetstream", n=6, warmup_requests=0))
  assert (s["sent"], s["ok"]) == (6, 6) and s["queue_s"]["p50"] is None  # no server timings
  assert s["ttft_s"]["p99"] > 0 and s["output_tokens"] > 0


def test_find_capacity_cli_over_two_rates_then_resumed(server, tmp_path):
  out = tmp_path / "cap"
  args = ("--target", server.target, "--find_capacity", "--rates", "4,8", "--profile",
          "interactive", "--length_scale", "0.1", "--num_requests", "6", "--slo", "server",
          "--out", str(out))
  first = _cli(*args)
  assert first["measured_rates"] == [4.0, 8.0] and first["reused_rates"] == []
  done = {r: (out / "rates" / f"rate_{r}" / "requests.csv").read_bytes() for r in (4, 8)}
  requests_before = _served(server)
  again = _cli(*args)
  assert again["measured_rates"] == [] and again["reused_rates"] == [4.0, 8.0]
  assert _served(server) == requests_before  # nothing was sent
  assert done == {r: (out / "rates" / f"rate_{r}" / "requests.csv").read_bytes()
                  for r in (4, 8)}
  header, rows = _read_csv(out / "capacity.csv")
  assert tuple(header) == capacity.ROW_COLUMNS
  assert [(float(r["rate_per_s"]), r["source"]) for r in rows] == [(4.0, "reused"),
                                                                    (8.0, "reused")]
  assert all(int(r["ok"]) == 6 and float(r["ttft_p99_s"]) > 0 for r in rows)
  js = json.loads((out / "capacity.json").read_text())
  assert js["best_rate_per_s"] == first["best_rate_per_s"] and len(js["rows"]) == 2
  assert _is_png(out / "capacity.png") and _is_png(out / "rates" / "rate_4" / "latency.png")
  summary = json.loads((out / "rates" / "rate_8" / "summary.json").read_text())
  assert summary["rate_per_s"] == 8.0 and summary["sent"] == 6
  # another configuration in the same directory is refused, not mixed in
  r = subprocess.run([sys.executable, "-m", "launch.lab.loadgen", "--progress=false",
                      *args[:-2], "--seed", "1", "--out", str(out)], cwd=REPO, env=ENV,
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 2 and "another configuration" in r.stderr


def _served(server) -> float:
  return sum(v for k, v in server.metrics().items()
             if k.startswith("phaseserve_requests_total"))


# ----- MLPerf LoadGen's Server scenario (launch.lab.mlperf_server) -----

def _mlperf(*args: str, timeout: float = 180) -> dict:
  r = subprocess.run([sys.executable, "-m", "launch.lab.mlperf_server", *args], cwd=REPO,
                     env=ENV, capture_output=True, text=True, timeout=timeout)
  assert r.returncode in (0, 1), r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_mlperf_server_scenario_times_what_the_server_streams(fake_openai, tmp_path):
  """LoadGen's own TTFT and TPOT of a fake server that answers after 200 ms and then streams a
  token every 10 ms; its every 5th request refused (429) completes its query, counted."""
  fake_openai.reject_every = 5
  out = tmp_path / "fake"
  s = _mlperf("--target", f"127.0.0.1:{fake_openai.server_address[1]}", "--api", "openai",
              "--model", "m", "--qps", "20", "--queries", "24", "--output_lo", "6",
              "--output_hi", "10", "--out", str(out))
  assert s["queries"] == 24 and s["failed"] == 0 and s["statuses"]["ok"] + s["refused"] == 24
  assert 3 <= s["refused"] <= 6  # every 5th request of 25 (the readiness probe was the 1st)
  assert s["result"] in ("VALID", "INVALID") and s["min_queries_met"] is True
  assert 190 <= s["ttft_ms"]["50"] <= 600, s  # refused queries complete at once: p50 is served
  assert 9 <= s["tpot_ms"]["50"] <= 40, s
  bodies = fake_openai.bodies[1:]  # after the probe: streaming, greedy, ignore_eos, usage
  assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0 for b in bodies)
  assert all(6 <= b["max_tokens"] <= 10 and 56 <= len(b["prompt"].split()) <= 176 for b in bodies)
  for name in ("mlperf_log_summary.txt", "mlperf_log_detail.txt", "summary.json"):
    assert (out / name).is_file()
  assert s["server_steps"] is None  # its /metrics (the default for openai) has no step counters


def test_mlperf_server_scenario_on_the_tiny_server_and_the_table(server, tmp_path):
  s = _mlperf("--target", server.target, "--api", "phaseserve", "--vocab_size", "256",
              "--qps", "8", "--queries", "16", "--prompt_lo", "8", "--prompt_hi", "24",
              "--output_lo", "4", "--output_hi", "8", "--out", str(tmp_path / "tiny"),
              "--metrics_url", f"http://127.0.0.1:{server.metrics_port}/metrics")
  assert s["statuses"] == {"ok": 16} and s["failed"] == 0, s
  assert 0 < s["ttft_ms"]["50"] <= s["ttft_ms"]["99"] and 0 < s["tpot_ms"]["50"]
  assert s["completed_qps"] > 0
  # The server's own timeline over the run: 16 requests of 4-8 tokens, no program compiled.
  st = s["server_steps"]
  assert st["steps"] >= 8 and st["programs_after_ready"] == 0
  assert 0 < st["mean_decode_rows"] and st["prefill_tokens_per_step"] > 0
  assert all(v["wall"] >= 0 and v["cpu"] >= 0 for v in st["phases_ms"].values())
  assert st["phases_ms"]["dispatch"]["wall"] > 0
  assert sum(v["share"] for v in st["phases_ms"].values()) == pytest.approx(1.0)
  assert st["decode_only_steps"] == 0 or st["decode_only_step_ms"] > 0
  assert s["tpot_p50_over_decode_step"] is None or s["tpot_p50_over_decode_step"] > 0
  sv = st["server_ms"]  # the loop's view: at most what the client saw, first token to last
  assert 0 < sv["ttft"] <= sv["e2e"] and 0 < sv["tpot"] < sv["e2e"]
  pred = st["ttft_prediction"]  # the early-rejection predictor over the run
  assert pred["requests"] == 0 or (0 < pred["ratio_p10"] <= pred["ratio_p50"] <= pred["ratio_p90"]
                                   and 0 <= pred["within_0.8_1.25"] <= 1)
  r = subprocess.run([sys.executable, "-m", "launch.lab.mlperf_server", "--table",
                      f"{tmp_path / 'tiny'},{tmp_path / 'tiny'}", "--names", "phaseserve,again",
                      "--out", str(tmp_path)], cwd=REPO, env=ENV, capture_output=True,
                     text=True, timeout=60)
  assert r.returncode == 0, r.stderr[-2000:]
  lines = (tmp_path / "side_by_side.md").read_text().splitlines()
  assert lines[0].startswith("| server | target QPS") and len(lines) == 9
  assert lines[2].startswith("| phaseserve | 8 | ") and lines[2].endswith(f"| {s['result']} |")
  assert lines[5].startswith("| server | steps/s |") and lines[7].startswith("| phaseserve | ")
  assert lines[7].split("|")[-3].strip() == "0"  # no program compiled while serving


def test_histogram_quantile_interpolates_as_prometheus_does():
  b = [(0.5, 0.0), (1.0, 50.0), (2.0, 100.0), (float("inf"), 100.0)]
  assert server_steps.hist_quantile(b, 0.5) == 1.0
  assert server_steps.hist_quantile(b, 0.9) == pytest.approx(1.8)
  assert server_steps.hist_quantile(b, 0.25) == pytest.approx(0.75)
  assert server_steps.hist_quantile([(1.0, 0.0), (float("inf"), 10.0)], 0.5) == 1.0  # past the top
  assert server_steps.hist_quantile([(1.0, 0.0), (float("inf"), 0.0)], 0.5) is None
