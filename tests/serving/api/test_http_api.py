"""serving.api.http_api, http_errors and http_response without a server: request parsing into
GenerateArgs (forms, defaults, field names, no-op defaults of unimplemented fields, ignored
fields, seeds, roles), the status mapping, body decoding and response shaping."""

from __future__ import annotations

import pytest

from models.text.tokenizer import ByteTokenizer
from serving.api import http_api, http_errors, http_response
from serving.api.stream import ServiceError, Status, Stream
from serving.api.http_api import Served, parse_chat as _chat, parse_completion as _completion
from serving.api.http_errors import ApiError
from serving.request import RequestOutput, TokenLogprobs, Usage
from serving.stop import FinishReason

M = "m"
SERVED = Served(M)


def parse_completion(body, served=SERVED):
  return _completion(body, served)


def parse_chat(body, served=SERVED):
  return _chat(body, served)


def test_prompt_forms_and_defaults():
  p = parse_completion({"model": M, "prompt": "hi"})
  (a,) = p.prompts
  assert a.text == "hi" and a.token_ids is None and a.add_bos
  assert (a.max_tokens, a.seed, a.n, a.logprobs) == (None,) * 4
  assert (a.temperature, a.top_p, a.top_k) == (1.0, 1.0, 0)  # OpenAI's defaults
  assert (a.priority, a.slo_class, a.session_id, list(a.stop)) == (0, None, "", [])
  assert not p.stream and not p.include_usage and p.top_logprobs is None and p.n == 1
  assert parse_completion({"model": M, "prompt": [1, 2]}).prompts[0].token_ids == [1, 2]
  batch = parse_completion({"model": M, "prompt": [[1], [2, 3]], "n": 2})
  assert [x.token_ids for x in batch.prompts] == [[1], [2, 3]] and batch.n == 2
  texts = parse_completion({"model": M, "prompt": ["a", "b"], "add_special_tokens": False})
  assert [x.text for x in texts.prompts] == ["a", "b"] and not texts.prompts[0].add_bos
  # null is absent; top_k -1 is off (0); a single stop string is a list of one.
  a = parse_completion({"model": M, "prompt": "x", "temperature": None, "top_k": -1,
                        "stop": "\n", "logprobs": 0}).prompts[0]
  assert a.temperature == 1.0 and a.top_k == 0 and list(a.stop) == ["\n"]
  assert a.logprobs == 1  # logprobs 0: the chosen token's logprob, no alternatives


def test_chat_fields_and_names():
  p = parse_chat({"model": M, "messages": [
      {"role": "developer", "content": "s"},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
      "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 0, "stream": True,
      "stream_options": {"include_usage": True}})
  (a,) = p.prompts
  assert list(a.messages) == [("system", "s"), ("user", "ab")] and a.max_tokens == 7
  assert p.field_names["max_tokens"] == "max_completion_tokens"
  assert p.field_names["logprobs"] == "top_logprobs" and p.field_names["prompt"] == "messages"
  assert p.top_logprobs == 0 and a.logprobs == 1 and p.stream and p.include_usage
  p = parse_chat({"model": M, "messages": [{"role": "user", "content": "x"}],
                  "max_tokens": 3})
  assert p.prompts[0].max_tokens == 3 and p.field_names["max_tokens"] == "max_tokens"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "model": 3}, "model"),
    ({"model": M, "prompt": "x", "seed": 2**64}, "seed"),
    ({"model": M, "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": M, "prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"model": M, "prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
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
    parse_completion(body)
  assert e.value.status == 400 and e.value.param == param
  assert e.value.message.startswith(param) and e.value.body()["error"]["param"] == param


def test_noop_defaults_are_accepted_and_anything_else_refused():
  ok = {"model": M, "prompt": "x", "frequency_penalty": 0.0, "presence_penalty": 0,
        "logit_bias": {}, "echo": False, "best_of": 1, "min_p": 0, "service_tier": "auto",
        "response_format": None}
  assert parse_completion(ok).ignored == ("service_tier",)
  for field, value in (("suffix", "x"), ("use_beam_search", True)):
    with pytest.raises(ApiError) as e:
      parse_completion(dict(ok, **{field: value}))
    assert e.value.param == field and "not implemented" in e.value.message


def test_penalties_and_logit_bias_reach_the_args_of_both_endpoints():
  pen = {"presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
         "logit_bias": {"5": 100, "17": -2.5}}
  chat = parse_chat({"model": M, "messages": [{"role": "user", "content": "hi"}], **pen})
  for args in (parse_completion({"model": M, "prompt": "x", **pen}).prompts[0],
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
      parse_completion({"model": M, "prompt": "x", field: value})
    assert e.value.status == 400 and e.value.param == field and needle in e.value.message
  with pytest.raises(ApiError) as e:
    parse_chat({"model": M, "messages": [], "tools": [{"type": "function"}]})
  assert e.value.param == "tools[0].function"
  with pytest.raises(ApiError) as e:
    parse_chat({"model": "other", "messages": []})
  assert e.value.status == 404 and e.value.code == "model_not_found"


def test_unknown_fields_are_ignored_and_named():
  p = parse_chat({"messages": [{"role": "user", "content": "x", "id_slot": 1}], "model": "",
                  "cache_prompt": True, "store": True, "metadata": {"a": "b"}})
  assert set(p.ignored) == {"messages[0].id_slot", "cache_prompt", "store", "metadata"}
  assert parse_completion({"prompt": "x"}).ignored == ()  # model may be left out


def test_seeds_take_any_64_bit_integer():
  seed = lambda v: parse_completion({"prompt": "x", "seed": v}).prompts[0].seed
  assert seed(7) == 7 and seed(2**32 - 1) == 2**32 - 1
  mixed = [seed(v) for v in (-1, -2, 2**32, 2**63, 2**64 - 3, -2**63 + 1)]  # distinct bits
  assert all(0 <= s < 2**32 for s in mixed) and len(set(mixed)) == len(mixed)
  assert seed(-1) == seed(-1)  # deterministic


def test_generation_config_defaults():
  d = http_api.defaults_from_generation_config({"temperature": 0.6, "top_p": 0.9,
                                                "top_k": 50}, "gc.json")
  a = parse_completion({"prompt": "x"}, Served(M, d)).prompts[0]
  assert (a.temperature, a.top_p, a.top_k) == (0.6, 0.9, 50)
  a = parse_completion({"prompt": "x", "temperature": 0, "top_k": -1}, Served(M, d)).prompts[0]
  assert (a.temperature, a.top_k) == (0, 0)
  assert http_api.defaults_from_generation_config({"bos_token_id": 1}, "g") == \
      http_api.SamplingDefaults()


def test_chat_messages_roles_names_and_options():
  p = parse_chat({"messages": [
      {"role": "ipython", "content": None}, {"role": "user", "content": "a", "name": "bob"},
      {"role": "assistant", "content": [{"type": "text", "text": "b"}]}],
      "continue_final_message": True, "add_generation_prompt": False,
      "chat_template_kwargs": {"enable_thinking": False}})
  (a,) = p.prompts
  assert list(a.messages) == [("ipython", ""), ("user", "a", "bob"), ("assistant", "b")]
  assert a.chat_options.continue_final and not a.chat_options.add_generation_prompt
  assert a.chat_options.template_vars == {"enable_thinking": False}
  for body, param in (
      ({"messages": [{"role": "a b", "content": "x"}]}, "messages[0].role"),
      ({"messages": [{"role": "user", "content": "x", "name": "a b"}]}, "messages[0].name"),
      ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
       "messages[0].content[0]"),
      ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]},
       "messages[0].tool_calls[0]"),
      ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
        "add_generation_prompt": True}, "continue_final_message")):
    with pytest.raises(ApiError) as e:
      parse_chat(body)
    assert e.value.param == param, e.value.message


def test_huge_integers_are_a_400_naming_the_field():
  with pytest.raises(ApiError) as e:
    http_errors.decode_body(b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}")
  assert e.value.status == 400 and e.value.param == "max_tokens"
  assert "5000 digits" in e.value.message


def test_stream_options_continuous_usage():
  p = parse_completion({"prompt": "x", "stream": True, "stream_options": {
      "include_usage": True, "continuous_usage_stats": True}})
  assert p.include_usage and p.continuous_usage
  p = parse_completion({"prompt": "x", "stream": True, "stream_options": {
      "continuous_usage_stats": True}})
  assert not p.continuous_usage  # vLLM: only together with include_usage


def test_status_mapping():
  want = {Status.INVALID_ARGUMENT: 400, Status.REJECTED: 429, Status.UNAVAILABLE: 503,
          Status.ERROR: 500, Status.SLOW_CONSUMER: 408, Status.DEADLINE_EXCEEDED: 504,
          Status.CANCELLED: 499, Status.NOT_FOUND: 404}
  assert {s: http_errors.STATUS[s][0] for s in Status if s is not Status.OK} == want
  e = http_errors.api_error(ServiceError(Status.INVALID_ARGUMENT, "top_p: must be in (0, 1]"))
  assert (e.status, e.param, e.type) == (400, "top_p", "invalid_request_error")
  e = http_errors.api_error(ServiceError(Status.INVALID_ARGUMENT, "the prompt: x"))
  assert e.param is None
  for reason, after in (("quota", "60"), ("queue_full", "1"), ("slo", "1")):
    e = http_errors.api_error(ServiceError(Status.REJECTED, "no", reason))
    assert e.status == 429 and e.headers == {"Retry-After": after} and e.code == reason
  e = http_errors.api_error(ServiceError(Status.UNAVAILABLE, "the server is shutting down"))
  assert e.status == 503 and e.headers["Retry-After"] == "5"
  e = http_errors.api_error(ServiceError(Status.NOT_FOUND, "unknown adapter", "model_not_found"))
  assert (e.status, e.param, e.code) == (404, "model", "model_not_found")


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
                  "stream_options": {"include_usage": True}})
  r = http_response.Response(p, M, "req-1", tok, [http_response.PromptInfo(3)], "fp_x")
  assert r.id == "chatcmpl-req-1"
  out = RequestOutput("r", (104,), "h", logprobs=(TokenLogprobs(104, -0.5, ((104, -0.5),
                                                                             (105, -1.0))),))
  c = r.chunk(1, out)
  assert c["object"] == "chat.completion.chunk" and c["usage"] is None
  assert c["system_fingerprint"] == "fp_x"
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
  comp = http_response.Response(parse_completion({"model": M, "prompt": "ab", "logprobs": 1}),
                                M, "req-2", tok, [http_response.PromptInfo(2)])
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
  assert choice["stop_reason"] is None and choice["prompt_logprobs"] is None
  assert [http_response.FINISH[f] for f in FinishReason] == ["stop", "length", "cancelled",
                                                             "rejected", "error"]


def test_completion_extras_logprobs_0_echo_token_ids_and_running_usage():
  tok = ByteTokenizer()
  p = parse_completion({"prompt": "ab", "logprobs": 0, "echo": False, "stream": True,
                        "return_tokens_as_token_ids": True, "stream_options": {
                            "include_usage": True, "continuous_usage_stats": True}})
  r = http_response.Response(p, M, "q", tok, [http_response.PromptInfo(3)])
  c = r.chunk(0, RequestOutput("r", (104,), "h", logprobs=(
      TokenLogprobs(104, -0.5, ((105, -0.1),)),)))
  # logprobs 0: the sampled token alone (its alternatives are not asked for).
  assert c["choices"][0]["logprobs"]["top_logprobs"] == [{"token_id:104": -0.5}]
  assert c["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
  c = r.chunk(0, RequestOutput("r", (33, 34), "!\"", FinishReason.STOP, stop_reason="\""))
  assert c["usage"]["completion_tokens"] == 3 and c["choices"][0]["stop_reason"] == "\""
  echo = parse_completion({"prompt": "ab", "echo": True, "n": 2})
  r = http_response.Response(echo, M, "q", tok, [http_response.PromptInfo(3, "ab")])
  for i in range(2):
    r.add(i, RequestOutput("r", (99,), "c"))
    r.add(i, RequestOutput("r", (100,), "d", FinishReason.LENGTH))
  assert [c["text"] for c in r.body([_FakeStream([1, 2, 3], [2, 2], 0)])["choices"]] == \
      ["abcd", "abcd"]


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
    http_errors.decode_body(raw)
  assert e.value.status == 400 and e.value.param == param
  assert e.value.message == (f"{param}: invalid UTF-8" if param else e.value.message)
  assert http_errors.decode_body('{"prompt": "hé"}'.encode()) == {"prompt": "hé"}


def test_speculative_opt_out_reaches_the_request():
  from serving.api.validation import Limits, validate
  assert parse_completion({"model": M, "prompt": "x"}).prompts[0].speculative is True
  off = parse_chat({"model": M, "messages": [{"role": "user", "content": "x"}],
                    "speculative": False}).prompts[0]
  assert off.speculative is False
  with pytest.raises(ApiError) as e:
    parse_completion({"model": M, "prompt": "x", "speculative": "no"})
  assert e.value.status == 400 and e.value.param == "speculative"
  v = validate(parse_completion({"model": M, "prompt": [1, 2], "speculative": False,
                                 "max_tokens": 2}).prompts[0], ByteTokenizer(),
               Limits(max_context=64))
  assert v.speculative is False
