"""OpenAI's HTTP API as protocol logic: JSON bodies in, JSON bodies out; no I/O, no aiohttp.

Contract (``serving.api.http_server`` is the wiring; every guarantee lives in ``serving.api.frontend``):
  * ``decode_body(bytes)``: the JSON body (invalid JSON or UTF-8: a 400 naming the field).
  * ``parse_completion(body, model)`` / ``parse_chat(body, model) -> Parsed``: one
    ``serving.api.validation.GenerateArgs`` per prompt plus the field-name map, so every value
    check is the gRPC service's with messages naming the HTTP field. ``ApiError``: an unserved
    ``model`` is 404; an unimplemented field not at its no-op default (``NOOP_DEFAULTS``), an
    unknown field or a wrong JSON type is a 400 naming it. Nothing is silently ignored.
  * Defaults (docs/ lists them): greedy ``temperature`` 0, ``n`` 1, a fresh ``seed``, the
    server's ``--default_max_tokens`` and ``--default_slo_class``; a text prompt gets BOS.
    ``prompt``: string(s) or token ids (at most ``MAX_PROMPTS``); choice ``p * n + i``.
  * ``api_error(ServiceError) -> ApiError``: the HTTP status and OpenAI error (``STATUS``).
  * ``Response`` shapes chunks, the usage chunk and the non-streaming body; ``usage`` counts
    each prompt once and every sample's completion; ``finish_reason`` adds ``cancelled``,
    ``rejected``, ``error`` to OpenAI's set.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import Any, Mapping, Sequence

from models.text.tokenizer import Tokenizer
from serving.api.stream import ServiceError, Status, Stream
from serving.request import RequestOutput
from serving.stop import FinishReason
from serving.api.validation import GenerateArgs

MAX_PROMPTS = 32  # prompts of one /v1/completions request
MAX_USER_CHARS = 256

# Fields phaseserve does not implement: accepted only when they hold the no-op value.
NOOP_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "response_format": ({"type": "text"},), "tools": ([],),
    "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (), "echo": (False,), "suffix": ("",), "best_of": (1,),
    "min_p": (0,), "store": (False,), "metadata": ({},), "modalities": (["text"],),
    "audio": (), "prediction": (), "reasoning_effort": (), "web_search_options": (),
    "service_tier": ("auto", "default"), "logprobs_mode": (), "use_beam_search": (False,),
    "length_penalty": (1,), "prompt_logprobs": (), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (),
}

_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "user",
           "stream", "stream_options", "priority", "slo_class", "session_id", "min_tokens",
           "ignore_eos", "stop_token_ids", "attention_sinks", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "logit_bias")
_COMPLETION_FIELDS = frozenset(_COMMON + ("prompt", "logprobs", "add_special_tokens"))
_CHAT_FIELDS = frozenset(_COMMON + ("messages", "max_completion_tokens", "logprobs",
                                    "top_logprobs"))
_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
          FinishReason.CANCELLED: "cancelled", FinishReason.REJECTED: "rejected",
          FinishReason.ERROR: "error"}


class ApiError(Exception):
  """An answer in OpenAI's error shape: ``{"error": {message, type, param, code}}``."""

  def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
               param: str | None = None, code: str | None = None,
               headers: Mapping[str, str] | None = None):
    super().__init__(message)
    self.status = status
    self.message = message
    self.type = type_
    self.param = param
    self.code = code
    self.headers = dict(headers or {})

  def body(self) -> dict[str, Any]:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def bad(field: str, message: str) -> ApiError:
  return ApiError(400, f"{field}: {message}", param=field)


# (HTTP status, OpenAI error type) per Frontend status.
STATUS: dict[Status, tuple[int, str]] = {
    Status.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Status.REJECTED: (429, "rate_limit_error"),
    Status.SLOW_CONSUMER: (408, "timeout_error"),
    Status.CANCELLED: (499, "cancelled"),
    Status.DEADLINE_EXCEEDED: (504, "timeout_error"),
    Status.ERROR: (500, "server_error"),
    Status.UNAVAILABLE: (503, "service_unavailable"),
}
# Retry-After (seconds) of a 429 by refusal reason: a quota's window is 60 s, so the requests it
# holds now have all left it after 60 s; the queue and the SLO predictor change step by step.
RETRY_AFTER = {"quota": 60, "queue_full": 1, "slo": 1}
UNAVAILABLE_RETRY_AFTER = 5


def api_error(e: ServiceError) -> ApiError:
  status, type_ = STATUS[e.status]
  headers = {}
  if e.status is Status.REJECTED:
    headers["Retry-After"] = str(RETRY_AFTER.get(e.reason, 1))
  elif e.status is Status.UNAVAILABLE:
    headers["Retry-After"] = str(UNAVAILABLE_RETRY_AFTER)
  param = None
  if e.status is Status.INVALID_ARGUMENT:
    head = e.message.split(":", 1)[0]
    param = head if head and " " not in head else None
  return ApiError(status, e.message, type_, param, e.reason or e.status.value, headers)


# -- requests -----------------------------------------------------------------------------------


def _bad_text(v: Any, path: str) -> str | None:
  """The path of the first string under ``v`` that is not valid Unicode (a surrogate: invalid
  UTF-8 bytes decoded with surrogateescape, or a lone ``\\ud800`` escape), else None."""
  if isinstance(v, str):
    return path if any("\ud800" <= ch <= "\udfff" for ch in v) else None
  if isinstance(v, list):
    for i, x in enumerate(v):
      found = _bad_text(x, f"{path}[{i}]")
      if found:
        return found
  if isinstance(v, dict):
    for k, x in v.items():
      if _bad_text(k, "") is not None:
        return ""  # a field name
      found = _bad_text(x, f"{path}.{k}" if path else k)
      if found:
        return found
  return None


def decode_body(data: bytes) -> Any:
  """The JSON request body; a string that is not valid UTF-8 is a 400 naming its field, as the
  gRPC service names a proto field."""
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError:
    text = data.decode("utf-8", "surrogateescape")  # located below, by field
  try:
    body = json.loads(text)
    field = _bad_text(body, "")
  except json.JSONDecodeError as e:
    raise ApiError(400, f"the request body is not valid JSON: {e}") from None
  except RecursionError:
    raise ApiError(400, "the request body is nested too deeply") from None
  if field == "":
    raise ApiError(400, "the request body is not valid UTF-8 (in a field name)")
  if field is not None:
    raise bad(field, "invalid UTF-8")
  return body


@dataclasses.dataclass(frozen=True)
class Parsed:
  chat: bool
  prompts: tuple[GenerateArgs, ...]  # one per prompt (chat: exactly one)
  field_names: Mapping[str, str]
  n: int  # samples per prompt, as given (validation checks the range)
  stream: bool
  include_usage: bool
  top_logprobs: int | None  # None: no logprobs asked for; else top entries per token
  user: str


def _is_int(v: object) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get(body: Mapping[str, Any], name: str, check, what: str):
  v = body.get(name)
  if v is None:
    return None
  if not check(v):
    raise bad(name, f"must be {what}, got {type(v).__name__} {_short(v)}")
  return v


def _short(v: object) -> str:
  s = repr(v)
  return s if len(s) <= 40 else s[:37] + "..."


def _int_list(v: object) -> bool:
  return isinstance(v, list) and all(_is_int(t) for t in v)


def _check_fields(body: Mapping[str, Any], allowed: frozenset[str], model: str) -> None:
  for name, value in body.items():
    if name in allowed:
      continue
    if name in NOOP_DEFAULTS:
      if value is None or any(value == d and type(value) is type(d) or
                              (_is_num(value) and _is_num(d) and value == d)
                              for d in NOOP_DEFAULTS[name]):
        continue
      raise bad(name, "not implemented by phaseserve (only its no-op default is accepted)")
    raise bad(name, "unknown field")
  got = body.get("model")
  if not isinstance(got, str) or not got:
    raise bad("model", "required: the served model's id (GET /v1/models)")
  if got != model:
    raise ApiError(404, f"The model {got!r} does not exist; this server serves {model!r}",
                   param="model", code="model_not_found")


def _common(body: Mapping[str, Any]) -> dict[str, Any]:
  """The sampling, stop and extension fields both endpoints share, as GenerateArgs keywords."""
  top_k = _get(body, "top_k", _is_int, "an integer")
  stop = body.get("stop")
  if stop is None:
    stops: list[str] = []
  elif isinstance(stop, str):
    stops = [stop]
  elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
    stops = list(stop)
  else:
    raise bad("stop", f"must be a string or a list of strings, got {_short(stop)}")
  priority = _get(body, "priority", _is_int, "an integer")
  sinks = _get(body, "attention_sinks", lambda v: isinstance(v, dict), "an object")
  window = k = None
  if sinks is not None:
    extra = set(sinks) - {"window", "sinks"}
    if extra:
      raise bad("attention_sinks", f"unknown field {sorted(extra)[0]!r} (window, sinks)")
    window, k = sinks.get("window"), sinks.get("sinks")
    if not _is_int(window) or (k is not None and not _is_int(k)):
      raise bad("attention_sinks", "window (and sinks, if given) must be integers")
  return dict(
      sinks_window=window, sinks=k, logit_bias=_logit_bias(body),
      presence_penalty=_get(body, "presence_penalty", _is_num, "a number"),
      frequency_penalty=_get(body, "frequency_penalty", _is_num, "a number"),
      repetition_penalty=_get(body, "repetition_penalty", _is_num, "a number"),
      temperature=_get(body, "temperature", _is_num, "a number"),
      top_p=_get(body, "top_p", _is_num, "a number"),
      top_k=0 if top_k == -1 else top_k,  # vLLM: -1 (or 0) means no top-k filter
      seed=_get(body, "seed", _is_int, "an integer"), stop=stops,
      stop_token_ids=_get(body, "stop_token_ids", _int_list, "a list of token ids") or [],
      min_tokens=_get(body, "min_tokens", _is_int, "an integer"),
      ignore_eos=bool(_get(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean")),
      n=_get(body, "n", _is_int, "an integer"),
      priority=0 if priority is None else priority,
      slo_class=_get(body, "slo_class", lambda v: isinstance(v, str), "a string"),
      session_id=_get(body, "session_id", lambda v: isinstance(v, str), "a string") or "")


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float] | None:
  """OpenAI's ``logit_bias``: token ids as strings of integers -> numbers (validation checks
  the ids against the vocabulary and the ranges)."""
  bias = _get(body, "logit_bias", lambda v: isinstance(v, dict), "an object")
  if bias is None:
    return None
  out = {}
  for key, value in bias.items():
    if not re.fullmatch(r"-?[0-9]{1,10}", key):
      raise bad("logit_bias", f"keys must be token ids (strings of integers), got "
                f"{_short(key)}")
    t = int(key)
    if t in out:
      raise bad("logit_bias", f"token id {t} is given twice")
    if not _is_num(value):
      raise bad("logit_bias", f"token {key}: the bias must be a number, got {_short(value)}")
    out[t] = value
  return out


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
  stream = bool(_get(body, "stream", lambda v: isinstance(v, bool), "a boolean"))
  opts = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object")
  include_usage = False
  if opts is not None:
    if not stream:
      raise bad("stream_options", "only allowed with stream: true")
    extra = set(opts) - {"include_usage"}
    if extra:
      raise bad(f"stream_options.{sorted(extra)[0]}", "unknown field")
    include_usage = bool(_get(opts, "include_usage", lambda v: isinstance(v, bool),
                              "a boolean"))
  return stream, include_usage


def _user(body: Mapping[str, Any]) -> str:
  user = _get(body, "user", lambda v: isinstance(v, str), "a string") or ""
  if len(user) > MAX_USER_CHARS:
    raise bad("user", f"at most {MAX_USER_CHARS} characters, got {len(user)}")
  return user


def _object(body: object) -> Mapping[str, Any]:
  if not isinstance(body, dict):
    raise ApiError(400, "the request body must be a JSON object")
  return body


def parse_completion(body: object, model: str) -> Parsed:
  body = _object(body)
  _check_fields(body, _COMPLETION_FIELDS, model)
  prompt = body.get("prompt")
  if prompt is None:
    raise bad("prompt", "required")
  forms: list[dict[str, Any]]
  if isinstance(prompt, str):
    forms = [{"text": prompt}]
  elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
    forms = [{"token_ids": prompt}]
  elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
    forms = [{"text": p} for p in prompt]
  elif isinstance(prompt, list) and prompt and all(_int_list(p) for p in prompt):
    forms = [{"token_ids": p} for p in prompt]
  elif isinstance(prompt, list) and not prompt:
    raise bad("prompt", "the prompt is empty")
  else:
    raise bad("prompt", "must be a string, a list of strings, a list of token ids or a list "
              "of lists of token ids")
  if len(forms) > MAX_PROMPTS:
    raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(forms)}")
  logprobs = _get(body, "logprobs", _is_int, "an integer")
  add_bos = _get(body, "add_special_tokens", lambda v: isinstance(v, bool), "a boolean")
  common = _common(body)
  stream, include_usage = _stream_flags(body)
  args = tuple(GenerateArgs(
      **form, add_bos=add_bos is not False, max_tokens=_get(body, "max_tokens", _is_int,
                                                            "an integer"),
      logprobs=None if logprobs is None else max(logprobs, 1) if logprobs >= 0 else logprobs,
      **common) for form in forms)
  names = {"text": "prompt", "token_ids": "prompt", "prompt": "prompt"}
  return Parsed(False, args, names, common["n"] or 1, stream, include_usage, logprobs,
                _user(body))


def _content(i: int, content: object) -> str:
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    parts = []
    for j, part in enumerate(content):
      if not (isinstance(part, dict) and part.get("type") == "text" and
              isinstance(part.get("text"), str) and set(part) == {"type", "text"}):
        raise bad(f"messages[{i}].content[{j}]",
                  "only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
      parts.append(part["text"])
    return "".join(parts)
  raise bad(f"messages[{i}].content", "must be a string or a list of text parts")


def parse_chat(body: object, model: str) -> Parsed:
  body = _object(body)
  _check_fields(body, _CHAT_FIELDS, model)
  messages = body.get("messages")
  if not isinstance(messages, list):
    raise bad("messages", "required: a list of {role, content}")
  chat: list[tuple[str, str]] = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise bad(f"messages[{i}]", "must be an object with role and content")
    extra = sorted(set(m) - {"role", "content"})
    if extra:
      raise bad(f"messages[{i}].{extra[0]}", "not implemented by phaseserve")
    role = m.get("role")
    if not isinstance(role, str):
      raise bad(f"messages[{i}].role", "required: a string")
    chat.append((_ROLE_ALIASES.get(role, role), _content(i, m.get("content"))))
  max_tokens = _get(body, "max_tokens", _is_int, "an integer")
  max_completion = _get(body, "max_completion_tokens", _is_int, "an integer")
  if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
    raise bad("max_completion_tokens", "give max_completion_tokens or max_tokens (deprecated), "
              "not two different values")
  want_logprobs = _get(body, "logprobs", lambda v: isinstance(v, bool), "a boolean")
  top = _get(body, "top_logprobs", _is_int, "an integer")
  if top is not None and not want_logprobs:
    raise bad("top_logprobs", "requires logprobs: true")
  top_logprobs = (top or 0) if want_logprobs else None
  common = _common(body)
  stream, include_usage = _stream_flags(body)
  args = GenerateArgs(
      messages=chat, max_tokens=max_completion if max_completion is not None else max_tokens,
      logprobs=None if top_logprobs is None else max(top_logprobs, 1) if top_logprobs >= 0
      else top_logprobs, **common)
  names = {"text": "messages", "token_ids": "messages", "prompt": "messages",
           "max_tokens": "max_completion_tokens" if max_completion is not None else "max_tokens",
           "logprobs": "top_logprobs"}
  return Parsed(True, (args,), names, common["n"] or 1, stream, include_usage, top_logprobs,
                _user(body))


# -- responses ----------------------------------------------------------------------------------


def usage(streams: Sequence[Stream]) -> dict[str, Any]:
  """OpenAI's usage: the sum over the prompts of each one's ``Stream.usage()`` (its prompt
  counted once, not per sample; its cached tokens its first sample's)."""
  each = [s.usage() for s in streams]
  prompt = sum(u.prompt_tokens for u in each)
  completion = sum(u.completion_tokens for u in each)
  cached = sum(u.cached_tokens for u in each)
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}


class Response:
  """The objects of one request's answer; ``choice`` = prompt * n + sample."""

  def __init__(self, parsed: Parsed, model: str, request_id: str, tokenizer: Tokenizer):
    self.parsed = parsed
    self.model = model
    self.tok = tokenizer
    self.created = int(time.time())
    self.id = ("chatcmpl-" if parsed.chat else "cmpl-") + request_id
    choices = len(parsed.prompts) * parsed.n
    self.text = [""] * choices
    self.finish: list[str | None] = [None] * choices
    self.logprobs: list[list[Any]] = [[] for _ in range(choices)]
    self.offset = [0] * choices  # completions' text_offset

  def _head(self, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.parsed.chat else \
        "text_completion"
    return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

  def _token(self, tid: int) -> str:
    return self.tok.decode([tid])

  def _logprobs(self, choice: int, out: RequestOutput) -> Any:
    k = self.parsed.top_logprobs
    if k is None:
      return None
    if self.parsed.chat:
      entry = lambda t, lp: {"token": self._token(t), "logprob": lp,
                             "bytes": list(self.tok.token_bytes(t))}
      return {"content": [dict(entry(lp.token_id, lp.logprob),
                               top_logprobs=[entry(t, p) for t, p in lp.top[:k]])
                          for lp in out.logprobs]}
    tokens, offsets = [], []
    for lp in out.logprobs:
      tokens.append(self._token(lp.token_id))
      offsets.append(self.offset[choice])
      self.offset[choice] += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in out.logprobs],
            "top_logprobs": [{self._token(t): p for t, p in lp.top[:k]} for lp in out.logprobs],
            "text_offset": offsets}

  def choice(self, prompt: int, sample: int) -> int:
    return prompt * self.parsed.n + sample

  def chunk(self, choice: int, out: RequestOutput) -> dict[str, Any] | None:
    """One streamed output as an event object (None: nothing to send)."""
    finish = (FINISH.get(out.finish_reason)
              if out.finished and out.finish_reason is not None else None)
    if not (out.text or finish or (out.logprobs and self.parsed.top_logprobs is not None)):
      return None
    lp = self._logprobs(choice, out)
    if self.parsed.chat:
      c = {"index": choice, "delta": {"content": out.text} if out.text else {},
           "logprobs": lp, "finish_reason": finish}
    else:
      c = {"index": choice, "text": out.text, "logprobs": lp, "finish_reason": finish}
    obj = dict(self._head(True), choices=[c])
    if self.parsed.include_usage:
      obj["usage"] = None
    return obj

  def role_chunk(self, choice: int) -> dict[str, Any]:
    obj = dict(self._head(True), choices=[{"index": choice, "delta": {"role": "assistant",
                                                                       "content": ""},
                                           "logprobs": None, "finish_reason": None}])
    if self.parsed.include_usage:
      obj["usage"] = None
    return obj

  def usage_chunk(self, streams: Sequence[Stream]) -> dict[str, Any]:
    return dict(self._head(True), choices=[], usage=usage(streams))

  def add(self, choice: int, out: RequestOutput) -> None:
    self.text[choice] += out.text
    if out.finished:
      self.finish[choice] = (FINISH.get(out.finish_reason)
                             if out.finish_reason is not None else None)
    if self.parsed.top_logprobs is not None and out.logprobs:
      self.logprobs[choice].append(self._logprobs(choice, out))

  def _merged_logprobs(self, choice: int) -> Any:
    if self.parsed.top_logprobs is None:
      return None
    parts = self.logprobs[choice]
    if self.parsed.chat:
      return {"content": [e for p in parts for e in p["content"]]}
    return {k: [e for p in parts for e in p[k]]
            for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}

  def body(self, streams: Sequence[Stream]) -> dict[str, Any]:
    choices = []
    for c in range(len(self.text)):
      lp = self._merged_logprobs(c)
      if self.parsed.chat:
        choices.append({"index": c, "message": {"role": "assistant", "content": self.text[c]},
                        "logprobs": lp, "finish_reason": self.finish[c]})
      else:
        choices.append({"index": c, "text": self.text[c], "logprobs": lp,
                        "finish_reason": self.finish[c]})
    return dict(self._head(False), choices=choices, usage=usage(streams))
