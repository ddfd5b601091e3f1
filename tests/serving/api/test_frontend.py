"""serving.api.frontend over the hand-checkable FakeEngine on a live loop thread: validation naming
every field, admission (queue bound, quota, predicted SLO miss), the slow-consumer bound, engine
faults (recoverable and fatal), the watchdog, usage records exactly once, drain."""

from __future__ import annotations

import json
import math
import threading
import time

import prometheus_client as prom
import pytest

from models.text.tokenizer import ByteTokenizer
from serving.api import admission
from serving.api.auth import ApiKeys, KeyInfo, OverQuota, Quotas, Unauthenticated
from serving.api.faults import FaultInjector
from serving.fake_engine import FakeEngine, reference
from serving.api.frontend import Frontend, FrontendConfig
from serving.api.stream import ServiceError, Status
from serving.kv_pages import PageBudget, PagePool
from serving.lifecycle import Metrics
from serving.loop import ServingLoop
from serving.stop import FinishReason
from serving.api.usage import UsageLog
from serving.api.validation import GenerateArgs, InvalidArgument, Limits, validate

TOK = ByteTokenizer()
VOCAB = ByteTokenizer.VOCAB_SIZE
LIMITS = Limits(max_context=64, default_max_tokens=8, max_n=4, max_stop_strings=3,
                max_stop_chars=8)
ANON = KeyInfo("anonymous")


def _frontend(tmp_path=None, *, config=None, pages=64, page_size=4, slots=4, max_waiting=64,
              fault=False, start=True, cache=False):
  pool = PagePool(PageBudget(page_size, pages), max_seq_tokens=64)
  from serving.prefix_cache import PrefixCache
  from serving.scheduler import Scheduler
  sched = Scheduler(pool, TOK, max_slots=slots, max_step_tokens=32, max_chunk=16,
                    max_waiting=max_waiting, prefix_cache=PrefixCache(pool) if cache else None)
  reg = prom.CollectorRegistry()
  faults = FaultInjector() if fault else None
  loop = ServingLoop(sched, FakeEngine(pages, page_size, VOCAB, slots, lag=1), Metrics(reg),
                     max_traces=16, fault_hook=faults)
  usage = UsageLog(str(tmp_path / "usage.jsonl") if tmp_path else None)
  cfg = config or FrontendConfig(LIMITS)
  fe = Frontend(loop, TOK, cfg, reg, usage, faults=faults)
  if start:
    loop.start()
    fe.set_state("serving")
  return fe


def _collect(stream, timeout=10.0):
  ids: dict[int, list[int]] = {}
  finals = {}
  t0 = time.monotonic()
  for i, out in stream.events():
    ids.setdefault(i, []).extend(out.token_ids)
    if out.finished:
      finals[i] = out
    assert time.monotonic() - t0 < timeout
  return ids, finals


@pytest.fixture
def fe(tmp_path):
  f = _frontend(tmp_path)
  yield f
  f.loop.stop(timeout=5)


# -- validation: every bad field is named ----------------------------------------------------

BAD = [
    (dict(), "prompt"),
    (dict(text="a", token_ids=[1]), "prompt"),
    (dict(text=""), "text"),
    (dict(text=b"ab\xff"), "text"),
    (dict(token_ids=[]), "token_ids"),
    (dict(token_ids=[1, -1]), "token_ids"),
    (dict(token_ids=[VOCAB]), "token_ids"),
    (dict(token_ids=list(range(1, 65))), "prompt"),  # longer than the context
    (dict(token_ids=[1] * 60, max_tokens=5), "max_tokens"),  # prompt + max_tokens > context
    (dict(text="a", max_tokens=0), "max_tokens"),
    (dict(text="a", max_tokens=-1), "max_tokens"),
    (dict(text="a", max_tokens=2**31 - 1), "max_tokens"),
    (dict(text="a", temperature=math.nan), "temperature"),
    (dict(text="a", temperature=math.inf), "temperature"),
    (dict(text="a", temperature=-0.5), "temperature"),
    (dict(text="a", temperature=10**400), "temperature"),  # a JSON integer beyond a double
    (dict(text="a", top_p=10**400), "top_p"),
    (dict(text="a", top_p=0.0), "top_p"),
    (dict(text="a", top_p=1.5), "top_p"),
    (dict(text="a", top_k=-1), "top_k"),
    (dict(text="a", top_k=VOCAB + 1), "top_k"),
    (dict(text="a", stop=[""]), "stop"),
    (dict(text="a", stop=["x"] * 4), "stop"),
    (dict(text="a", stop=["x" * 9]), "stop"),
    (dict(text="a", stop=[b"\xc3"]), "stop"),
    (dict(text="a", stop_token_ids=[VOCAB]), "stop_token_ids"),
    (dict(text="a", n=-1), "n"),
    (dict(text="a", n=5), "n"),
    (dict(text="a", logprobs=99), "logprobs"),
    (dict(text="a", min_tokens=9, max_tokens=8), "min_tokens"),
    (dict(text="a", slo_class="gold"), "slo_class"),
    (dict(messages=[("user", b"\xfe")]), "messages"),
    (dict(messages=[("a role", "hi")]), "messages"),
    (dict(text="a", seed=2**32), "seed"),
    (dict(text="a", presence_penalty=2.5), "presence_penalty"),
    (dict(text="a", frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(text="a", frequency_penalty=-2.01), "frequency_penalty"),
    (dict(text="a", repetition_penalty=0.0), "repetition_penalty"),
    (dict(text="a", repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(text="a", logit_bias={VOCAB: 1.0}), "logit_bias"),
    (dict(text="a", logit_bias={-1: 1.0}), "logit_bias"),
    (dict(text="a", logit_bias={3: 100.5}), "logit_bias"),
    (dict(text="a", logit_bias={t: 1.0 for t in range(301)}), "logit_bias"),
]


@pytest.mark.parametrize("kwargs,field", BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_validate_names_the_field(kwargs, field):
  with pytest.raises(InvalidArgument) as e:
    validate(GenerateArgs(**kwargs), TOK, LIMITS)
  assert e.value.field == field, str(e.value)


def test_validate_defaults_and_field_names():
  v = validate(GenerateArgs(text="hi"), TOK, LIMITS)
  assert v.prompt_ids == (TOK.bos_id, ord("h"), ord("i")) and v.n == 1
  assert v.stop.max_tokens == 8 and v.sampling.temperature == 0 and v.sampling.top_k == 0
  assert v.slo_class == "best_effort" and 0 <= v.sampling.seed < 2**32
  assert not v.sampling.penalized and v.sampling.logit_bias == ()
  p = validate(GenerateArgs(text="hi", presence_penalty=-2, frequency_penalty=2,
                            repetition_penalty=1.3, logit_bias={9: -100, 4: 100}),
               TOK, LIMITS).sampling
  assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-2, 2, 1.3)
  assert p.logit_bias == ((4, 100.0), (9, -100.0))
  # The default max_tokens shrinks to the context left; an explicit one never does.
  assert validate(GenerateArgs(token_ids=[1] * 60), TOK, LIMITS).stop.max_tokens == 4
  assert validate(GenerateArgs(text="a", n=0), TOK, LIMITS).n == 1  # JetStream: 0 means 1
  with pytest.raises(InvalidArgument) as e:
    validate(GenerateArgs(token_ids=[1], n=9), TOK, LIMITS, {"n": "num_samples"})
  assert e.value.field == "num_samples"


# -- streams ---------------------------------------------------------------------------------

def test_generate_matches_reference_and_writes_usage(fe, tmp_path):
  args = GenerateArgs(token_ids=[5, 6, 7], max_tokens=6, ignore_eos=True, seed=11, n=2)
  stream = fe.generate(args, ANON, "client-1")
  ids, finals = _collect(stream)
  for i in (0, 1):
    assert ids[i] == reference([5, 6, 7], 11 + i, 6, VOCAB)
    assert finals[i].finish_reason is FinishReason.LENGTH
  time.sleep(0.05)
  recs = [json.loads(l) for l in (tmp_path / "usage.jsonl").read_text().splitlines()]
  assert len(recs) == 1 and recs[0]["status"] == "ok" and recs[0]["completion_tokens"] == 12
  assert recs[0]["client_request_id"] == "client-1" and recs[0]["finish_reason"] == [
      "length", "length"]
  assert recs[0]["ttft_s"] > 0 and recs[0]["e2e_s"] >= recs[0]["ttft_s"]
  assert fe.live == 0 and fe.loop.scheduler.kv.pool.pages_used == 0


def test_n_samples_share_the_prompt_pages_through_the_cache(tmp_path):
  fe = _frontend(tmp_path, cache=True)
  try:
    prompt = list(range(40, 49))  # 9 tokens: 2 whole pages of 4
    stream = fe.generate(GenerateArgs(token_ids=prompt, max_tokens=5, ignore_eos=True, seed=3,
                                      n=3), ANON)
    ids, finals = _collect(stream)
    for i in range(3):
      assert ids[i] == reference(prompt, 3 + i, 5, VOCAB)
    assert [finals[i].usage.cached_tokens for i in range(3)] == [0, 8, 8]
    time.sleep(0.05)
    rec = json.loads((tmp_path / "usage.jsonl").read_text().splitlines()[-1])
    assert rec["cached_tokens"] == 0 and rec["prompt_tokens"] == 9  # the prompt once, sample 0's
    # Cancelled while samples 1-2 still wait for sample 0: every sample ends.
    s2 = fe.generate(GenerateArgs(token_ids=list(range(60, 69)), max_tokens=5, n=3), ANON)
    s2.cancel(Status.CANCELLED, "test")
    deadline = time.monotonic() + 5
    while not s2.ended and time.monotonic() < deadline:
      time.sleep(0.01)
    assert s2.ended and s2.status is Status.CANCELLED
    time.sleep(0.1)
    assert fe.loop.scheduler.kv.pool.pages_used == 0 and fe.live == 0
  finally:
    fe.loop.stop(timeout=5)


def _last_record(tmp_path, count, timeout=5.0):
  """The usage log's last record once it holds ``count`` (written on the loop's thread)."""
  path = tmp_path / "usage.jsonl"
  deadline = time.monotonic() + timeout
  while True:
    lines = path.read_text().splitlines() if path.exists() else []
    if len(lines) >= count or time.monotonic() > deadline:
      assert len(lines) == count, lines
      return json.loads(lines[-1])
    time.sleep(0.01)


def test_n_samples_bill_the_prompt_once_on_every_api(tmp_path):
  """n = 3 samples of a 9-token prompt whose 2 whole pages are cached: the usage record, the
  quota, OpenAI's ``usage`` and the gRPC finals all count the prompt once (9), the completion
  summed over the samples (15) and the cached tokens of sample 0 (8, never more than the
  prompt)."""
  import grpc
  import http.client
  import prometheus_client as prom
  from serving.api import grpc_server, http_server
  from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
  from serving.api.proto.phaseserve.v1 import generation_pb2_grpc as pb_grpc
  fe = _frontend(tmp_path, cache=True, config=FrontendConfig(LIMITS, early_reject=False))
  web = http_server.serve(fe, ApiKeys.none(), prom.CollectorRegistry(),
                          http_server.HttpOptions("m", max_context=64))
  rpc = grpc_server.serve(fe, ApiKeys.none(), pb.ServerInfoResponse(),
                          grpc_server.ServerOptions())
  want = {"prompt_tokens": 9, "cached_tokens": 8, "completion_tokens": 15}
  try:
    prompt = list(range(40, 49))  # 9 tokens: 2 whole pages of 4
    _collect(fe.generate(GenerateArgs(token_ids=prompt, max_tokens=2), ANON))  # caches them
    _last_record(tmp_path, 1)
    alice = KeyInfo("alice", tokens_per_min=1000)
    stream = fe.generate(GenerateArgs(token_ids=prompt, max_tokens=5, ignore_eos=True, n=3),
                         alice)
    _, finals = _collect(stream)
    assert finals[0].usage.cached_tokens == 8
    rec = _last_record(tmp_path, 2)
    assert {k: rec[k] for k in want} == want
    assert stream.quota is not None and stream.quota[1] == 9 + 15  # the quota agrees
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=30)
    try:
      conn.request("POST", "/v1/completions", body=json.dumps(
          {"model": "m", "prompt": prompt, "max_tokens": 5, "ignore_eos": True, "n": 3}),
          headers={"Content-Type": "application/json"})
      resp = conn.getresponse()
      body = json.loads(resp.read())
    finally:
      conn.close()
    assert resp.status == 200, body
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 15, "total_tokens": 24,
                             "prompt_tokens_details": {"cached_tokens": 8}}
    rec = _last_record(tmp_path, 3)
    assert {k: rec[k] for k in want} == want and rec["api"] == "openai"
    with grpc.insecure_channel(f"127.0.0.1:{rpc.port}") as ch:
      out = list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
          token_ids=pb.TokenIds(ids=prompt), max_tokens=5, ignore_eos=True, n=3), timeout=30))
    fin = {r.index: r.final.usage for r in out if r.HasField("final")}
    assert sorted(fin) == [0, 1, 2]
    assert all(u.prompt_tokens == 9 and u.cached_tokens <= 9 for u in fin.values())
    got = {"prompt_tokens": fin[0].prompt_tokens, "cached_tokens": fin[0].cached_tokens,
           "completion_tokens": sum(u.completion_tokens for u in fin.values())}
    assert got == want == {k: v for k, v in _last_record(tmp_path, 4).items() if k in want}
  finally:
    rpc.server.stop(None)
    web.stop(2)
    fe.loop.stop(timeout=5)


def test_held_back_samples_count_against_the_queue_bound(tmp_path):
  """Samples 1..n-1 wait for sample 0's prefill outside the scheduler: the queue bound counts
  them, so what is admitted fits the scheduler's queue and is never rejected after admission."""
  fe = _frontend(tmp_path, cache=True, slots=1, pages=256, max_waiting=8 + 4,
                 config=FrontendConfig(LIMITS, max_queue=8, early_reject=False))
  try:
    admitted, refused = [], 0
    for k in range(12):
      try:
        admitted.append(fe.generate(GenerateArgs(token_ids=[k + 1] * 9, max_tokens=3, n=4,
                                                 ignore_eos=True), ANON))
      except ServiceError as e:
        assert e.status is Status.REJECTED and e.reason == "queue_full"
        refused += 1
    assert admitted and refused
    for stream in admitted:
      ids, finals = _collect(stream)
      assert stream.status is Status.OK and sorted(finals) == [0, 1, 2, 3]
    assert fe._held == 0 and fe.live == 0
  finally:
    fe.loop.stop(timeout=5)


def test_refusals_reach_no_engine_and_are_recorded(fe, tmp_path):
  steps = fe.loop.engine.steps
  with pytest.raises(ServiceError) as e:
    fe.generate(GenerateArgs(text="a", top_p=2.0), ANON, "bad")
  assert e.value.status is Status.INVALID_ARGUMENT and "top_p" in e.value.message
  time.sleep(0.05)
  assert fe.loop.engine.steps == steps
  rec = json.loads((tmp_path / "usage.jsonl").read_text().splitlines()[-1])
  assert rec["status"] == "invalid_argument" and rec["client_request_id"] == "bad"


def test_queue_bound_rejects_at_once(tmp_path):
  fe = _frontend(tmp_path, config=FrontendConfig(LIMITS, max_queue=2, early_reject=False),
                 start=False)
  fe.set_state("serving")  # the loop is not running: everything stays queued
  a = fe.generate(GenerateArgs(text="a"), ANON)
  fe.generate(GenerateArgs(text="b"), ANON)
  with pytest.raises(ServiceError) as e:
    fe.generate(GenerateArgs(text="c"), ANON)
  assert e.value.status is Status.REJECTED and "queue is full" in e.value.message
  fe.loop.start()
  try:
    _collect(a)
  finally:
    fe.loop.stop(timeout=5)


def test_predicted_slo_miss_is_rejected_with_the_prediction(tmp_path):
  """While the server is busy a predicted miss is refused; an idle server admits the same
  request (nothing to protect; its steps refresh the estimate); a best-effort one is admitted."""
  classes = (admission.SloClass("server", 2.0, 0.2), admission.SloClass("tight", 1e-6, 1.0))
  limits = Limits(max_context=64, slo_classes=("server", "tight"))
  fe = _frontend(tmp_path, config=FrontendConfig(limits, classes))
  try:
    _collect(fe.generate(GenerateArgs(text="abc", slo_class="server"), ANON))
    _collect(fe.generate(GenerateArgs(text="abc", slo_class="tight"), ANON))  # idle: admitted
    fe.loop.engine.execute = _slow(fe.loop.engine.execute, 0.02)
    busy = fe.generate(GenerateArgs(token_ids=[1], max_tokens=60, ignore_eos=True), ANON)
    deadline = time.monotonic() + 5
    while not fe.loop.scheduler.num_running:
      assert time.monotonic() < deadline
      time.sleep(0.005)
    with pytest.raises(ServiceError) as e:
      fe.generate(GenerateArgs(text="abc", slo_class="tight"), ANON)
    assert e.value.status is Status.REJECTED and "predicted TTFT" in e.value.message
    # A request naming no class is best effort: predicted, never refused for it (as vLLM).
    free = fe.generate(GenerateArgs(text="abc"), ANON)
    assert free.validated.slo_class == "best_effort" and free.predicted_ttft is not None
    _collect(free)
    _collect(busy)
  finally:
    fe.loop.stop(timeout=5)


def test_prediction_grows_with_the_backlog():
  p = lambda backlog: admission.predict(admission.Load(0.01, backlog, 4, 36, 16)).ttft_s
  assert p(0) == pytest.approx(0.02) and p(320) == pytest.approx(0.12)  # ceil(336 / 32) + 1 steps
  assert admission.predict(admission.Load(0.05, 0, 0, 32, 8)).miss(
      admission.MLPERF_CLASSES[0]) is not None  # 50 ms TPOT > interactive's 40 ms
  assert admission.parse_classes("a:1:0.1,b:2:0.2")[1] == admission.SloClass("b", 2.0, 0.2)
  with pytest.raises(ValueError):
    admission.parse_classes("a:1")


def test_slow_consumer_is_cancelled_and_its_pages_freed(tmp_path):
  fe = _frontend(tmp_path, config=FrontendConfig(LIMITS, stream_buffer_bytes=1024,
                                                 stream_stall_s=0.2, early_reject=False))
  try:
    stream = fe.generate(GenerateArgs(token_ids=[1, 2], max_tokens=60, ignore_eos=True), ANON)
    deadline = time.monotonic() + 10
    while not stream.ended and time.monotonic() < deadline:  # never read: the buffer fills
      time.sleep(0.01)
    assert stream.ended and stream.status is Status.SLOW_CONSUMER
    assert stream.finals[0].finish_reason is FinishReason.CANCELLED
    assert sum(stream.completion) < 60
    time.sleep(0.05)
    assert fe.loop.scheduler.kv.pool.pages_used == 0 and fe.loop.scheduler.num_running == 0
  finally:
    fe.loop.stop(timeout=5)


def test_a_finished_stream_read_late_is_not_a_slow_consumer(tmp_path):
  """The last output may land in a buffer older than the stall bound: the request is over and
  holds nothing, so the late reader gets every token and an OK end."""
  # Two tokens, one step (>= 40 ms) apart: only the final push can find the buffer past the
  # 20 ms stall bound, whatever the machine's load.
  fe = _frontend(tmp_path, config=FrontendConfig(LIMITS, stream_stall_s=0.02,
                                                 early_reject=False))
  fe.loop.engine.execute = _slow(fe.loop.engine.execute, 0.04)
  try:
    stream = fe.generate(GenerateArgs(token_ids=[1, 2], max_tokens=2, ignore_eos=True, seed=1),
                         ANON)
    deadline = time.monotonic() + 10
    while not stream.ended and time.monotonic() < deadline:  # read only once it has ended
      time.sleep(0.01)
    ids, finals = _collect(stream)
    assert stream.status is Status.OK and finals[0].finish_reason is FinishReason.LENGTH
    assert ids[0] == reference([1, 2], 1, 2, VOCAB)
    usage = tmp_path / "usage.jsonl"
    deadline = time.monotonic() + 10  # the record is written just after the stream ends
    while not (usage.exists() and usage.read_text().strip()) and time.monotonic() < deadline:
      time.sleep(0.01)
    assert json.loads(usage.read_text().splitlines()[-1])["status"] == "ok"
  finally:
    fe.loop.stop(timeout=5)


def test_recoverable_fault_fails_the_step_and_serving_goes_on(tmp_path):
  fe = _frontend(tmp_path, fault=True)
  try:
    victim = fe.generate(GenerateArgs(text="x", max_tokens=8), ANON, "fault:raise")
    with pytest.raises(ServiceError) as e:
      _collect(victim)
    assert e.value.status is Status.ERROR and "injected fault" in e.value.message
    ok = fe.generate(GenerateArgs(token_ids=[3, 4], max_tokens=5, ignore_eos=True, seed=1), ANON)
    assert _collect(ok)[0][0] == reference([3, 4], 1, 5, VOCAB)
    assert fe.loop.failed is None and fe.loop.faults == 1
    assert fe.loop.scheduler.kv.pool.pages_used == 0
  finally:
    fe.loop.stop(timeout=5)


def test_fatal_fault_fails_everything_and_the_state(tmp_path):
  fe = _frontend(tmp_path, fault=True, start=False)
  fe.set_state("serving")
  victim = fe.generate(GenerateArgs(text="x"), ANON, "fault:fatal")
  queued = [fe.generate(GenerateArgs(token_ids=[1, 2], max_tokens=40, ignore_eos=True), ANON)
            for _ in range(6)]  # 3 run beside the victim, 3 wait
  fe.loop.start()
  fe.start_watchdog(0.02)
  try:
    for s in queued + [victim]:
      with pytest.raises(ServiceError):
        _collect(s)
    deadline = time.monotonic() + 5
    while fe.state != "failed" and time.monotonic() < deadline:
      time.sleep(0.01)
    assert fe.state == "failed" and fe.loop.failed
    with pytest.raises(ServiceError) as e:
      fe.generate(GenerateArgs(text="a"), ANON)
    assert e.value.status is Status.UNAVAILABLE
  finally:
    fe.stop_watchdog()
    fe.loop.stop(timeout=5)


def test_watchdog_fails_streams_of_a_hung_step(tmp_path):
  fe = _frontend(tmp_path, config=FrontendConfig(LIMITS, watchdog_s=0.3),
                 fault=True)
  fe.start_watchdog(0.02)
  try:
    t0 = time.monotonic()
    s = fe.generate(GenerateArgs(text="x", max_tokens=8), ANON, "fault:hang:3")
    with pytest.raises(ServiceError) as e:
      _collect(s)
    assert e.value.status is Status.UNAVAILABLE and "hung" in e.value.message
    assert time.monotonic() - t0 < 2.5 and fe.state == "failed"
  finally:
    fe.stop_watchdog()
    fe.loop.stop(timeout=5)


def test_drain_lets_live_requests_finish_then_cancels_the_rest(tmp_path):
  fe = _frontend(tmp_path, config=FrontendConfig(LIMITS, early_reject=False), slots=1)
  short = fe.generate(GenerateArgs(token_ids=[1], max_tokens=3, ignore_eos=True), ANON)
  results = {}
  t = threading.Thread(target=lambda: results.setdefault("short", _collect(short)))
  t.start()
  t.join(5)
  stuck = fe.generate(GenerateArgs(token_ids=[2], max_tokens=60, ignore_eos=True), ANON)
  fe.loop.engine.execute = _slow(fe.loop.engine.execute, 0.02)
  cancelled = fe.drain(grace_s=0.2)
  assert cancelled == 1 and stuck.ended and stuck.status is Status.UNAVAILABLE
  with pytest.raises(ServiceError) as e:
    fe.generate(GenerateArgs(text="a"), ANON)
  assert e.value.status is Status.UNAVAILABLE
  lines = (tmp_path / "usage.jsonl").read_text().splitlines()
  assert sorted(json.loads(l)["status"] for l in lines) == ["ok", "unavailable", "unavailable"]
  fe.loop.stop(timeout=5)


def test_a_drain_that_begins_during_admission_refuses_the_request(tmp_path):
  """generate() checks the state first; a drain that starts after that check (here: inside the
  quota check) must not let the request run past the drain: it is refused UNAVAILABLE, with its
  usage record, and nothing is submitted."""
  fe = _frontend(tmp_path)
  admit = fe.quotas.admit

  def drain_meanwhile(*args):
    fe.set_state("draining")
    return admit(*args)

  fe.quotas.admit = drain_meanwhile
  try:
    with pytest.raises(ServiceError) as e:
      fe.generate(GenerateArgs(token_ids=[1, 2], max_tokens=4), ANON)
    assert e.value.status is Status.UNAVAILABLE
    assert fe.live == 0 and fe.loop.idle and fe._backlog == 0
    assert fe.drain(grace_s=0.1) == 0
    rec = json.loads((tmp_path / "usage.jsonl").read_text().splitlines()[-1])
    assert rec["status"] == "unavailable"
  finally:
    fe.loop.stop(timeout=5)


def _slow(fn, s):
  def run(plan):
    time.sleep(s)
    return fn(plan)
  return run


def test_api_keys_and_quotas(tmp_path):
  path = tmp_path / "keys.json"
  path.write_text(json.dumps({"k1": {"name": "alice", "requests_per_min": 2},
                              "k2": {"name": "bob", "tokens_per_min": 100}}))
  keys = ApiKeys.load(str(path))
  assert keys.authenticate("k1").name == "alice"
  for bad in (None, "", "nope"):
    with pytest.raises(Unauthenticated):
      keys.authenticate(bad)
  q = Quotas()
  alice, bob = keys.authenticate("k1"), keys.authenticate("k2")
  q.admit(alice, 10, 0.0)
  q.admit(alice, 10, 1.0)
  with pytest.raises(OverQuota):
    q.admit(alice, 10, 2.0)
  q.admit(alice, 10, 61.0)  # the window slid past the first
  entry = q.admit(bob, 90, 0.0)
  with pytest.raises(OverQuota):
    q.admit(bob, 20, 1.0)
  q.settle(entry, 30)  # it used less than it might have
  q.admit(bob, 20, 1.0)
  path.write_text(json.dumps({"k": {"name": "x", "bogus": 1}}))
  with pytest.raises(ValueError, match="bogus"):
    ApiKeys.load(str(path))


@pytest.mark.parametrize("field", ["requests_per_min", "tokens_per_min"])
@pytest.mark.parametrize("value", [True, False])
def test_api_keys_refuse_a_boolean_quota(tmp_path, field, value):
  """JSON true is no quota of 1 (bool is an int in Python): the file is refused, naming the key
  and the field."""
  path = tmp_path / "keys.json"
  path.write_text(json.dumps({"k1": {"name": "alice", field: value}}))
  with pytest.raises(ValueError, match=f"alice.*{field}.*boolean"):
    ApiKeys.load(str(path))


class _ChatBytes(ByteTokenizer):
  @property
  def chat_template(self) -> str:
    return ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_messages_are_rendered_by_the_chat_template():
  tok = _ChatBytes()
  v = validate(GenerateArgs(messages=[("system", "be brief"), ("user", "hi")]), tok, LIMITS)
  assert v.prompt_ids == tuple(b"<system>be brief<user>hi<assistant>")
  with pytest.raises(InvalidArgument) as e:
    validate(GenerateArgs(messages=[]), tok, LIMITS)
  assert e.value.field == "messages"
