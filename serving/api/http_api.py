"""OpenAI's HTTP requests as protocol logic: a JSON body in, one ``GenerateArgs`` per prompt out.

Contract (``serving.api.http_server`` is the wiring; every guarantee lives in
``serving.api.frontend``; errors and body decoding: ``serving.api.http_errors``; responses:
``serving.api.http_response``):
  * ``parse_completion(body, served)`` / ``parse_chat(body, served) -> Parsed``: one
    ``serving.api.validation.GenerateArgs`` per prompt plus the field-name map, so every value
    check is the gRPC service's with messages naming the HTTP field.
  * Fields, as vLLM's OpenAI server takes them: the accepted ones are honoured; a field that
    would change the output a client relies on (format, tools, beam search, ...) and is not
    implemented is a 400 naming it unless it holds its no-op value (``UNIMPLEMENTED``); any other
    field is accepted and ignored: ``Parsed.ignored`` names it (logged once per name, and sent
    back in the ``X-Ignored-Fields`` response header). A wrong JSON type is a 400 naming the field.
  * Structured outputs: ``response_format`` (``json_object``, ``json_schema``), vLLM's
    ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and
    ``structured_outputs`` become one ``serving.grammar_spec.Grammar`` (a malformed one: a 400
    naming the field; compiled by the Frontend's grammar compiler).
  * ``model`` may be absent (the served model) or a LoRA adapter's name (``Served.loras``: the
    request runs under it, as vLLM); another id is 404 ``model_not_found``.
  * Sampling defaults are ``Served.defaults``: OpenAI's (temperature 1, top_p 1) or the model's
    ``generation_config.json`` (as vLLM reads it); ``n`` 1, a fresh ``seed``; the server's
    ``--default_max_tokens`` and ``--default_slo_class``; a text prompt gets BOS.
  * ``seed``: any 64-bit integer (OpenAI's and vLLM's range); one in [0, 2**32) is the engine's
    seed as is, any other is mixed into 32 bits (deterministic).
  * ``prompt``: string(s) or token ids (at most ``MAX_PROMPTS``); choice ``p * n + i``.
  * Chat ``messages``: roles system / user / assistant / tool, ``developer`` (= system) and any
    other identifier (passed to the template, as vLLM does); content a string, text parts or null;
    ``name`` passed to the template; an assistant's ``tool_calls`` and a tool's ``tool_call_id``
    are accepted back. Message content is never tokenized into control ids
    (``models.text.chat_encode``) unless the server allows it.
  * Tool calling (chat): ``tools``, ``tool_choice``, ``parallel_tool_calls``
    (``serving.api.tool_calls``): the tools reach the chat template, ``required`` and a named
    function set the request's grammar (with another structured-output field: a 400 naming
    ``tool_choice``); ``Parsed.tools`` tells the response to parse the calls back.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from typing import Any, Mapping

from models.text.chat_encode import ChatOptions
from serving.api import tool_calls
from serving.api.http_errors import ApiError, bad
from serving.api.tool_calls import ToolSpec
from serving.api.validation import GenerateArgs, Message
from serving.grammar_spec import GUIDED_FIELDS, GrammarSpecError, grammar_from_request
from serving.lora import LoraRegistry

_log = logging.getLogger(__name__)

MAX_PROMPTS = 32  # prompts of one /v1/completions request
MAX_USER_CHARS = 256

# Not implemented, and ignoring them would change what the client gets: accepted only at their
# no-op value (absent or null always is).
UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],),
    "function_call": ("none", "auto"),
    "suffix": ("",), "audio": (), "use_beam_search": (False,),
    "prompt_logprobs": (), "allowed_token_ids": (),
    "bad_words": ([],), "chat_template": (), "documents": ([],),
    "spaces_between_special_tokens": (True,), "add_special_tokens": (False,),  # chat only
    "echo": (False,),  # chat only (completions implement it)
}

_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "user",
           "stream", "stream_options", "priority", "slo_class", "session_id", "min_tokens",
           "ignore_eos", "stop_token_ids", "attention_sinks", "include_stop_str_in_output",
           "speculative",
           "return_tokens_as_token_ids", "truncate_prompt_tokens", "best_of",
           "skip_special_tokens",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p",
           "response_format", "structured_outputs", "guided_whitespace_pattern",
           *GUIDED_FIELDS)
_COMPLETION_FIELDS = frozenset(_COMMON + ("prompt", "logprobs", "add_special_tokens", "echo"))
_CHAT_FIELDS = frozenset(_COMMON + ("messages", "max_completion_tokens", "logprobs",
                                    "top_logprobs", "add_generation_prompt",
                                    "continue_final_message", "chat_template_kwargs",
                                    "parallel_tool_calls", "tools", "tool_choice"))
_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
_ROLE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")
_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")  # OpenAI's participant names
_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
_PART_TYPES = {"text"}


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
  """What a request that leaves a sampling field out gets."""
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  source: str = "OpenAI's defaults"


def defaults_from_generation_config(cfg: Mapping[str, Any], source: str) -> SamplingDefaults:
  """The sampling defaults a model's ``generation_config.json`` sets (vLLM reads temperature,
  top_p and top_k from it); OpenAI's for the rest."""
  base = SamplingDefaults()
  t, p, k = cfg.get("temperature"), cfg.get("top_p"), cfg.get("top_k")
  if not any(_is_num(v) for v in (t, p, k)):
    return base
  return SamplingDefaults(float(t) if isinstance(t, (int, float)) else base.temperature,
                          float(p) if isinstance(p, (int, float)) else base.top_p,
                          k if isinstance(k, int) and k > 0 else base.top_k, source)


@dataclasses.dataclass(frozen=True)
class Served:
  model: str  # the served model's id
  defaults: SamplingDefaults = SamplingDefaults()
  loras: LoraRegistry | None = None  # the LoRA adapters served, by name (None: none)


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
  continuous_usage: bool = False  # a running usage object in every chunk
  echo: bool = False  # completions: the prompt's text before each choice's
  tokens_as_ids: bool = False  # logprobs spell tokens "token_id:<id>"
  ignored: tuple[str, ...] = ()  # fields accepted and ignored
  tools: ToolSpec | None = None  # chat with tools: the calls to parse out of the text


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_ignored(names: list[str]) -> None:
  with _warned_lock:
    new = [n for n in names if n not in _warned]
    _warned.update(new)
  if new:
    _log.warning("request fields ignored (logged once per name): %s", ", ".join(new))


def _is_int(v: object) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_bool(v: object) -> bool:
  return isinstance(v, bool)


def _get(body: Mapping[str, Any], name: str, check, what: str, path: str = ""):
  v = body.get(name)
  if v is None:
    return None
  if not check(v):
    raise bad(path + name, f"must be {what}, got {type(v).__name__} {_short(v)}")
  return v


def _short(v: object) -> str:
  s = repr(v)
  return s if len(s) <= 40 else s[:37] + "..."


def _int_list(v: object) -> bool:
  return isinstance(v, list) and all(_is_int(t) for t in v)


def _noop(value: Any, defaults: tuple[Any, ...]) -> bool:
  return value is None or any(value == d and type(value) is type(d) or
                              (_is_num(value) and _is_num(d) and value == d) for d in defaults)


def _check_fields(body: Mapping[str, Any], allowed: frozenset[str], served: Served) -> list[str]:
  """The names of the fields to ignore; a 400 for an unimplemented field that is not a no-op,
  404 for another model."""
  ignored = []
  for name, value in body.items():
    if name in allowed:
      continue
    if name in UNIMPLEMENTED:
      if _noop(value, UNIMPLEMENTED[name]):
        continue
      raise bad(name, "not implemented by phaseserve (only its no-op default is accepted)")
    ignored.append(name)
  check_model(body, served)
  return ignored


def check_model(body: Mapping[str, Any], served: Served) -> str:
  """``model`` absent, null, empty or the served id (-> ""), or a LoRA adapter's name (->
  it); another id is a 404."""
  got = body.get("model")
  if got is not None and not isinstance(got, str):
    raise bad("model", f"must be a string, got {type(got).__name__}")
  if not got or got == served.model:
    return ""
  try:
    if served.loras is not None:
      return served.loras.resolve(got).name
  except LookupError:
    pass
  adapters = [r.name for r in served.loras.names()] if served.loras is not None else []
  also = f" and the LoRA adapters {', '.join(adapters)}" if adapters else ""
  raise ApiError(404, f"The model {got!r} does not exist; this server serves {served.model!r}"
                 f"{also}", param="model", code="model_not_found")


def get_bool(body: Mapping[str, Any], name: str) -> bool | None:
  return _get(body, name, _is_bool, "a boolean")


def _seed(body: Mapping[str, Any]) -> int | None:
  seed = _get(body, "seed", _is_int, "an integer")
  if seed is None or 0 <= seed < 2**32:
    return seed
  if not -2**63 <= seed < 2**64:
    raise bad("seed", f"must be a 64-bit integer, got {_short(seed)}")
  x = seed % 2**64  # splitmix64's finalizer: every 64-bit seed its own 32-bit engine seed
  x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
  x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
  return (x ^ (x >> 31)) >> 32


def _common(body: Mapping[str, Any], served: Served) -> dict[str, Any]:
  """The sampling, stop and extension fields both endpoints share, as GenerateArgs keywords."""
  d = served.defaults
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
  temperature = _get(body, "temperature", _is_num, "a number")
  top_p = _get(body, "top_p", _is_num, "a number")
  n = _get(body, "n", _is_int, "an integer")
  best_of = _get(body, "best_of", _is_int, "an integer")
  if best_of is not None and best_of != (n or 1):
    raise bad("best_of", "not implemented by phaseserve (only best_of = n is accepted)")
  try:
    grammar = grammar_from_request(body)
  except GrammarSpecError as e:
    raise bad(e.field, str(e)[len(e.field) + 2:]) from None
  truncate = _get(body, "truncate_prompt_tokens", _is_int, "an integer")
  if truncate is not None and truncate < 1:
    raise bad("truncate_prompt_tokens", f"must be >= 1, got {truncate}")
  return dict(
      sinks_window=window, sinks=k, logit_bias=_logit_bias(body),
      presence_penalty=_get(body, "presence_penalty", _is_num, "a number"),
      frequency_penalty=_get(body, "frequency_penalty", _is_num, "a number"),
      repetition_penalty=_get(body, "repetition_penalty", _is_num, "a number"),
      temperature=d.temperature if temperature is None else temperature,
      top_p=d.top_p if top_p is None else top_p,
      min_p=_get(body, "min_p", _is_num, "a number"),
      top_k=d.top_k if top_k is None else 0 if top_k == -1 else top_k,  # vLLM: -1 is no top-k
      seed=_seed(body), stop=stops,
      stop_token_ids=_get(body, "stop_token_ids", _int_list, "a list of token ids") or [],
      min_tokens=_get(body, "min_tokens", _is_int, "an integer"),
      ignore_eos=bool(_get(body, "ignore_eos", _is_bool, "a boolean")),
      speculative=_get(body, "speculative", _is_bool, "a boolean") is not False,
      include_stop_str=bool(_get(body, "include_stop_str_in_output", _is_bool, "a boolean")),
      skip_special_tokens=_get(body, "skip_special_tokens", _is_bool, "a boolean") is not False,
      truncate_prompt_tokens=truncate, n=n, grammar=grammar,
      priority=0 if priority is None else priority,
      slo_class=_get(body, "slo_class", lambda v: isinstance(v, str), "a string"),
      session_id=_get(body, "session_id", lambda v: isinstance(v, str), "a string") or "",
      lora=check_model(body, served))


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


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool, bool]:
  """(stream, include_usage, continuous_usage): vLLM sends a running usage in every chunk only
  when both stream options are on."""
  stream = bool(_get(body, "stream", _is_bool, "a boolean"))
  opts = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object")
  if opts is None:
    return stream, False, False
  if not stream:
    raise bad("stream_options", "only allowed with stream: true")
  extra = set(opts) - {"include_usage", "continuous_usage_stats"}
  if extra:
    raise bad(f"stream_options.{sorted(extra)[0]}", "unknown field")
  path = "stream_options."
  include = bool(_get(opts, "include_usage", _is_bool, "a boolean", path))
  continuous = bool(_get(opts, "continuous_usage_stats", _is_bool, "a boolean", path))
  return stream, include, include and continuous


def _user(body: Mapping[str, Any]) -> str:
  user = _get(body, "user", lambda v: isinstance(v, str), "a string") or ""
  if len(user) > MAX_USER_CHARS:
    raise bad("user", f"at most {MAX_USER_CHARS} characters, got {len(user)}")
  return user


def _object(body: object) -> Mapping[str, Any]:
  if not isinstance(body, dict):
    raise ApiError(400, "the request body must be a JSON object")
  return body


def _logprobs_n(top: int | None) -> int | None:
  """The engine's top-n for a request's logprobs (at least 1: the chosen token's)."""
  return None if top is None else max(top, 1) if top >= 0 else top


def parse_completion(body: object, served: Served) -> Parsed:
  body = _object(body)
  ignored = _check_fields(body, _COMPLETION_FIELDS, served)
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
  add_bos = _get(body, "add_special_tokens", _is_bool, "a boolean")
  echo = bool(_get(body, "echo", _is_bool, "a boolean"))
  if echo and logprobs is not None:
    raise bad("echo", "echo with logprobs (the prompt's logprobs) is not implemented by "
              "phaseserve")
  common = _common(body, served)
  stream, include_usage, continuous = _stream_flags(body)
  args = tuple(GenerateArgs(
      **form, add_bos=add_bos is not False,
      max_tokens=_get(body, "max_tokens", _is_int, "an integer"),
      logprobs=_logprobs_n(logprobs), **common) for form in forms)
  names = {"text": "prompt", "token_ids": "prompt", "prompt": "prompt"}
  return _parsed(False, args, names, common, stream, include_usage, logprobs, body, ignored,
                 continuous, echo)


def _parsed(chat: bool, args: tuple[GenerateArgs, ...], names: dict[str, str],
            common: dict[str, Any], stream: bool, include_usage: bool, top: int | None,
            body: Mapping[str, Any], ignored: list[str], continuous: bool,
            echo: bool = False) -> Parsed:
  _warn_ignored(ignored)
  as_ids = bool(_get(body, "return_tokens_as_token_ids", _is_bool, "a boolean"))
  return Parsed(chat, args, names, common["n"] or 1, stream, include_usage, top, _user(body),
                continuous, echo, as_ids, tuple(ignored))


def _content(i: int, content: object) -> str:
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    parts = []
    for j, part in enumerate(content):
      where = f"messages[{i}].content[{j}]"
      if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise bad(where, "must be an object with a type")
      if part["type"] not in _PART_TYPES:
        raise bad(where, f"content parts of type {part['type']!r} are not supported (text only)")
      if not isinstance(part.get("text"), str):
        raise bad(f"{where}.text", "required: a string")
      parts.append(part["text"])
    return "".join(parts)
  raise bad(f"messages[{i}].content", "must be a string, a list of text parts or null")


def message(i: int, m: object, ignored: list[str]) -> Message:
  if not isinstance(m, dict):
    raise bad(f"messages[{i}]", "must be an object with role and content")
  role = m.get("role")
  if not isinstance(role, str) or not _ROLE.fullmatch(role):
    raise bad(f"messages[{i}].role", "required: a role name (letters, digits, _ . -; at most "
              f"64 characters), got {_short(role)}")
  ignored += [f"messages[{i}].{k}" for k in sorted(set(m) - _MESSAGE_FIELDS)]
  name = _get(m, "name", lambda v: isinstance(v, str) and _NAME.fullmatch(v) is not None,
              "a name of 1-64 letters, digits, _ or -", f"messages[{i}].")
  content = _content(i, m.get("content"))
  role = _ROLE_ALIASES.get(role, role)
  keys = tool_calls.message_keys(i, m)
  if keys:
    return role, content, name, keys
  return (role, content) if name is None else (role, content, name)


def chat_options(body: Mapping[str, Any]) -> ChatOptions:
  gen = _get(body, "add_generation_prompt", _is_bool, "a boolean")
  cont = bool(_get(body, "continue_final_message", _is_bool, "a boolean"))
  if cont and gen:
    raise bad("continue_final_message", "cannot be combined with add_generation_prompt: true")
  kwargs = _get(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object")
  return ChatOptions(add_generation_prompt=gen is not False, continue_final=cont,
                     template_vars=kwargs or None)


def parse_chat(body: object, served: Served) -> Parsed:
  body = _object(body)
  ignored = _check_fields(body, _CHAT_FIELDS, served)
  messages = body.get("messages")
  if not isinstance(messages, list):
    raise bad("messages", "required: a list of {role, content}")
  chat = [message(i, m, ignored) for i, m in enumerate(messages)]
  max_tokens = _get(body, "max_tokens", _is_int, "an integer")
  max_completion = _get(body, "max_completion_tokens", _is_int, "an integer")
  if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
    raise bad("max_completion_tokens", "give max_completion_tokens or max_tokens (deprecated), "
              "not two different values")
  tools = tool_calls.parse_tools(body)
  want_logprobs = _get(body, "logprobs", _is_bool, "a boolean")
  top = _get(body, "top_logprobs", _is_int, "an integer")
  if top is not None and not want_logprobs:
    raise bad("top_logprobs", "requires logprobs: true")
  top_logprobs = (top or 0) if want_logprobs else None
  common = _common(body, served)
  if tools is not None and (tool_grammar := tools.grammar()) is not None:
    if common["grammar"] is not None:
      raise bad("tool_choice", f"{tools.choice} constrains the output to tool calls; it cannot "
                f"be combined with {common['grammar'].field}")
    common["grammar"] = tool_grammar
  options = chat_options(body)
  if tools is not None:
    options = dataclasses.replace(options, tools=tools.tools)
  stream, include_usage, continuous = _stream_flags(body)
  args = GenerateArgs(
      messages=chat, chat_options=options,
      max_tokens=max_completion if max_completion is not None else max_tokens,
      logprobs=_logprobs_n(top_logprobs), **common)
  names = {"text": "messages", "token_ids": "messages", "prompt": "messages",
           "max_tokens": "max_completion_tokens" if max_completion is not None else "max_tokens",
           "logprobs": "top_logprobs"}
  parsed = _parsed(True, (args,), names, common, stream, include_usage, top_logprobs, body,
                   ignored, continuous)
  return dataclasses.replace(parsed, tools=tools if tools and tools.parses else None)
