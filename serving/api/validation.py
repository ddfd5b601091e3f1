"""Every check a generation request passes before it may reach the engine, for every front end.

Contract: a front end (gRPC, JetStream's wire API, HTTP) fills ``GenerateArgs`` with what the
client sent (``None`` where a field was absent, so an unset field is never read as 0) and calls
``validate(args, tokenizer, limits) -> Validated``. Any problem raises ``InvalidArgument(field,
message)``; ``field`` is the API's own field name (``field_names`` maps this module's names to
another API's, e.g. JetStream's ``max_tokens`` or OpenAI's ``max_completion_tokens``). It checks
the prompt (one form, non-empty, valid UTF-8 or ids in vocab, a chat template that renders, chat
content as text unless ``Limits.special_in_messages``), the lengths (prompt + max_tokens within
the context: never truncated; ``truncate_prompt_tokens`` keeps the prompt's last k), each
sampling (penalties, ``logit_bias`` ids in vocab, ``min_p``) and stop parameter's range, ``n``
against ``max_n``, the SLO class (``best_effort`` or one of the server's), the session id, and
attention sinks (a fixed-size ring: ``max_tokens`` may then pass the context, up to
``MAX_STREAM_TOKENS``). ``validate(..., grammars)`` compiles a structured-output ``grammar``
(``serving.grammar.GrammarCompiler``; none: refused). Nothing here touches the engine. The full
list: BUILD_NOTES "Design: The API".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from models.text.chat_encode import ChatOptions
from models.text.chat_template import ChatMessage
from models.text.tokenizer import Tokenizer
from serving.api.admission import BEST_EFFORT
from serving.grammar import GrammarCompiler
from serving.grammar_spec import Grammar, GrammarSpecError
from serving.request import MAX_STREAM_TOKENS, Sinks
from serving.sampling import (BIAS_MAX, LOGIT_BIAS_MAX, LOGPROBS_MAX, PENALTY_MAX, SamplingParams,
                              fresh_seed)
from serving.stop import StopCriteria


class InvalidArgument(ValueError):
  """A request field is wrong; ``field`` names it in the API the client used."""

  def __init__(self, field: str, message: str):
    super().__init__(f"{field}: {message}")
    self.field = field
    self.message = message


@dataclasses.dataclass(frozen=True)
class Limits:
  max_context: int  # prompt + max_tokens
  default_max_tokens: int = 256
  max_n: int = 8
  max_stop_strings: int = 16
  max_stop_chars: int = 256
  slo_classes: tuple[str, ...] = ("interactive", "server", "long")
  default_slo_class: str = BEST_EFFORT  # a request naming none: never refused early
  attention_sinks: bool = False  # the engine runs a sink pool (serving.request.Sinks)
  page_size: int = 16  # the KV page size (sinks live in the first page)
  special_in_messages: bool = False  # message content may hold control tokens (chat_encode)


# A chat message: (role, content), (role, content, name) or (role, content, name, tool keys: the
# OpenAI ``tool_calls`` / ``tool_call_id`` as ChatMessage has them); bytes content: not yet
# checked UTF-8.
Message = (tuple[str, str | bytes] | tuple[str, str | bytes, str | None]
           | tuple[str, str | bytes, str | None, Mapping[str, object]])


@dataclasses.dataclass(frozen=True)
class GenerateArgs:
  """What the client sent, as plain values; ``None`` = absent (use the default)."""
  text: str | bytes | None = None  # bytes: not yet checked as UTF-8
  token_ids: Sequence[int] | None = None
  messages: Sequence[Message] | None = None
  chat_options: ChatOptions = ChatOptions()
  add_bos: bool = True  # text prompts: prepend the tokenizer's BOS (when it has one)
  max_tokens: int | None = None
  temperature: float | None = None
  top_k: int | None = None
  top_p: float | None = None
  min_p: float | None = None
  seed: int | None = None
  stop: Sequence[str | bytes] = ()
  stop_token_ids: Sequence[int] = ()
  min_tokens: int | None = None
  ignore_eos: bool = False
  include_stop_str: bool = False  # the text keeps a matched stop string
  skip_special_tokens: bool = True  # False: special tokens' texts stay in the text
  truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
  logprobs: int | None = None
  n: int | None = None
  priority: int = 0
  slo_class: str | None = None
  session_id: str = ""
  sinks_window: int | None = None  # attention sinks: the window (None: the whole context)
  sinks: int | None = None  # attention sinks: the sink tokens (default 4)
  grammar: Grammar | None = None  # structured output: the constraint (serving.grammar_spec)
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  repetition_penalty: float | None = None
  logit_bias: Mapping[int, float] | None = None  # token id -> bias
  speculative: bool = True  # False: this request never verifies draft ids (a server that drafts)
  lora: str = ""  # the LoRA adapter to run under, by name ("": the base model)


@dataclasses.dataclass(frozen=True)
class Validated:
  prompt_ids: tuple[int, ...]
  sampling: SamplingParams  # seed resolved: sample i of n uses seed + i
  stop: StopCriteria
  n: int
  priority: int
  slo_class: str
  session_id: str = ""
  sinks: Sinks | None = None
  speculative: bool = True


_ROLE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def _text(field: str, value: str | bytes) -> str:
  if isinstance(value, bytes):
    try:
      return value.decode("utf-8")
    except UnicodeDecodeError as e:
      raise InvalidArgument(field, f"invalid UTF-8 at byte {e.start}") from None
  return value


def chat_messages(messages: Sequence[Message]) -> list[ChatMessage]:
  """``(role, content[, name[, tool keys]])`` tuples as chat messages: at least one, role names
  of at most 64 letters, digits, ``_ . -`` (system, user, assistant, tool, or any other the
  template takes), valid UTF-8 (``InvalidArgument`` on ``messages`` otherwise); what Generate
  and Tokenize both accept."""
  msgs = list(messages)
  if not msgs:
    raise InvalidArgument("messages", "no messages")
  chat: list[ChatMessage] = []
  for i, m in enumerate(msgs):
    role = m[0]
    if not 0 < len(role) <= 64 or not set(role) <= _ROLE_CHARS:
      raise InvalidArgument("messages", f"message {i}: role must be a name of 1-64 letters, "
                            f"digits, _ . - (system, user, assistant, tool, ...), got {role!r}")
    msg: ChatMessage = {"role": role, "content": _text("messages", m[1])}
    if len(m) > 2 and m[2] is not None:
      msg["name"] = m[2]
    if len(m) > 3:
      msg.update(m[3])  # type: ignore[typeddict-item]  # tool_calls / tool_call_id
    chat.append(msg)
  return chat


def validate(args: GenerateArgs, tokenizer: Tokenizer, limits: Limits,
             field_names: Mapping[str, str] | None = None,
             grammars: GrammarCompiler | None = None) -> Validated:
  v = _validate(args, tokenizer, limits, field_names or {})
  if args.grammar is None:
    return v
  field = (field_names or {}).get(args.grammar.field, args.grammar.field)
  if grammars is None:
    raise InvalidArgument(field, "structured outputs are not enabled on this server")
  try:
    compiled = grammars.compile(args.grammar)
  except GrammarSpecError as e:
    raise InvalidArgument(field, str(e)[len(e.field) + 2:]) from None
  return dataclasses.replace(v, sampling=dataclasses.replace(v.sampling, grammar=compiled))


def _validate(args: GenerateArgs, tokenizer: Tokenizer, limits: Limits,
              names: Mapping[str, str]) -> Validated:

  def bad(field: str, message: str) -> InvalidArgument:
    return InvalidArgument(names.get(field, field), message)

  vocab = tokenizer.vocab_size
  forms = [f for f in ("text", "token_ids", "messages") if getattr(args, f) is not None]
  if len(forms) != 1:
    raise bad("prompt", "give exactly one of text, token_ids, messages"
              if forms else "the prompt is missing")
  if args.text is not None:
    text = _text("text", args.text)
    if not text:
      raise bad("text", "the prompt is empty")
    ids = tokenizer.encode(text)
    if args.add_bos and tokenizer.bos_id is not None:
      ids = [tokenizer.bos_id] + ids
  elif args.token_ids is not None:
    ids = list(args.token_ids)
    if not ids:
      raise bad("token_ids", "the prompt is empty")
    wrong = next((t for t in ids if not 0 <= t < vocab), None)
    if wrong is not None:
      raise bad("token_ids", f"token id {wrong} is outside the vocabulary [0, {vocab})")
  else:
    try:
      chat = chat_messages(args.messages or ())
    except InvalidArgument as e:
      raise bad("messages", e.message) from None
    options = args.chat_options
    if limits.special_in_messages:
      options = dataclasses.replace(options, special_in_content=True)
    try:
      ids = tokenizer.encode_chat(chat, options)
    except ValueError as e:
      raise bad("messages", f"the chat template failed: {e}") from None
    if not ids:
      raise bad("messages", "the rendered prompt is empty")
  if args.truncate_prompt_tokens is not None:
    if args.truncate_prompt_tokens < 1:
      raise bad("truncate_prompt_tokens", f"must be >= 1, got {args.truncate_prompt_tokens}")
    ids = ids[-args.truncate_prompt_tokens:]
  if args.sinks_window is not None:
    return _with_sinks(args, ids, limits, bad, vocab)
  ctx = limits.max_context
  if len(ids) >= ctx:
    raise bad("prompt", f"the prompt has {len(ids)} tokens; the context holds {ctx} "
              "(prompt + max_tokens), so at most {} prompt tokens".format(ctx - 1))
  max_tokens = limits.default_max_tokens if args.max_tokens is None else args.max_tokens
  if max_tokens < 1:
    raise bad("max_tokens", f"must be >= 1, got {max_tokens}")
  if args.max_tokens is None:
    max_tokens = min(max_tokens, ctx - len(ids))  # the default fits whatever context is left
  if len(ids) + max_tokens > ctx:
    raise bad("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
              f"the context ({ctx} tokens)")
  return _rest(args, ids, max_tokens, limits, bad, vocab)


def _with_sinks(args: GenerateArgs, ids: list[int], limits: Limits, bad, vocab: int
                ) -> Validated:
  window = args.sinks_window
  assert window is not None  # the caller's condition
  sinks = 4 if args.sinks is None else args.sinks
  if not limits.attention_sinks:
    raise bad("attention_sinks", "this server was started without --attention_sinks")
  if window < 1:
    raise bad("attention_sinks.window", f"must be >= 1, got {window}")
  if not 0 <= sinks <= limits.page_size:
    raise bad("attention_sinks.sinks", f"must be in [0, {limits.page_size}] (one KV page), "
              f"got {sinks}")
  if len(ids) > sinks + window:
    raise bad("prompt", f"the prompt has {len(ids)} tokens; with attention sinks it must fit in "
              f"sinks + window = {sinks + window}")
  if args.n not in (None, 0, 1):
    raise bad("n", "attention sinks take one sample (n = 1)")
  if args.session_id:
    raise bad("session_id", "a stream with attention sinks cannot continue a session")
  max_tokens = limits.default_max_tokens if args.max_tokens is None else args.max_tokens
  if not 1 <= max_tokens <= MAX_STREAM_TOKENS:
    raise bad("max_tokens", f"must be in [1, {MAX_STREAM_TOKENS}] for a stream, got "
              f"{max_tokens}")
  v = _rest(args, ids, max_tokens, limits, bad, vocab)
  return dataclasses.replace(v, sinks=Sinks(window, sinks))


def _float(value: float, field: str, bad) -> float:
  try:
    return float(value)
  except OverflowError:  # a JSON integer literal beyond a double's range
    raise bad(field, "must be a finite number, got an integer out of range") from None


def _penalties(args: GenerateArgs, bad) -> tuple[float, float, float]:
  """(presence, frequency, repetition): OpenAI's ranges, vLLM's repetition (> 0, 1 = off)."""
  out = []
  for field, value, default in (("presence_penalty", args.presence_penalty, 0.0),
                                ("frequency_penalty", args.frequency_penalty, 0.0)):
    v = default if value is None else _float(value, field, bad)
    if not -PENALTY_MAX <= v <= PENALTY_MAX:  # also rejects NaN
      raise bad(field, f"must be in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}], got {v}")
    out.append(v)
  r = 1.0 if args.repetition_penalty is None else _float(args.repetition_penalty,
                                                         "repetition_penalty", bad)
  if not (math.isfinite(r) and r > 0):
    raise bad("repetition_penalty", f"must be finite and > 0 (1 = off), got {r}")
  return out[0], out[1], r


def _logit_bias(args: GenerateArgs, bad, vocab: int) -> tuple[tuple[int, float], ...]:
  """Sorted (id, bias) pairs: at most LOGIT_BIAS_MAX, ids in the vocabulary, biases in range."""
  bias = args.logit_bias or {}
  if len(bias) > LOGIT_BIAS_MAX:
    raise bad("logit_bias", f"at most {LOGIT_BIAS_MAX} entries, got {len(bias)}")
  out = []
  for t, b in sorted(bias.items()):
    if not 0 <= t < vocab:
      raise bad("logit_bias", f"token id {t} is outside the vocabulary [0, {vocab})")
    v = _float(b, "logit_bias", bad)
    if not -BIAS_MAX <= v <= BIAS_MAX:  # also rejects NaN
      raise bad("logit_bias", f"token {t}: the bias must be in [-{BIAS_MAX:g}, {BIAS_MAX:g}], "
                f"got {v}")
    out.append((int(t), v))
  return tuple(out)


def _rest(args: GenerateArgs, ids: list[int], max_tokens: int, limits: Limits, bad,
          vocab: int) -> Validated:
  temperature = 0.0 if args.temperature is None else _float(args.temperature, "temperature", bad)
  if not math.isfinite(temperature) or temperature < 0:
    raise bad("temperature", f"must be finite and >= 0, got {temperature}")
  top_p = 1.0 if args.top_p is None else _float(args.top_p, "top_p", bad)
  if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
    raise bad("top_p", f"must be in (0, 1], got {top_p}")
  top_k = 0 if args.top_k is None else args.top_k
  if not 0 <= top_k <= vocab:
    raise bad("top_k", f"must be in [0, {vocab}] (0 = no top-k filter), got {top_k}")
  logprobs = 0 if args.logprobs is None else args.logprobs
  if not 0 <= logprobs <= LOGPROBS_MAX:
    raise bad("logprobs", f"must be in [0, {LOGPROBS_MAX}], got {logprobs}")
  n = 1 if not args.n else args.n
  if not 1 <= n <= limits.max_n:
    raise bad("n", f"must be in [0, {limits.max_n}] (0 means 1), got {args.n}")
  stops = [_text("stop", s) for s in args.stop]
  if len(stops) > limits.max_stop_strings:
    raise bad("stop", f"at most {limits.max_stop_strings} stop strings, got {len(stops)}")
  for s in stops:
    if not s:
      raise bad("stop", "stop strings must be non-empty")
    if len(s) > limits.max_stop_chars:
      raise bad("stop", f"a stop string has {len(s)} characters; at most "
                f"{limits.max_stop_chars}")
  wrong = next((t for t in args.stop_token_ids if not 0 <= t < vocab), None)
  if wrong is not None:
    raise bad("stop_token_ids", f"token id {wrong} is outside the vocabulary [0, {vocab})")
  min_tokens = args.min_tokens or 0
  if not 0 <= min_tokens <= max_tokens:
    raise bad("min_tokens", f"must be in [0, max_tokens={max_tokens}], got {min_tokens}")
  slo = args.slo_class or limits.default_slo_class
  if slo not in limits.slo_classes and slo != BEST_EFFORT:
    raise bad("slo_class", f"unknown SLO class {slo!r}; the server has "
              f"{', '.join(limits.slo_classes)}")
  if not -2**63 <= args.priority < 2**63:
    raise bad("priority", f"must be a 64-bit integer, got {args.priority}")
  if len(args.session_id) > 128:
    raise bad("session_id", f"at most 128 characters, got {len(args.session_id)}")
  seed = fresh_seed() if args.seed is None else int(args.seed)
  if not 0 <= seed < 2**32:
    raise bad("seed", f"must be in [0, 2**32), got {seed}")
  min_p = 0.0 if args.min_p is None else _float(args.min_p, "min_p", bad)
  if not 0.0 <= min_p <= 1.0:  # also NaN
    raise bad("min_p", f"must be in [0, 1], got {min_p}")
  sampling = SamplingParams(temperature, top_k, top_p, seed, logprobs,
                            *_penalties(args, bad), logit_bias=_logit_bias(args, bad, vocab),
                            min_p=min_p)
  stop = StopCriteria(max_tokens=max_tokens, stop_ids=tuple(args.stop_token_ids),
                      stop_strings=tuple(stops), min_tokens=min_tokens,
                      ignore_eos=args.ignore_eos, include_stop_str=args.include_stop_str,
                      keep_special=not args.skip_special_tokens)
  return Validated(tuple(ids), sampling, stop, n, int(args.priority), slo, args.session_id,
                   speculative=args.speculative)
