"""serving.api.http_api without a server: request parsing into GenerateArgs (forms, defaults, field
names, no-op defaults of unimplemented fields), the status mapping, and response shaping."""

from __future__ import annotations

import pytest

from models.text.tokenizer import ByteTokenizer
from serving.api import http_api
from serving.api.stream import ServiceError, Status, Stream
from serving.api.http_api import ApiError, parse_chat, parse_completion
from serving.request import RequestOutput, TokenLogprobs, Usage
from serving.stop import FinishReason

M = "m"


def test_prompt_forms_and_defaults():
  p = parse_completion({"model": M, "prompt": "hi"}, M)
  (a,) = p.prompts
  assert a.text == "hi" and a.token_ids is None and a.add_bos
  assert (a.max_tokens, a.temperature, a.top_p, a.top_k, a.seed, a.n, a.logprobs) == (None,) * 7
  assert (a.priority, a.slo_class, a.session_id, list(a.stop)) == (0, None, "", [])
  assert not p.stream and not p.include_usage and p.top_logprobs is None and p.n == 1
  assert parse_completion({"model": M, "prompt": [1, 2]}, M).prompts[0].token_ids == [1, 2]
  batch = parse_completion({"model": M, "prompt": [[1], [2, 3]], "n": 2}, M)
  assert [x.token_ids for x in batch.prompts] == [[1], [2, 3]] and batch.n == 2
  texts = parse_completion({"model": M, "prompt": ["a", "b"], "add_special_tokens": False}, M)
  assert [x.text for x in texts.prompts] == ["a", "b"] and not texts.prompts[0].add_bos
  # null is absent; top_k -1 is off (0); a single stop string is a list of one.
  a = parse_completion({"model": M, "prompt": "x", "temperature": None, "top_k": -1,
                        "stop": "\n", "logprobs": 0}, M).prompts[0]
  assert a.temperature is None and a.top_k == 0 and list(a.stop) == ["\n"]
  assert a.logprobs == 1  # logprobs 0: the chosen token's logprob, no alternatives


def test_chat_fields_and_names():
  p = parse_chat({"model": M, "messages": [
      {"role": "developer", "content": "s"},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
      "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 0, "stream": True,
      "stream_options": {"include_usage": True}}, M)
  (a,) = p.prompts
  assert list(a.messages) == [("system", "s"), ("user", "ab")] and a.max_tokens == 7
  assert p.field_names["max_tokens"] == "max_completion_tokens"
  assert p.field_names["logprobs"] == "top_logprobs" and p.field_names["prompt"] == "messages"
  assert p.top_logprobs == 0 and a.logprobs == 1 and p.stream and p.include_usage
  p = parse_chat({"model": M, "messages": [{"role": "user", "content": "x"}],
                  "max_tokens": 3}, M)
  assert p.prompts[0].max_tokens == 3 and p.field_names["max_tokens"] == "max_tokens"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x"}, "model"),
    ({"model": M}, "prompt"),
    ({"model": M, "prompt": {"a": 1}}, "prompt"),
    ({"model": M, "prompt": "x", "repetition_penalty": "high"}, "repetition_penalty"),
    ({"model": M, "prompt": "x", "suffix": "end"}, "suffix"),
    ({"model": M, "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": M, "prompt": "x", "stream": True, "stream_options": {"x": 1}},
     "stream_options.x"),
    ({"model": M, "prompt": "x", "user": "u" * 257}, "user"),
    ({"model": M, "prompt": "x", "stop_token_ids": [1.5]}, "stop_token_ids"),
])
def test_bad_bodies_name_the_field(body, param):
  with pytest.raises(ApiError) as e:
    parse_completion(body, M)
  assert e.value.status == 400 and e.value.param == param
  assert e.value.message.startswith(param) and e.value.body()["error"]["param"] == param


def test_noop_defaults_are_accepted_and_anything_else_refused():
  ok = {"model": M, "prompt": "x", "frequency_penalty": 0.0, "presence_penalty": 0,
        "logit_bias": {}, "echo": False, "best_of": 1, "min_p": 0, "service_tier": "auto",
        "response_format": None}
  parse_completion(ok, M)
  for field, value in (("echo", 0), ("best_of", 2), ("min_p", 0.1)):
    with pytest.raises(ApiError) as e:
      parse_completion(dict(ok, **{field: value}), M)
    assert e.value.param == field and "not implemented" in e.value.message


def test_penalties_and_logit_bias_reach_the_args_of_both_endpoints():
  pen = {"presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
         "logit_bias": {"5": 100, "17": -2.5}}
  chat = parse_chat({"model": M, "messages": [{"role": "user", "content": "hi"}], **pen}, M)
  for args in (parse_completion({"model": M, "prompt": "x", **pen}, M).prompts[0],
               chat.prompts[0]):
    assert (args.presence_penalty, args.frequency_penalty, args.repetition_penalty) == \
        (1.5, -0.5, 1.2)
    assert args.logit_bias == {5: 100, 17: -2.5}
  for field, value, needle in (("frequency_penalty", True, "must be a number"),
                               ("presence_penalty", "1", "must be a number"),
                               ("logit_bias", [1], "must be an object"),
                               ("logit_bias", {"a": 1}, "keys must be token ids"),
                               ("logit_bias", {" 5": 1}, "keys must be token ids"),
                               ("logit_bias", {"5": 1, "05": 2}, "given twice"),
                               ("logit_bias", {"5": "1"}, "must be a number")):
    with pytest.raises(ApiError) as e:
      parse_completion({"model": M, "prompt": "x", field: value}, M)
    assert e.value.status == 400 and e.value.param == field and needle in e.value.message
  with pytest.raises(ApiError) as e:
    parse_chat({"model": M, "messages": [], "tools": [{"type": "function"}]}, M)
  assert e.value.param == "tools"
  with pytest.raises(ApiError) as e:
    parse_chat({"model": "other", "messages": []}, M)
  assert e.value.status == 404 and e.value.code == "model_not_found"


def test_status_mapping():
  want = {Status.INVALID_ARGUMENT: 400, Status.REJECTED: 429, Status.UNAVAILABLE: 503,
          Status.ERROR: 500, Status.SLOW_CONSUMER: 408, Status.DEADLINE_EXCEEDED: 504,
          Status.CANCELLED: 499}
  assert {s: http_api.STATUS[s][0] for s in Status if s is not Status.OK} == want
  e = http_api.api_error(ServiceError(Status.INVALID_ARGUMENT, "top_p: must be in (0, 1]"))
  assert (e.status, e.param, e.type) == (400, "top_p", "invalid_request_error")
  e = http_api.api_error(ServiceError(Status.INVALID_ARGUMENT, "the prompt: x"))
  assert e.param is None
  for reason, after in (("quota", "60"), ("queue_full", "1"), ("slo", "1")):
    e = http_api.api_error(ServiceError(Status.REJECTED, "no", reason))
    assert e.status == 429 and e.headers == {"Retry-After": after} and e.code == reason
  e = http_api.api_error(ServiceError(Status.UNAVAILABLE, "the server is shutting down"))
  assert e.status == 503 and e.headers["Retry-After"] == "5"


class _FakeStream:
  usage = Stream.usage

  def __init__(self, prompt, completion, cached):
    self.validated = type("V", (), {"prompt_ids": tuple(prompt)})()
    self.completion = completion
    self.finals = [RequestOutput("r", finish_reason=FinishReason.LENGTH,
                                 usage=Usage(len(prompt), 2, cached))] + [None] * (
                                     len(completion) - 1)


def test_response_shapes():
  tok = ByteTokenizer()
  p = parse_chat({"model": M, "messages": [{"role": "user", "content": "x"}], "n": 2,
                  "logprobs": True, "top_logprobs": 1, "stream": True,
                  "stream_options": {"include_usage": True}}, M)
  r = http_api.Response(p, M, "req-1", tok)
  assert r.id == "chatcmpl-req-1"
  out = RequestOutput("r", (104,), "h", logprobs=(TokenLogprobs(104, -0.5, ((104, -0.5),
                                                                             (105, -1.0))),))
  c = r.chunk(1, out)
  assert c["object"] == "chat.completion.chunk" and c["usage"] is None
  (choice,) = c["choices"]
  assert choice["index"] == 1 and choice["delta"] == {"content": "h"}
  assert choice["logprobs"]["content"] == [{"token": "h", "logprob": -0.5, "bytes": [104],
                                            "top_logprobs": [{"token": "h", "logprob": -0.5,
                                                              "bytes": [104]}]}]
  # A token that is part of a character: its own bytes, not U+FFFD's (EF BF BD).
  part = RequestOutput("r", (0xE2,), "", logprobs=(TokenLogprobs(0xE2, -0.1, ((0xE2, -0.1),)),))
  entry = r.chunk(0, part)["choices"][0]["logprobs"]["content"][0]
  assert entry["bytes"] == [0xE2] and entry["top_logprobs"][0]["bytes"] == [0xE2]
  assert r.chunk(0, RequestOutput("r")) is None  # nothing to say
  end = r.chunk(0, RequestOutput("r", finish_reason=FinishReason.STOP))
  assert end["choices"][0]["finish_reason"] == "stop" and end["choices"][0]["delta"] == {}
  assert r.role_chunk(0)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
  streams = [_FakeStream([1, 2, 3], [2, 4], 0), _FakeStream([5] * 20, [1, 0], 16)]
  assert r.usage_chunk(streams)["usage"] == {
      "prompt_tokens": 23, "completion_tokens": 7, "total_tokens": 30,
      "prompt_tokens_details": {"cached_tokens": 16}}
  comp = http_api.Response(parse_completion({"model": M, "prompt": "ab", "logprobs": 1}, M),
                           M, "req-2", tok)
  comp.add(0, RequestOutput("r", (104, 105), "hi", logprobs=(
      TokenLogprobs(104, -0.1, ((104, -0.1),)), TokenLogprobs(105, -0.2, ((105, -0.2),)))))
  comp.add(0, RequestOutput("r", (33,), "!", FinishReason.LENGTH,
                            logprobs=(TokenLogprobs(33, -0.3, ((33, -0.3),)),)))
  body = comp.body(streams[:1])
  (choice,) = body["choices"]
  assert body["id"] == "cmpl-req-2" and body["object"] == "text_completion"
  assert choice["text"] == "hi!" and choice["finish_reason"] == "length"
  assert choice["logprobs"] == {"tokens": ["h", "i", "!"], "token_logprobs": [-0.1, -0.2, -0.3],
                                "top_logprobs": [{"h": -0.1}, {"i": -0.2}, {"!": -0.3}],
                                "text_offset": [0, 1, 2]}
  assert [http_api.FINISH[f] for f in FinishReason] == ["stop", "length", "cancelled",
                                                        "rejected", "error"]


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "ab\xff"}', "prompt"),
    (b'{"prompt": "\\ud800x"}', "prompt"),  # an escaped lone surrogate is not text either
    (b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', "messages[0].content"),
    (b'{"stop": ["ok", "\xfe"]}', "stop[1]"),
    (b'{"a\xff": 1}', None),
    (b'{', None),
    (b'{"prompt": "a", "metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),  # too deep
])
def test_invalid_utf8_and_json_are_400_naming_the_field(raw, param):
  with pytest.raises(ApiError) as e:
    http_api.decode_body(raw)
  assert e.value.status == 400 and e.value.param == param
  assert e.value.message == (f"{param}: invalid UTF-8" if param else e.value.message)
  assert http_api.decode_body('{"prompt": "hé"}'.encode()) == {"prompt": "hé"}
