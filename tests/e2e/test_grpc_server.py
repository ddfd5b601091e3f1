"""launch.server as a real process on 127.0.0.1 (tiny model), one server for the module: the API,
health and reflection, every bad input's status, early rejection, n samples, cancellation of 100
streams, deadlines, an injected engine fault, a client that stops reading, JetStream clients
with stubs from JetStream's published proto, and a 200-stream load test."""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from launch import defaults
from models.config import get_preset
from models.cpu import cpuinfo
from models.text.tokenizer import ByteTokenizer
from models.transformer import forward
from models.weights import init_params
from serving.generator import Generator
from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
from serving.api.proto.phaseserve.v1 import generation_pb2_grpc as pb_grpc
from serving.sampling import SamplingParams
from tests.grpc_harness import TINY, ServerProc
from tests.penalty_ref import check_greedy
from tests.refenv import REPO

TOK = ByteTokenizer()
VOCAB = ByteTokenizer.VOCAB_SIZE


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("grpc")
  s = ServerProc.start(
      tmp, *TINY, "--max_queue", "256", "--fault_injection", "--max_message_bytes", "65536",
      "--slo_classes", "interactive:0.45:0.04,server:2:0.2,long:6:0.175,impossible:1e-9:10",
      "--slo_scale", "1000", "--stream_stall_s", "1", "--stream_buffer_bytes", "65536",
      "--usage_log", str(tmp / "usage.jsonl"))
  try:
    yield s
  finally:
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def stub(server):
  with server.channel() as ch:
    yield pb_grpc.GenerationStub(ch)


def _run(stub, req: pb.GenerateRequest, timeout: float = 60.0):
  """(ids per sample, text per sample, finals per sample) of one Generate call."""
  ids: dict[int, list[int]] = {}
  text: dict[int, str] = {}
  finals: dict[int, pb.Final] = {}
  for r in stub.Generate(req, timeout=timeout):
    ids.setdefault(r.index, []).extend(r.token_ids)
    text[r.index] = text.get(r.index, "") + r.text
    if r.HasField("final"):
      finals[r.index] = r.final
  return ids, text, finals


def _greedy_reference(prompt: list[int], n: int) -> list[int]:
  cfg = get_preset("tiny")
  params = init_params(cfg, jax.random.key(0), jnp.float32)  # launch.server --param_seed 0
  gen = Generator(cfg, params, steps_per_call=4)
  return [int(s[0]) for s in gen.stream([prompt], n, SamplingParams(), stop_ids=())]


def test_health_and_reflection(server):
  assert server.health("") == health_pb2.HealthCheckResponse.SERVING
  assert server.health("phaseserve.v1.Generation") == health_pb2.HealthCheckResponse.SERVING
  assert server.health("jetstream_proto.Orchestrator") == health_pb2.HealthCheckResponse.SERVING
  with server.channel() as ch:
    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]), timeout=10))
  names = {s.name for s in resp.list_services_response.service}
  assert {"phaseserve.v1.Generation", "jetstream_proto.Orchestrator",
          "grpc.health.v1.Health"} <= names
  m = server.metrics()
  assert m["phaseserve_startup_seconds"] > 0
  assert "jetstream_prefill_backlog_size" in m and "jetstream_slots_used_percentage" in m


def test_greedy_text_matches_the_reference(stub):
  ids, text, finals = _run(stub, pb.GenerateRequest(text="Hello", max_tokens=12,
                                                    ignore_eos=True))
  prompt = [TOK.bos_id] + TOK.encode("Hello")
  assert ids[0] == _greedy_reference(prompt, 12)
  f = finals[0]
  assert f.finish_reason == pb.LENGTH and f.usage.prompt_tokens == len(prompt)
  assert f.usage.completion_tokens == 12 and f.usage.cached_tokens == 0
  t = f.timings
  assert 0 < t.queue_s <= t.ttft_s <= t.e2e_s and t.HasField("prefill_s") and t.tpot_s > 0
  assert text[0] == TOK.decode(ids[0])


def test_logprobs_and_stops_over_the_wire(stub):
  prompt = [TOK.bos_id] + TOK.encode("Hello")
  greedy = _greedy_reference(prompt, 12)
  resp = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=12,
                                               ignore_eos=True, logprobs=3), timeout=60))
  lps = [lp for r in resp for lp in r.logprobs]
  assert [lp.token_id for lp in lps] == greedy
  for lp in lps:  # greedy: the chosen id is the best of the raw distribution
    assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id
    assert lp.logprob == pytest.approx(lp.top[0].logprob, abs=1e-6) and lp.logprob <= 0
    assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
  stop_at = greedy[4]  # the first position where this id appears ends the sample
  first = greedy.index(stop_at)
  ids, _, finals = _run(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                                 max_tokens=12, stop_token_ids=[stop_at]))
  assert ids[0] == greedy[:first + 1] and finals[0].finish_reason == pb.STOP
  text = TOK.decode(greedy)
  needle = text[2:4] if len(text) >= 4 else None
  if needle and needle.isprintable() and "\ufffd" not in needle:
    _, out, finals = _run(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                                   max_tokens=12, stop=[needle]))
    assert finals[0].finish_reason == pb.STOP and out[0] == text[:text.index(needle)]


def test_penalties_and_logit_bias_over_the_wire(stub):
  """A greedy request with every penalty and a logit bias follows the numpy reference over the
  model's own logits; a bias of +100 forces an id; -100 bans the plain run's first id."""
  prompt = [TOK.bos_id] + TOK.encode("Hello")
  plain = _greedy_reference(prompt, 12)
  sampling = pb.Sampling(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.5,
                         logit_bias={plain[0]: -100.0, 65: 2.0})
  ids, _, _ = _run(stub, pb.GenerateRequest(text="Hello", max_tokens=12, ignore_eos=True,
                                            sampling=sampling))
  got = ids[0]
  assert plain[0] not in got and got != plain
  cfg = get_preset("tiny")
  params = init_params(cfg, jax.random.key(0), jnp.float32)  # launch.server --param_seed 0
  logits = np.asarray(forward(params, jnp.asarray([prompt + got[:-1]]), cfg=cfg)[0])
  want = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.5,
                        logit_bias=((65, 2.0), (plain[0], -100.0)))
  assert check_greedy(logits, prompt, got, want) in ("equal", "near-tie")
  ids, _, _ = _run(stub, pb.GenerateRequest(text="Hello", max_tokens=6, ignore_eos=True,
                                            sampling=pb.Sampling(logit_bias={200: 100.0})))
  assert ids[0] == [200] * 6


def test_text_deltas_never_split_a_character(stub):
  """Random bytes from a random model at temperature 1: the deltas are whole characters, so
  their concatenation is the decode of all ids (a split sequence would decode differently)."""
  req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0xE2, 0x82, 0xAC, 0xC3]), max_tokens=60,
                           ignore_eos=True, sampling=pb.Sampling(temperature=1.0, seed=7))
  pieces = []
  ids = []
  for r in stub.Generate(req, timeout=60):
    pieces.append(r.text)
    ids.extend(r.token_ids)
  assert "".join(pieces) == TOK.decode(ids)
  assert any(b >= 0x80 for b in ids)  # multi-byte material was generated


def test_n_samples_equal_single_requests_with_seed_plus_i(stub):
  base = dict(token_ids=pb.TokenIds(ids=[10, 20, 30]), max_tokens=8, ignore_eos=True)
  ids, _, finals = _run(stub, pb.GenerateRequest(
      n=3, sampling=pb.Sampling(temperature=1.0, seed=5), **base))
  assert sorted(finals) == [0, 1, 2]
  for i in range(3):
    alone, _, _ = _run(stub, pb.GenerateRequest(
        sampling=pb.Sampling(temperature=1.0, seed=5 + i), **base))
    assert ids[i] == alone[0]


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server, stub):
  prompt = [TOK.bos_id] + list(range(100, 140))  # 41 ids: 2 whole pages of 16 reusable
  req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=6, ignore_eos=True)
  before = server.metrics().get("phaseserve_prefix_cache_hit_tokens_total", 0)
  first, _, f1 = _run(stub, req)
  again, _, f2 = _run(stub, req)
  assert first == again and first[0] == _greedy_reference(prompt, 6)
  assert f1[0].usage.cached_tokens == 0 and f2[0].usage.cached_tokens == 32
  assert server.metrics()["phaseserve_prefix_cache_hit_tokens_total"] - before == 32


def test_a_session_turn_resumes_from_the_previous_turns_kv(stub):
  turn1 = [TOK.bos_id] + list(range(150, 170))  # 21 ids
  ids1, _, _ = _run(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=turn1), max_tokens=16,
                                             ignore_eos=True, session_id="conv-1"))
  turn2 = turn1 + ids1[0] + [10, 11]  # extends prompt + answer, on ids
  ids2, _, f2 = _run(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=turn2), max_tokens=4,
                                              ignore_eos=True, session_id="conv-1"))
  assert f2[0].usage.cached_tokens == 32  # turn 1 wrote 36 positions: 2 whole pages of 16
  assert ids2[0] == _greedy_reference(turn2, 4)


def test_tokenize_detokenize_server_info(stub):
  ids = stub.Tokenize(pb.TokenizeRequest(text="héllo", add_bos=True), timeout=10).token_ids
  assert list(ids) == [TOK.bos_id] + list("héllo".encode())
  assert stub.Detokenize(pb.DetokenizeRequest(token_ids=ids[1:]), timeout=10).text == "héllo"
  # Tokenize accepts the chats Generate accepts, and refuses the same ones the same way.
  chat = pb.Messages(messages=[pb.ChatMessage(role="user", content="hi")])
  assert list(stub.Tokenize(pb.TokenizeRequest(messages=chat), timeout=10).token_ids)
  robot = pb.Messages(messages=[pb.ChatMessage(role="no role", content="hi")])
  with pytest.raises(grpc.RpcError) as e:
    stub.Tokenize(pb.TokenizeRequest(messages=robot), timeout=10)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "role" in e.value.details()
  with pytest.raises(grpc.RpcError) as e:
    stub.Detokenize(pb.DetokenizeRequest(token_ids=[VOCAB]), timeout=10)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  info = stub.ServerInfo(pb.ServerInfoRequest(), timeout=10)
  assert info.model == "tiny" and info.max_context == 128 and info.vocab_size == VOCAB
  assert info.mode == "single" and info.kv_pages == 64 and info.max_queue == 256
  assert {c.name for c in info.slo_classes} >= {"interactive", "server", "long"}
  # --dtype left at auto: this machine's choice, and why (launch.defaults)
  want = defaults.choose_dtype(jax.default_backend(), cpuinfo.flags())
  assert info.dtype == want.value and info.defaults.startswith(f"dtype {want.value}: ")
  assert "max_slots" not in info.defaults and info.max_slots == 8  # given: not a default


def _bad_requests():
  ok = dict(text="hi", max_tokens=4)
  P = pb.GenerateRequest
  return [
      (P(max_tokens=4), "prompt"),
      (P(token_ids=pb.TokenIds(ids=list(range(1, 129))), max_tokens=1), "prompt"),
      (P(token_ids=pb.TokenIds(ids=[1] * 100), max_tokens=100), "max_tokens"),
      (P(text="hi", max_tokens=0), "max_tokens"),
      (P(text="hi", max_tokens=-1), "max_tokens"),
      (P(text="hi", max_tokens=2**31 - 1), "max_tokens"),
      (P(sampling=pb.Sampling(temperature=float("nan")), **ok), "temperature"),
      (P(sampling=pb.Sampling(temperature=float("inf")), **ok), "temperature"),
      (P(sampling=pb.Sampling(temperature=-1), **ok), "temperature"),
      (P(sampling=pb.Sampling(top_p=0), **ok), "top_p"),
      (P(sampling=pb.Sampling(top_p=1.01), **ok), "top_p"),
      (P(sampling=pb.Sampling(top_k=-1), **ok), "top_k"),
      (P(sampling=pb.Sampling(top_k=VOCAB + 1), **ok), "top_k"),
      (P(text="", max_tokens=4), "text"),
      (P(token_ids=pb.TokenIds(ids=[]), max_tokens=4), "token_ids"),
      (P(token_ids=pb.TokenIds(ids=[-1]), max_tokens=4), "token_ids"),
      (P(token_ids=pb.TokenIds(ids=[VOCAB]), max_tokens=4), "token_ids"),
      (P(stop=[""], **ok), "stop"),
      (P(stop=["a"] * 17, **ok), "stop"),
      (P(stop=["a" * 300], **ok), "stop"),
      (P(n=-1, **ok), "n"),
      (P(n=9, **ok), "n"),
      (P(slo_class="gold", **ok), "slo_class"),
      (P(logprobs=50, **ok), "logprobs"),
      (P(sampling=pb.Sampling(presence_penalty=2.5), **ok), "presence_penalty"),
      (P(sampling=pb.Sampling(frequency_penalty=float("nan")), **ok), "frequency_penalty"),
      (P(sampling=pb.Sampling(repetition_penalty=0), **ok), "repetition_penalty"),
      (P(sampling=pb.Sampling(logit_bias={VOCAB: 1.0}), **ok), "logit_bias"),
      (P(sampling=pb.Sampling(logit_bias={5: -101.0}), **ok), "logit_bias"),
      (P(messages=pb.Messages(messages=[pb.ChatMessage(role="no role", content="hi")]),
         max_tokens=4), "messages"),
      (P(messages=pb.Messages(messages=[]), max_tokens=4), "messages"),
  ]


def test_every_bad_input_is_invalid_argument_naming_the_field(server, stub):
  for req, field in _bad_requests():
    with pytest.raises(grpc.RpcError) as e:
      _run(stub, req, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e.value.details())
    assert e.value.details().startswith(field), (field, e.value.details())
  # Invalid UTF-8 in a string field: protobuf refuses it; the answer still names the field.
  raw = pb.GenerateRequest(text="abcd", max_tokens=4).SerializeToString().replace(b"abcd",
                                                                                   b"ab\xff\xfe")
  for field, data in (("text", raw), ("stop", pb.GenerateRequest(
      text="a", stop=["zz"]).SerializeToString().replace(b"zz", b"\xc3\x28"))):
    with server.channel() as ch:
      call = ch.unary_stream("/phaseserve.v1.Generation/Generate",
                             request_serializer=lambda b: b)
      with pytest.raises(grpc.RpcError) as e:
        list(call(data, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == f"{field}: invalid UTF-8", e.value.details()
  with pytest.raises(grpc.RpcError) as e:  # over --max_message_bytes
    _run(stub, pb.GenerateRequest(text="x" * 70000, max_tokens=4), timeout=10)
  assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
  server.wait_idle()


def test_predicted_slo_miss_is_rejected_at_once(stub):
  """While the server is busy (a generation running: its steps keep the estimate fresh) a
  request whose class it would miss is refused at once. (An idle server with a stale estimate
  admits it: tests/serving/test_in_service.py.)"""
  busy = stub.Generate(pb.GenerateRequest(text="busy", max_tokens=120, ignore_eos=True),
                       timeout=120)
  next(busy)
  t0 = time.monotonic()
  with pytest.raises(grpc.RpcError) as e:
    _run(stub, pb.GenerateRequest(text="hi", max_tokens=4, slo_class="impossible"))
  busy.cancel()
  assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
  assert "predicted TTFT" in e.value.details() and time.monotonic() - t0 < 5
  ids, _, _ = _run(stub, pb.GenerateRequest(text="hi", max_tokens=4, slo_class="interactive"))
  assert len(ids[0]) >= 1


def test_cancel_100_streams_mid_decode_frees_everything(server, stub):
  before = server.metrics()
  calls = [stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[i % 200 + 1, 2, 3]),
                                            max_tokens=120, ignore_eos=True), timeout=120)
           for i in range(100)]
  for c in calls[:10]:  # decoding has begun
    next(c)
  for c in calls:
    c.cancel()
  for c in calls:
    with pytest.raises(grpc.RpcError) as e:
      list(c)
    assert e.value.code() == grpc.StatusCode.CANCELLED
  m = server.wait_idle()  # running sequences, KV pages and live streams all back to 0
  ended = {k: v - before.get(k, 0) for k, v in m.items()
           if k.startswith("phaseserve_requests_total") and v != before.get(k, 0)}
  by_status = lambda st: sum(v for k, v in ended.items() if f'status="{st}"' in k)
  # A few may finish before their cancel reaches the loop (status ok, or cancelled with the
  # finish reason "length" when the last id was already planned); a call cancelled before the
  # server dispatched it never reaches the service at all.
  assert by_status("cancelled") + by_status("ok") <= 100 and by_status("cancelled") >= 50, {
      k: v for k, v in ended.items() if k.startswith("phaseserve_requests_total")}


def test_deadline_drops_the_work(server, stub):
  with pytest.raises(grpc.RpcError) as e:  # slow:0.01: 120 steps of >= 10 ms, deadline 0.2 s
    _run(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), max_tokens=120,
                                  ignore_eos=True, client_request_id="fault:slow:0.01"),
         timeout=0.2)
  assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
  m = server.wait_idle()
  assert sum(v for k, v in m.items() if 'status="deadline_exceeded"' in k) == 1


def test_injected_engine_fault_fails_its_step_then_serving_goes_on(server, stub):
  with pytest.raises(grpc.RpcError) as e:
    _run(stub, pb.GenerateRequest(text="boom", max_tokens=8, client_request_id="fault:raise"))
  assert e.value.code() == grpc.StatusCode.INTERNAL and "injected fault" in e.value.details()
  ids, _, _ = _run(stub, pb.GenerateRequest(text="Hello", max_tokens=12, ignore_eos=True))
  assert ids[0] == _greedy_reference([TOK.bos_id] + TOK.encode("Hello"), 12)
  assert server.health("phaseserve.v1.Generation") == health_pb2.HealthCheckResponse.SERVING
  assert server.metrics()["phaseserve_engine_faults"] >= 1


def test_a_client_that_stops_reading_is_cancelled(server):
  """A tiny receive window (no BDP growth): the server's sends block, unread outputs age, and
  after --stream_stall_s the request is cancelled and its pages freed, while the client still
  holds the call open."""
  with server.channel(**{"grpc.http2.lookahead_bytes": 1024, "grpc.http2.bdp_probe": 0}) as ch:
    s = pb_grpc.GenerationStub(ch)
    call = s.Generate(pb.GenerateRequest(  # slow:0.03: every step of it sleeps (3.6 s in all)
        token_ids=pb.TokenIds(ids=[1, 2]), max_tokens=120, ignore_eos=True, logprobs=8,
        client_request_id="fault:slow:0.03"), timeout=60)
    first = next(call)  # then stop reading
    assert first.token_ids
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
      m = server.metrics()
      key = ('phaseserve_requests_total{finish_reason="cancelled",slo_class="best_effort",'
             'status="slow_consumer"}')
      if m.get(key, 0) >= 1:
        break
      time.sleep(0.2)
    else:
      raise AssertionError("the slow consumer was never cancelled")
    call.cancel()
  server.wait_idle()


JETSTREAM_CLIENT = textwrap.dedent("""
    # Drives the server the way JetStream's benchmarks/benchmark_serving.py does, with stubs
    # generated from JetStream's published proto: a new channel per request, token_content
    # only, metadata.start_time set, samples[0].token_ids read from every message.
    import json, sys, time
    import grpc
    import jetstream_pb2 as js, jetstream_pb2_grpc as js_grpc
    target = sys.argv[1]
    out = {}
    def decode(req):
      with grpc.insecure_channel(target) as ch:
        return list(js_grpc.OrchestratorStub(ch).Decode(req, timeout=60))
    def tokens(resps):
      return [t for r in resps for t in r.stream_content.samples[0].token_ids]
    out["bench"] = [tokens(decode(js.DecodeRequest(
        token_content=js.DecodeRequest.TokenContent(token_ids=[72, 105 + i]), max_tokens=6,
        metadata=js.DecodeRequest.Metadata(start_time=time.perf_counter())))) for i in range(4)]
    text = decode(js.DecodeRequest(text_content=js.DecodeRequest.TextContent(text="Hello"),
                                   max_tokens=6))
    out["text"] = ["".join(r.stream_content.samples[0].text for r in text), tokens(text)]
    out["kinds"] = sorted({r.WhichOneof("content") for r in text})
    out["has_bos"] = tokens(decode(js.DecodeRequest(
        token_content=js.DecodeRequest.TokenContent(token_ids=[256, 72, 105]), max_tokens=6,
        has_bos=True)))
    two = decode(js.DecodeRequest(token_content=js.DecodeRequest.TokenContent(token_ids=[5, 6]),
                                  max_tokens=4, num_samples=2))
    out["samples"] = sorted({len(r.stream_content.samples) for r in two})
    errors = {}
    for name, req in (
        ("lora", js.DecodeRequest(text_content=js.DecodeRequest.TextContent(text="a"),
                                  max_tokens=4, lora_adapter_id="my-adapter")),
        ("long", js.DecodeRequest(token_content=js.DecodeRequest.TokenContent(
            token_ids=[1] * 300), max_tokens=4)),
        ("zero", js.DecodeRequest(text_content=js.DecodeRequest.TextContent(text="a")))):
      try:
        decode(req)
        errors[name] = "OK"
      except grpc.RpcError as e:
        errors[name] = [e.code().name, e.details()]
    out["errors"] = errors
    with grpc.insecure_channel(target) as ch:
      out["live"] = js_grpc.OrchestratorStub(ch).HealthCheck(js.HealthCheckRequest(),
                                                             timeout=10).is_live
    print(json.dumps(out))
    """)


def test_jetstream_clients_work_unchanged(server, stub, tmp_path):
  stubs = tmp_path / "stubs"
  stubs.mkdir()
  subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{REPO}/tests/data/jetstream",
                  f"--python_out={stubs}", f"--grpc_python_out={stubs}", "jetstream.proto"],
                 check=True)
  (stubs / "client.py").write_text(JETSTREAM_CLIENT)
  r = subprocess.run([sys.executable, "client.py", server.target], cwd=stubs,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout)
  bos = TOK.bos_id
  for i, got in enumerate(out["bench"]):  # has_bos unset: a BOS is prepended, as JetStream does
    want, _, _ = _run(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[bos, 72, 105 + i]),
                                               max_tokens=6))
    assert got == want[0]
  want, text, _ = _run(stub, pb.GenerateRequest(text="Hello", max_tokens=6))
  assert out["text"] == [text[0], want[0]] and out["kinds"] == ["stream_content"]
  assert out["has_bos"] == _run(stub, pb.GenerateRequest(
      token_ids=pb.TokenIds(ids=[bos, 72, 105]), max_tokens=6))[0][0]
  assert out["samples"] == [2]
  assert out["errors"]["lora"][0] == "NOT_FOUND" and "my-adapter" in out["errors"]["lora"][1]
  assert out["errors"]["long"][0] == "INVALID_ARGUMENT"  # never truncated
  assert out["errors"]["zero"][0] == "INVALID_ARGUMENT" and "max_tokens" in out["errors"]["zero"][1]
  assert out["live"] is True


def test_load_200_streams_with_cancels_and_bad_requests(server, stub):
  rng = random.Random(0)
  prompts = [[TOK.bos_id] + list(f"prompt {k}".encode()) for k in range(5)]
  alone = {k: _run(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), max_tokens=10,
                                            ignore_eos=True))[0][0]
           for k, p in enumerate(prompts)}
  kinds = [rng.choice(["good"] * 6 + ["cancel"] * 2 + ["bad"] * 2) for _ in range(200)]

  def one(i: int):
    kind = kinds[i]
    k = i % len(prompts)
    if kind == "bad":
      req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[k]), max_tokens=10,
                               sampling=pb.Sampling(top_p=0.0 if i % 2 else 2.0))
      try:
        _run(stub, req)
      except grpc.RpcError as e:
        return kind, e.code()
      return kind, "no error"
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[k]), max_tokens=10,
                             ignore_eos=True)
    call = stub.Generate(req, timeout=120)
    if kind == "cancel":
      threading.Timer(rng.random() * 0.05, call.cancel).start()
    ids = []
    try:
      for r in call:
        ids.extend(r.token_ids)
    except grpc.RpcError as e:
      return kind, e.code()
    return kind, ids == alone[k]

  t0 = time.monotonic()
  with cf.ThreadPoolExecutor(200) as pool:
    results = list(pool.map(one, range(200)))
  assert time.monotonic() - t0 < 120
  for kind, res in results:
    if kind == "good":
      assert res is True, res
    elif kind == "bad":
      assert res == grpc.StatusCode.INVALID_ARGUMENT
    else:  # cancelled in flight, or finished first (then with the right tokens)
      assert res in (grpc.StatusCode.CANCELLED, True), res
  server.wait_idle()
