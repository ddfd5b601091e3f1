"""A closed program set: after readiness no request variant makes the server load another XLA
program, and its memory mappings and RSS stay put.

One ``launch.server`` (tiny model, HTTP beside gRPC, attention sinks on, prefix cache on by
default) is warmed up; then every variant a client can send goes through it: completions and
chat, streaming or not, ``n`` = 3 sampled, logprobs (completions 0 and 5, chat top 3), stop
strings, top-k / top-p, penalties and logit bias, a prompt several chunks long, a prefix-cache
hit, attention sinks with a window that wraps, the phaseserve gRPC API and JetStream's. ``phaseserve_programs_after_ready``
must stay 0. Before the sampling and logprobs switches became run-time conds, the first sampled
or logprobs request compiled new variants of the prefill and decode programs.
"""

from __future__ import annotations

import http.client
import json

import pytest

from serving.api.proto.jetstream import jetstream_pb2 as js
from serving.api.proto.jetstream import jetstream_pb2_grpc as js_grpc
from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
from serving.api.proto.phaseserve.v1 import generation_pb2_grpc as pb_grpc
from tests.grpc_harness import TINY, ServerProc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  s = ServerProc.start(tmp_path_factory.mktemp("programs"), *TINY, "--http_port", "0",
                       "--attention_sinks", "--early_reject=false")
  try:
    yield s
  finally:
    s.stop()


def _post(server, path: str, body: dict) -> tuple[int, bytes]:
  conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
  try:
    conn.request("POST", path, body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, r.read()
  finally:
    conn.close()


def _status_kb(pid: int, field: str) -> int:
  for line in open(f"/proc/{pid}/status"):
    if line.startswith(field + ":"):
      return int(line.split()[1])
  raise KeyError(field)


def _maps(pid: int) -> int:
  return sum(1 for _ in open(f"/proc/{pid}/maps", "rb"))


LONG = "The two phases of inference differ: prefill is compute-bound, decode is memory-bound." 
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]


def _variants() -> list[tuple[str, dict]]:
  c, ch = "/v1/completions", "/v1/chat/completions"
  base = {"model": "tiny", "max_tokens": 6}
  out = [(c, {**base, "prompt": "Hello"}),
         (c, {**base, "prompt": "Hello", "stream": True}),
         (c, {**base, "prompt": "Hello", "n": 3, "temperature": 1.0, "seed": 42}),
         (c, {**base, "prompt": "Hello", "n": 3, "temperature": 1.0, "seed": 42, "logprobs": 0,
              "stream": True}),
         (c, {**base, "prompt": "Hello", "logprobs": 5}),
         (c, {**base, "prompt": "Hello", "temperature": 0.8, "top_k": 20, "top_p": 0.9,
              "seed": 1}),
         (c, {**base, "prompt": "Hello", "temperature": 0.7, "top_p": 0.5, "seed": 2}),
         (c, {**base, "prompt": "Hello", "temperature": 1.0, "top_k": 200, "seed": 3}),
         (c, {**base, "prompt": "Hello", "stop": ["e", "zz"], "ignore_eos": True}),
         (c, {**base, "prompt": LONG, "max_tokens": 4}),
         (c, {**base, "prompt": LONG, "max_tokens": 4}),  # the same prefix: a cache hit
         (c, {**base, "prompt": "Hi", "max_tokens": 150, "ignore_eos": True,
              "attention_sinks": {"window": 32}}),
         (c, {**base, "prompt": "Hi", "max_tokens": 40, "ignore_eos": True, "stream": True,
              "temperature": 1.0, "seed": 5, "logprobs": 2, "attention_sinks": {"window": 20}}),
         (ch, {**base, "messages": CHAT}),
         (ch, {**base, "messages": CHAT, "stream": True, "logprobs": True, "top_logprobs": 3}),
         (ch, {**base, "messages": CHAT, "n": 2, "temperature": 0.9, "seed": 7}),
         # Penalties and logit bias: a run-time switch in the sampling programs, state per slot.
         (c, {**base, "prompt": "Hello", "presence_penalty": 1.0, "frequency_penalty": 0.5,
              "repetition_penalty": 1.3, "logit_bias": {"65": 5}}),
         (c, {**base, "prompt": LONG, "max_tokens": 4, "frequency_penalty": 1.0}),  # cached
         (c, {**base, "prompt": "Hi", "max_tokens": 40, "ignore_eos": True,
              "repetition_penalty": 1.2, "attention_sinks": {"window": 20}}),
         (ch, {**base, "messages": CHAT, "temperature": 0.9, "seed": 8, "top_k": 20,
               "logit_bias": {"66": -100}, "presence_penalty": -0.5}),
         # Structured outputs: host masks into the same sampling programs; min_p.
         (c, {**base, "prompt": "Hi", "guided_regex": "[a-c]{3,9}", "temperature": 1.0}),
         (ch, {**base, "messages": CHAT, "max_tokens": 24, "min_p": 0.1, "temperature": 1.0,
               "response_format": {"type": "json_object"}, "stream": True}),
         (c, {**base, "prompt": LONG, "max_tokens": 4, "guided_choice": ["yes", "no"]})]
  # Several at once: batches mixing greedy, sampled and logprobs rows, every row count.
  return out


def test_no_program_after_readiness_whatever_the_request(server):
  pid = server.proc.pid
  before = server.metrics()
  assert before["phaseserve_programs_loaded"] > 0
  assert before["phaseserve_programs_after_ready"] == 0
  maps0, rss0 = _maps(pid), _status_kb(pid, "VmRSS")
  for path, body in _variants():  # one at a time
    status, raw = _post(server, path, body)
    assert status == 200, (body, raw[:300])
  import concurrent.futures
  with concurrent.futures.ThreadPoolExecutor(8) as pool:  # and mixed in one batch
    for status, raw in pool.map(lambda pb_: _post(server, *pb_), _variants() * 2):
      assert status == 200, raw[:300]
  with server.channel() as ch:
    finals = list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
        text="grpc", max_tokens=5, sampling=pb.Sampling(temperature=1.0, seed=9), logprobs=3,
        n=2), timeout=120))
    assert finals and finals[-1].HasField("final")
    outs = list(js_grpc.OrchestratorStub(ch).Decode(js.DecodeRequest(
        text_content=js.DecodeRequest.TextContent(text="jetstream"), max_tokens=5),
        timeout=120))
    assert outs
  server.wait_idle()
  after = server.metrics()
  assert after["phaseserve_programs_after_ready"] == 0, server.log()
  assert after["phaseserve_programs_loaded"] == before["phaseserve_programs_loaded"]
  # Serving allocates buffers, threads and sockets, not code: a few dozen mappings (one program
  # costs hundreds) and a bounded RSS growth.
  grew = _maps(pid) - maps0
  assert grew < 100, grew
  assert _status_kb(pid, "VmRSS") - rss0 < 300_000  # KiB
