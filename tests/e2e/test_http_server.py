"""The OpenAI HTTP API of launch.server as a real process on 127.0.0.1, one server for the module
(gRPC and HTTP on the same engine): the official openai client streams a completion and a chat
whose greedy text equals the gRPC service's; the model is the tiny preset saved as a checkpoint
with a byte-level Hugging Face tokenizer whose tokenizer_config.json chat template is rendered
exactly as transformers renders it (the Python 3.11 reference env); every bad input's status and
OpenAI error; 401 / 404 / 413 / 429 / 500 / 503; a client that disconnects mid-stream frees its
sequence (read from /metrics); SIGTERM drains HTTP and gRPC streams (the last test)."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import grpc
import openai
import pytest

from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
from serving.api.proto.phaseserve.v1 import generation_pb2_grpc as pb_grpc
from tests import refenv
from tests.e2e import http_harness as harness
from tests.grpc_harness import ServerProc

pytestmark = pytest.mark.timeout(240)

MODEL, KEY = harness.MODEL, harness.KEY
LIMITED = "sk-limited"
VOCAB, TEMPLATE = harness.VOCAB, harness.TEMPLATE
_request, _sse, _is_error = harness.request, harness.sse, harness.is_error


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("model") / "ckpt"
  harness.write_model(d)
  return d


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
  tmp = tmp_path_factory.mktemp("http")
  (tmp / "keys.json").write_text(json.dumps({
      KEY: {"name": "test"}, LIMITED: {"name": "limited", "requests_per_min": 1}}))
  s = ServerProc.start(
      tmp, "--model", str(model_dir), "--max_context", "128", "--max_slots", "8", "--kv_pages",
      "64", "--page_size", "16", "--max_chunk", "32", "--max_prefill_chunks", "2",
      "--http_port", "0", "--api_keys", str(tmp / "keys.json"), "--fault_injection",
      "--max_message_bytes", "65536", "--grace_s", "2",
      "--slo_classes", "interactive:0.45:0.04,server:2:0.2,long:6:0.175,impossible:1e-9:10",
      "--slo_scale", "1000", "--usage_log", str(tmp / "usage.jsonl"), wait_ready=False)
  try:
    s.loading = _while_loading(s)
    s.usage_path = tmp / "usage.jsonl"
    yield s
  finally:
    assert s.stop() in (0,), s.log()


def _while_loading(s: ServerProc, timeout: float = 200.0) -> list[tuple[int, dict, dict]]:
  """Completions sent before readiness: (status, headers, body) of each, until /ready is 200."""
  seen = []
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if s.proc.poll() is not None:
      raise RuntimeError(f"server exited: {s.log()}")
    if _request(s, "GET", "/ready")[0] == 200:
      return seen
    if len(seen) < 3:
      seen.append(_request(s, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}))
    time.sleep(0.2)
  raise TimeoutError(f"never ready: {s.log()}")


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=KEY,
                       max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def stub(server):
  with server.channel() as ch:
    yield pb_grpc.GenerationStub(ch)


def _grpc(stub, req: pb.GenerateRequest) -> tuple[str, list[int], pb.Final]:
  text, ids, final = "", [], None
  for r in stub.Generate(req, timeout=60, metadata=[("authorization", f"Bearer {KEY}")]):
    text += r.text
    ids.extend(r.token_ids)
    if r.HasField("final"):
      final = r.final
  return text, ids, final




def test_loading_is_503_then_ready(server):
  assert server.loading, "the HTTP port was never seen before readiness"
  for status, headers, body in server.loading:
    assert status == 503 and _is_error(body, "service_unavailable"), (status, body)
    assert "loading" in body["error"]["message"] and headers.get("Retry-After") == "5"
  assert _request(server, "GET", "/ready", key=None)[:3:2] == (200, {"status": "serving"})
  assert _request(server, "GET", "/health", key=None)[:3:2] == (200, {"status": "serving"})


def test_openai_client_streams_a_completion_equal_to_grpc(client, stub):
  chunks = list(client.completions.create(
      model=MODEL, prompt="Hello", max_tokens=12, temperature=0, stream=True,
      stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
  text = "".join(c.choices[0].text for c in chunks if c.choices)
  finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
  assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
  usage = chunks[-1].usage
  assert chunks[-1].choices == [] and usage.prompt_tokens == 5 and usage.completion_tokens == 12
  assert usage.total_tokens == 17 and usage.prompt_tokens_details.cached_tokens == 0
  want, ids, final = _grpc(stub, pb.GenerateRequest(text="Hello", max_tokens=12,
                                                    ignore_eos=True))
  assert len(ids) == 12 and final.usage.prompt_tokens == 5
  assert text == want and len(chunks) > 2  # streamed in pieces, not one body
  plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
  assert plain.choices[0].text == want and plain.choices[0].finish_reason == "length"
  assert plain.id.startswith("cmpl-") and plain.object == "text_completion"
  assert plain.model == MODEL and plain.usage.completion_tokens == 12
  # The prompt is now in the prefix cache (5 tokens: no whole page of 16): nothing cached yet.
  assert plain.usage.prompt_tokens_details.cached_tokens == 0


def test_openai_client_streams_a_chat_equal_to_grpc(client, stub):
  messages = [{"role": "user", "content": "What is a KV cache?"}]
  chunks = list(client.chat.completions.create(
      model=MODEL, messages=messages, max_completion_tokens=10, stream=True, temperature=0,
      extra_body={"ignore_eos": True}))
  assert chunks[0].choices[0].delta.role == "assistant"
  text = "".join(c.choices[0].delta.content or "" for c in chunks)
  assert chunks[-1].choices[0].finish_reason == "length"
  want, ids, final = _grpc(stub, pb.GenerateRequest(
      messages=pb.Messages(messages=[pb.ChatMessage(role="user", content=messages[0]["content"])]),
      max_tokens=10, ignore_eos=True))
  assert len(ids) == 10 and text == want
  plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                         temperature=0, extra_body={"ignore_eos": True})
  assert plain.choices[0].message.content == want and plain.choices[0].message.role == "assistant"
  assert plain.usage.prompt_tokens == final.usage.prompt_tokens
  # The same rendered prompt again: its whole pages of 16 come from the prefix cache.
  p = final.usage.prompt_tokens
  assert p >= 33 and plain.usage.prompt_tokens_details.cached_tokens == (p - 1) // 16 * 16


CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Why?  \n"}],
    [{"role": "user", "content": "héllo — ünïcode ✓"}, {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "again"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    [{"role": "tool", "content": "42"}],  # the template raises
]


def test_chat_template_is_applied_exactly_as_transformers(server, model_dir, client, stub,
                                                          tmp_path):
  chats_json = json.dumps(CHATS)
  (tmp_path / "chats.json").write_text(chats_json)
  script = refenv.REPO / "tests" / "reference" / "chat_template_ref.py"
  key = refenv.script_key(script, TEMPLATE, chats_json, (model_dir / "tokenizer.json").read_text())
  ref = refenv.read_json(refenv.cached_artifacts(
      "http_chat_template", script, [str(model_dir), str(tmp_path / "chats.json")],
      lambda d: (d / "chats.json").is_file(), key=key, timeout_s=180) / "chats.json")["chats"]
  meta = [("authorization", f"Bearer {KEY}")]
  for chat, want in zip(CHATS[:-1], ref[:-1]):
    assert want["error"] is None, want
    ids = stub.Tokenize(pb.TokenizeRequest(messages=pb.Messages(messages=[
        pb.ChatMessage(**m) for m in chat])), timeout=10, metadata=meta).token_ids
    assert list(ids) == want["ids"], (chat, want["text"])
    # Over HTTP: the chat's prompt is transformers' ids, and its greedy answer is that of a
    # completion on those very ids.
    got = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=6,
                                         temperature=0, extra_body={"ignore_eos": True})
    same = client.completions.create(model=MODEL, prompt=want["ids"], max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert got.usage.prompt_tokens == len(want["ids"]) == same.usage.prompt_tokens
    assert got.choices[0].message.content == same.choices[0].text
  assert "unknown role tool" in ref[-1]["error"]
  status, _, body = _request(server, "POST", "/v1/chat/completions",
                             {"model": MODEL, "messages": CHATS[-1]})
  assert status == 400 and _is_error(body, "invalid_request_error")
  assert body["error"]["message"] == ("messages: the chat template failed: chat template raised "
                                      "an exception: unknown role tool")
  assert body["error"]["param"] == "messages"


def test_n_samples_batch_prompts_and_logprobs(server, client):
  r = client.completions.create(model=MODEL, prompt=["Hello", "World!"], n=2, max_tokens=6,
                                temperature=1.0, seed=5, extra_body={"ignore_eos": True})
  assert [c.index for c in r.choices] == [0, 1, 2, 3]
  assert r.usage.prompt_tokens == 5 + 6 and r.usage.completion_tokens == 24
  for p, prompt in enumerate(["Hello", "World!"]):
    for i in range(2):
      alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                        temperature=1.0, seed=5 + i,
                                        extra_body={"ignore_eos": True})
      assert r.choices[2 * p + i].text == alone.choices[0].text
  lp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, logprobs=3,
                                 temperature=0, extra_body={"ignore_eos": True}
                                 ).choices[0].logprobs
  assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
  for tok, p, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
    # (greedy: the chosen id is the best; two ids may decode to one string, so <=, not ==)
    assert 1 <= len(top) <= 3 and p <= 0 and max(top.values()) <= p + 1e-6
  assert lp.text_offset[0] == 0
  status, events, done = _sse(server, "/v1/completions", {  # the same, streamed
      "model": MODEL, "prompt": "Hello", "max_tokens": 5, "logprobs": 3, "ignore_eos": True,
      "temperature": 0})
  assert status == 200 and done and events[-1]["choices"][0]["finish_reason"] == "length"
  assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
  assert [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]] == lp.tokens
  assert [p for e in events for p in e["choices"][0]["logprobs"]["token_logprobs"]] == \
      lp.token_logprobs
  chat = client.chat.completions.create(
      model=MODEL, messages=CHATS[0], max_tokens=4, logprobs=True, top_logprobs=2,
      temperature=0, extra_body={"ignore_eos": True}).choices[0].logprobs.content
  assert len(chat) == 4
  for e in chat:
    assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
    assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
  # A stop string ends the text before it, finish_reason "stop".
  full = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text
  needle = full[3:5]
  if needle.isprintable() and "\ufffd" not in needle and full.index(needle) == 3:
    cut = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, stop=[needle],
                                    temperature=0, extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == full[:3] and cut.finish_reason == "stop"
    assert cut.model_extra["stop_reason"] == needle
    kept = client.completions.create(  # vLLM's include_stop_str_in_output
        model=MODEL, prompt="Hello", max_tokens=12, stop=[needle], temperature=0,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert kept.text == full[:5] and kept.finish_reason == "stop"
  # priority, slo_class, session_id and user are accepted; user lands in the usage record.
  r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, user="alice-7",
                                extra_body={"priority": 1, "slo_class": "interactive",
                                            "session_id": "s-1", "top_k": -1})
  assert r.choices[0].finish_reason in ("stop", "length")
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline:
    records = [json.loads(l) for l in server.usage_path.read_text().splitlines()]
    if any(rec.get("user") == "alice-7" and rec["api"] == "openai" for rec in records):
      break
    time.sleep(0.1)
  else:
    raise AssertionError("no usage record with the user")


def test_penalties_and_logit_bias_are_honoured_like_grpc(server, client, stub):
  """The four fields on both endpoints: the same greedy text as the gRPC service given the same
  values (logit_bias keys as strings); +100 on "A" makes every id "A"."""
  pen = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.5)
  ref, ids, _ = _grpc(stub, pb.GenerateRequest(
      token_ids=pb.TokenIds(ids=[104, 105]), max_tokens=8, ignore_eos=True,
      sampling=pb.Sampling(logit_bias={66: 3.0}, **pen)))
  plain, plain_ids, _ = _grpc(stub, pb.GenerateRequest(
      token_ids=pb.TokenIds(ids=[104, 105]), max_tokens=8, ignore_eos=True))
  assert len(ids) == 8 and ids != plain_ids
  got = client.completions.create(  # repetition_penalty: vLLM's, not in the openai client
      model=MODEL, prompt=[104, 105], max_tokens=8, temperature=0, logit_bias={"66": 3.0},
      presence_penalty=0.5, frequency_penalty=1.0,
      extra_body=dict(ignore_eos=True, repetition_penalty=1.5))
  assert got.choices[0].text == ref
  chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                        max_tokens=6, logit_bias={"65": 100},
                                        extra_body=dict(ignore_eos=True))
  assert chat.choices[0].message.content == "A" * 6


def _bad_inputs():
  ok = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
  C, T = "/v1/completions", "/v1/chat/completions"
  chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
  return [  # (path, body, HTTP status, field that the message starts with)
      # The gRPC service's list (tests/e2e/test_grpc_server.py), with HTTP's field names.
      (C, {"model": MODEL, "max_tokens": 4}, 400, "prompt"),
      (C, dict(ok, prompt=list(range(1, 129)), max_tokens=1), 400, "prompt"),
      (C, dict(ok, prompt=[1] * 100, max_tokens=100), 400, "max_tokens"),
      (C, dict(ok, max_tokens=0), 400, "max_tokens"),
      (C, dict(ok, max_tokens=-1), 400, "max_tokens"),
      (C, dict(ok, max_tokens=2**31 - 1), 400, "max_tokens"),
      (C, dict(ok, temperature=-1), 400, "temperature"),
      (C, dict(ok, top_p=0), 400, "top_p"),
      (C, dict(ok, top_p=1.01), 400, "top_p"),
      (C, dict(ok, top_k=-2), 400, "top_k"),
      (C, dict(ok, top_k=VOCAB + 1), 400, "top_k"),
      (C, dict(ok, prompt=""), 400, "prompt"),
      (C, dict(ok, prompt=[]), 400, "prompt"),
      (C, dict(ok, prompt=[-1]), 400, "prompt"),
      (C, dict(ok, prompt=[VOCAB]), 400, "prompt"),
      (C, dict(ok, stop=[""]), 400, "stop"),
      (C, dict(ok, stop=["a"] * 17), 400, "stop"),
      (C, dict(ok, stop=["a" * 300]), 400, "stop"),
      (C, dict(ok, n=-1), 400, "n"),
      (C, dict(ok, n=9), 400, "n"),
      (C, dict(ok, slo_class="gold"), 400, "slo_class"),
      (C, dict(ok, logprobs=50), 400, "logprobs"),
      (C, dict(ok, seed=2**64), 400, "seed"),
      (C, dict(ok, session_id="s" * 129), 400, "session_id"),
      (C, dict(ok, min_tokens=5), 400, "min_tokens"),
      (C, dict(ok, stop_token_ids=[VOCAB]), 400, "stop_token_ids"),
      (T, dict(chat, messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
      (T, dict(chat, messages=[]), 400, "messages"),
      (T, dict(chat, max_completion_tokens=200), 400, "max_completion_tokens"),
      (T, dict(chat, top_logprobs=2, logprobs=True, n=1, max_tokens=0), 400, "max_tokens"),
      (T, dict(chat, logprobs=True, top_logprobs=21), 400, "top_logprobs"),
      # HTTP's own: JSON types, fields phaseserve does not implement, unknown fields.
      (C, dict(ok, temperature="hot"), 400, "temperature"),
      (C, dict(ok, max_tokens=4.5), 400, "max_tokens"),
      (C, dict(ok, n=True), 400, "n"),
      (C, dict(ok, stop=[1]), 400, "stop"),
      (C, dict(ok, prompt=[["a"]]), 400, "prompt"),
      (C, dict(ok, prompt=["a"] * 33), 400, "prompt"),
      (C, dict(ok, frequency_penalty=2.5), 400, "frequency_penalty"),
      (C, dict(ok, presence_penalty=-3), 400, "presence_penalty"),
      (T, dict(chat, repetition_penalty=0), 400, "repetition_penalty"),
      (C, dict(ok, logit_bias={"5": 101}), 400, "logit_bias"),
      (T, dict(chat, logit_bias={str(VOCAB): 1}), 400, "logit_bias"),
      (C, dict(ok, logit_bias={"x": 1}), 400, "logit_bias"),
      (C, dict(ok, echo=True, logprobs=1), 400, "echo"),
      (C, dict(ok, best_of=3), 400, "best_of"),
      (C, dict(ok, stream_options={"include_usage": True}), 400, "stream_options"),
      (C, dict(ok, user=7), 400, "user"),
      (T, dict(chat, response_format={"type": "xml"}), 400, "response_format.type"),
      (T, dict(chat, tools=[{"type": "function", "function": {"name": "f g"}}]), 400,
       "tools[0].function.name"),
      (T, dict(chat, top_logprobs=2), 400, "top_logprobs"),
      (T, dict(chat, max_tokens=4, max_completion_tokens=5), 400, "max_completion_tokens"),
      (T, dict(chat, messages=[{"role": "user", "content": "hi", "name": "a b"}]), 400,
       "messages[0].name"),
      (T, dict(chat, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
       "messages[0].content[0]"),
      (T, dict(chat, messages="hi"), 400, "messages"),
      (C, dict(ok, model=3), 400, "model"),
      (C, dict(ok, model="gpt-4"), 404, "The model 'gpt-4' does not exist"),
      (T, dict(chat, model="gpt-4"), 404, "The model 'gpt-4' does not exist"),
  ]


def test_every_bad_input_gets_its_status_and_an_openai_error(server, stub):
  before = server.metrics()
  validated = 0  # refused by the gRPC service's own checks (Frontend.generate)
  for path, body, status, field in _bad_inputs():
    got, _, out = _request(server, "POST", path, body)
    assert got == status and _is_error(out), (path, body, got, out)
    validated += out["error"]["code"] == "invalid_argument"
    assert out["error"]["message"].startswith(field), (field, out)
    if status == 400:
      assert out["error"]["type"] == "invalid_request_error"
      assert out["error"]["param"] == field, (field, out)
    else:
      assert out["error"]["code"] == "model_not_found" and out["error"]["param"] == "model"
  # Text content parts are joined; "developer" is the system role.
  got, _, out = _request(server, "POST", "/v1/chat/completions", {
      "model": MODEL, "max_tokens": 2, "messages": [
          {"role": "developer", "content": "x"},
          {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text",
                                                                        "text": "i"}]}]})
  assert got == 200 and out["choices"][0]["finish_reason"] in ("stop", "length"), out
  ids = stub.Tokenize(pb.TokenizeRequest(messages=pb.Messages(messages=[
      pb.ChatMessage(role="system", content="x"), pb.ChatMessage(role="user", content="hi")])),
      timeout=10, metadata=[("authorization", f"Bearer {KEY}")]).token_ids
  assert out["usage"]["prompt_tokens"] == len(ids)
  # No-op defaults of unimplemented fields are accepted.
  got, _, out = _request(server, "POST", "/v1/completions", {
      "model": MODEL, "prompt": "hi", "max_tokens": 2, "frequency_penalty": 0,
      "presence_penalty": 0.0, "logit_bias": {}, "echo": False, "best_of": 1, "top_k": 0})
  assert got == 200, out
  # Not JSON, invalid UTF-8, not an object, wrong method, unknown path.
  for raw, needle in ((b"{", "not valid JSON"), (b'{"prompt": "\xff"}', "prompt: invalid UTF-8"),
                      (b'{"model": "tiny-chat", "prompt": "\\udc80"}', "prompt: invalid UTF-8"),
                      (b'{"model": "tiny-chat", "prompt": "hi", "temperature": NaN}',
                       "temperature: must be finite"),
                      (b'{"model": "tiny-chat", "prompt": "hi", "temperature": Infinity}',
                       "temperature: must be finite"),
                      (b"[1, 2]", "must be a JSON object")):
    got, _, out = _request(server, "POST", "/v1/completions", raw=raw)
    assert got == 400 and _is_error(out) and needle in out["error"]["message"], out
    validated += out["error"]["code"] == "invalid_argument"
  got, _, out = _request(server, "GET", "/v1/completions")
  assert got == 405 and _is_error(out)
  got, _, out = _request(server, "GET", "/v1/nothing")
  assert got == 404 and _is_error(out)
  # Keys: none, unknown (401); a body over --max_message_bytes (413).
  for key in (None, "sk-wrong"):
    got, _, out = _request(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "a"},
                           key=key)
    assert got == 401 and _is_error(out, "authentication_error"), out
  got, _, out = _request(server, "GET", "/v1/models", key="sk-wrong")
  assert got == 401 and _is_error(out, "authentication_error")
  got, _, out = _request(server, "POST", "/v1/completions",
                         {"model": MODEL, "prompt": "x" * 70000})
  assert got == 413 and _is_error(out) and "65536" in out["error"]["message"], out
  conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
  try:  # chunked, no Content-Length: aiohttp's own limit, still a 413 in OpenAI's shape
    conn.request("POST", "/v1/completions", body=iter([b'{"prompt": "', b"x" * 70000, b'"}']),
                 headers={"Authorization": f"Bearer {KEY}"}, encode_chunked=True)
    r = conn.getresponse()
    assert r.status == 413 and _is_error(json.loads(r.read()))
  finally:
    conn.close()
  m = server.wait_idle(port=server.http_port)
  assert m['phaseserve_rejections_total{reason="unauthenticated"}'] - before.get(
      'phaseserve_rejections_total{reason="unauthenticated"}', 0) == 3
  assert validated >= 25 and m['phaseserve_rejections_total{reason="invalid_argument"}'] - \
      before.get('phaseserve_rejections_total{reason="invalid_argument"}', 0) == validated


def _busy(server) -> threading.Thread:
  """A generation running in the background (its steps keep the early-rejection estimate fresh:
  an idle server with a stale estimate admits even an impossible class)."""
  t = threading.Thread(target=_request, args=(server, "POST", "/v1/completions", {
      "model": MODEL, "prompt": "busy", "max_tokens": 120, "ignore_eos": True}))
  t.start()
  deadline = time.monotonic() + 30
  while server.metrics().get("phaseserve_running_sequences", 0) < 1:
    assert time.monotonic() < deadline
    time.sleep(0.01)
  return t


def test_429_over_quota_or_predicted_slo_miss_with_retry_after(server):
  busy = _busy(server)
  got, headers, out = _request(server, "POST", "/v1/completions",
                               {"model": MODEL, "prompt": "hi", "slo_class": "impossible"})
  assert got == 429 and _is_error(out, "rate_limit_error") and out["error"]["code"] == "slo"
  assert "predicted TTFT" in out["error"]["message"] and headers["Retry-After"] == "1"
  body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
  assert _request(server, "POST", "/v1/completions", body, key=LIMITED)[0] == 200
  got, headers, out = _request(server, "POST", "/v1/completions", body, key=LIMITED)
  assert got == 429 and out["error"]["code"] == "quota" and headers["Retry-After"] == "60"
  assert "1 requests/min" in out["error"]["message"]
  busy.join(60)
  busy = _busy(server)
  status, events, _ = _sse(server, "/v1/completions", dict(body, slo_class="impossible"))
  busy.join(60)
  assert status == 429 and _is_error(events[0])  # refused before any event: a plain 429


def test_an_engine_fault_is_500_and_serving_goes_on(server, client):
  body = {"model": MODEL, "prompt": "boom", "max_tokens": 8}
  got, _, out = _request(server, "POST", "/v1/completions", body,
                         headers={"X-Request-Id": "fault:raise"})
  assert got == 500 and _is_error(out, "server_error") and "injected fault" in out["error"][
      "message"], out
  status, events, _ = _sse(server, "/v1/chat/completions",
                           {"model": MODEL, "messages": CHATS[0], "max_tokens": 8},
                           headers={"X-Request-Id": "fault:raise"})
  assert status == 500 and _is_error(events[0], "server_error")
  r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
  assert r.choices[0].finish_reason in ("stop", "length")
  assert _request(server, "GET", "/ready", key=None)[0] == 200


def test_models_health_ready_metrics(server):
  got, _, out = _request(server, "GET", "/v1/models")
  assert got == 200 and out["object"] == "list" and [m["id"] for m in out["data"]] == [MODEL]
  assert out["data"][0]["max_model_len"] == 128
  assert _request(server, "GET", f"/v1/models/{MODEL}")[2]["id"] == MODEL
  assert _request(server, "GET", "/v1/models/gpt-4")[0] == 404
  http_metrics = server.metrics(server.http_port)  # the same registry as --metrics_port
  startup = "phaseserve_startup_seconds"
  assert http_metrics[startup] == server.metrics()[startup] > 0
  assert any(k.startswith("phaseserve_requests_total") for k in http_metrics)


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(server):
  before = server.metrics(server.http_port)
  conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
  conn.request("POST", "/v1/completions", body=json.dumps({  # >= 120 steps of >= 30 ms
      "model": MODEL, "prompt": "tell me", "max_tokens": 120, "stream": True,
      "ignore_eos": True}).encode(), headers={"Authorization": f"Bearer {KEY}",
                                              "X-Request-Id": "fault:slow:0.03"})
  r = conn.getresponse()
  assert r.status == 200
  first = r.readline()
  assert first.startswith(b"data: {")
  assert server.metrics(server.http_port)["phaseserve_running_sequences"] == 1
  t0 = time.monotonic()
  conn.sock.close()  # the client goes away mid-stream
  conn.close()
  m = server.wait_idle(timeout=10, port=server.http_port)
  assert time.monotonic() - t0 < 3.0  # long before the 120 steps (>= 3.6 s) would have ended
  key = 'phaseserve_requests_total{finish_reason="cancelled",slo_class="best_effort",status="cancelled"}'
  assert m.get(key, 0) - before.get(key, 0) == 1, {k: v for k, v in m.items() if "requests" in k}
  assert m["phaseserve_kv_pages_used"] == 0 and m["phaseserve_live_streams"] == 0
  assert "Error handling request" not in server.log()  # a normal event, not an error traceback
  # Non-streaming too: the client gives up while its answer is being generated.
  conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
  conn.request("POST", "/v1/completions", body=json.dumps({
      "model": MODEL, "prompt": "tell me", "max_tokens": 120, "ignore_eos": True}).encode(),
      headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "fault:slow:0.03"})
  deadline = time.monotonic() + 10
  while server.metrics(server.http_port)["phaseserve_running_sequences"] != 1:
    assert time.monotonic() < deadline
    time.sleep(0.02)
  t0 = time.monotonic()
  conn.sock.close()
  conn.close()
  m2 = server.wait_idle(timeout=10, port=server.http_port)
  assert time.monotonic() - t0 < 3.0 and m2.get(key, 0) - m.get(key, 0) == 1


def test_load_96_requests_with_disconnects_and_bad_ones(server):
  """Concurrent streams, bodies, clients that go away and bad requests on the one event loop:
  the good answers equal the same request alone, then nothing is left running."""
  rng = random.Random(0)
  prompts = [f"prompt {k}" for k in range(4)]
  body = lambda k: {"model": MODEL, "prompt": prompts[k], "max_tokens": 10, "ignore_eos": True,
                    "temperature": 0}
  alone = {k: _request(server, "POST", "/v1/completions", body(k))[2]["choices"][0]["text"]
           for k in range(len(prompts))}
  kinds = [rng.choice(["stream"] * 3 + ["plain"] * 3 + ["gone"] * 2 + ["bad"] * 2)
           for _ in range(96)]

  def one(i: int):
    kind, k = kinds[i], i % len(prompts)
    if kind == "bad":
      return kind, _request(server, "POST", "/v1/completions", dict(body(k), top_p=2.0))[0]
    if kind == "plain":
      out = _request(server, "POST", "/v1/completions", body(k))[2]
      return kind, out["choices"][0]["text"] == alone[k]
    if kind == "stream":
      status, events, done = _sse(server, "/v1/completions", body(k))
      text = "".join(e["choices"][0]["text"] for e in events)
      return kind, status == 200 and done and text == alone[k]
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(dict(body(k), stream=True)).encode(),
                 headers={"Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    first = r.readline()
    conn.sock.close()
    conn.close()
    return kind, r.status == 200 and first.startswith(b"data: ")

  t0 = time.monotonic()
  with cf.ThreadPoolExecutor(96) as pool:
    results = list(pool.map(one, range(96)))
  assert time.monotonic() - t0 < 90
  for kind, res in results:
    assert res == (400 if kind == "bad" else True), (kind, res)
  assert {k for k, _ in results} == {"stream", "plain", "gone", "bad"}
  server.wait_idle(timeout=20, port=server.http_port)


def test_loadgen_drives_this_server_over_the_openai_api(server, tmp_path):
  """launch.lab.loadgen --api openai against phaseserve's own HTTP front end (its tests use a fake
  server): every request of a short open-loop run streams tokens and is counted ok."""
  out = tmp_path / "lg"
  r = subprocess.run(
      [sys.executable, "-m", "launch.lab.loadgen", "--target", f"http://127.0.0.1:{server.http_port}",
       "--api", "openai", "--model", MODEL, "--api_key", KEY, "--num_requests", "4", "--rate",
       "4", "--length_scale", "0.05", "--vocab_size", "200", "--max_context", "64",
       "--warmup_requests", "0", "--progress=false", "--out", str(out)],
      cwd=refenv.REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=180)
  assert r.returncode == 0, r.stderr[-2000:]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["sent"] == 4 and summary["ok"] == 4, summary


def test_sigterm_drains_http_streams_like_grpc_ones(server, stub):
  """Last: it stops the module's server. --grace_s 2: a short stream finishes, a long one is
  cancelled at the end of the grace (an error event, then [DONE]), as its gRPC twin is."""
  slow = {"X-Request-Id": "fault:slow:0.05"}  # every step of it sleeps: 100 ids >= 5 s
  long_body = {"model": MODEL, "prompt": "long", "max_tokens": 100, "stream": True,
               "ignore_eos": True}
  conns = []
  for body, headers in ((long_body, slow), (dict(long_body, prompt="short", max_tokens=8), {})):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Authorization": f"Bearer {KEY}", **headers})
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: {")
    conns.append((conn, r))
  grpc_call = stub.Generate(pb.GenerateRequest(text="grpc", max_tokens=100, ignore_eos=True),
                            timeout=60, metadata=[("authorization", f"Bearer {KEY}")])
  next(grpc_call)
  server.signal(signal.SIGTERM)
  deadline = time.monotonic() + 10
  while _request(server, "GET", "/ready", key=None)[0] != 503:
    assert time.monotonic() < deadline
    time.sleep(0.05)
  got, headers, out = _request(server, "POST", "/v1/completions",
                               {"model": MODEL, "prompt": "late"})
  assert got == 503 and "shutting down" in out["error"]["message"] and "Retry-After" in headers
  tails = []
  for conn, r in conns:
    lines = [l.decode().strip() for l in r if l.strip()]
    conn.close()
    assert lines[-1] == "data: [DONE]", lines[-3:]
    tails.append(json.loads(lines[-2][6:]))
  long_tail, short_tail = tails
  assert _is_error(long_tail, "service_unavailable"), long_tail
  assert "shutting down" in long_tail["error"]["message"]
  assert short_tail["choices"][0]["finish_reason"] == "length"
  with pytest.raises(grpc.RpcError) as e:
    list(grpc_call)
  assert e.value.code() == grpc.StatusCode.UNAVAILABLE
  server.proc.wait(30)
  assert server.proc.returncode == 0, server.log()

