"""OpenAI's response objects for one request: stream chunks, the usage chunk, the full body.

Contract: ``Response(parsed, model, request_id, tokenizer, prompts)`` shapes the answer of one
parsed request (``serving.api.http_api.Parsed``) whose prompts were admitted as ``prompts``
(``PromptInfo``: token count and the text ``echo`` repeats); choice ``p * n + i`` is sample i of
prompt p. ``chunk(choice, out)`` is one streamed event (None: nothing to send), ``role_chunk``
chat's first event per choice, ``usage_chunk(streams)`` the closing usage event, ``add`` +
``body(streams)`` the non-streaming answer.
  * ``usage``: each prompt counted once, every sample's completion; with
    ``stream_options.continuous_usage_stats`` (and ``include_usage``) every chunk carries its
    choice's running usage (vLLM's shape).
  * Logprobs: chat ``{"content": [{token, logprob, bytes, top_logprobs}]}``; completions
    ``{tokens, token_logprobs, top_logprobs, text_offset}`` whose ``top_logprobs`` always hold the
    sampled token (OpenAI's: ``logprobs: 0`` still returns it) besides the top ``logprobs``;
    ``return_tokens_as_token_ids`` spells tokens ``token_id:<id>``.
  * Every object has ``system_fingerprint``; choices carry ``stop_reason`` (the stop string or
    stop token id that ended it, else null) and completions ``prompt_logprobs: null`` (vLLM's
    fields, read by the openai client); ``finish_reason`` adds ``cancelled``, ``rejected``,
    ``error`` to OpenAI's set.
  * Tool calls (chat with ``Parsed.tools``): each choice's text goes through its
    ``serving.api.tool_calls.ToolCallParser``: ``message.tool_calls`` (content null when only
    calls) and ``delta.tool_calls`` chunks; ``finish_reason`` ``tool_calls`` when a call was made
    and the text stopped (``auto`` / ``required``; a named function's stays ``stop``, as OpenAI's).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Sequence

from models.text.tokenizer import Tokenizer
from serving.api.stream import Stream
from serving.api.tool_calls import ToolCallParser, extract, merge
from serving.request import RequestOutput, TokenLogprobs
from serving.stop import FinishReason

if TYPE_CHECKING:
  from serving.api.http_api import Parsed

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
          FinishReason.CANCELLED: "cancelled", FinishReason.REJECTED: "rejected",
          FinishReason.ERROR: "error"}


@dataclasses.dataclass(frozen=True)
class PromptInfo:
  tokens: int  # the prompt's token count (usage)
  text: str = ""  # what ``echo`` repeats before the completion


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

  def __init__(self, parsed: Parsed, model: str, request_id: str, tokenizer: Tokenizer,
               prompts: Sequence[PromptInfo], fingerprint: str = ""):
    self.parsed = parsed
    self.model = model
    self.tok = tokenizer
    self.prompts = list(prompts)
    self.fingerprint = fingerprint
    self.created = int(time.time())
    self.id = ("chatcmpl-" if parsed.chat else "cmpl-") + request_id
    choices = len(parsed.prompts) * parsed.n
    self.text = [""] * choices
    self.finish: list[str | None] = [None] * choices
    self.stop_reason: list[str | int | None] = [None] * choices
    self.logprobs: list[list[Any]] = [[] for _ in range(choices)]
    self.offset = [0] * choices  # completions' text_offset
    self.generated = [0] * choices  # tokens so far (continuous usage)
    self.echoed = [not parsed.echo] * choices
    tools = parsed.tools if parsed.chat else None
    self.parsers = None if tools is None else [ToolCallParser(tools) for _ in range(choices)]

  def _head(self, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.parsed.chat else \
        "text_completion"
    return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
            "system_fingerprint": self.fingerprint}

  def _token(self, tid: int) -> str:
    return f"token_id:{tid}" if self.parsed.tokens_as_ids else self.tok.decode([tid])

  def _chat_entry(self, tid: int, lp: float) -> dict[str, Any]:
    return {"token": self._token(tid), "logprob": lp, "bytes": list(self.tok.token_bytes(tid))}

  def _top(self, lp: TokenLogprobs, k: int) -> dict[str, float]:
    top = {self._token(t): p for t, p in lp.top[:k]}
    top.setdefault(self._token(lp.token_id), lp.logprob)
    return top

  def _logprobs(self, choice: int, out: RequestOutput) -> Any:
    k = self.parsed.top_logprobs
    if k is None:
      return None
    if self.parsed.chat:
      return {"content": [dict(self._chat_entry(lp.token_id, lp.logprob),
                               top_logprobs=[self._chat_entry(t, p) for t, p in lp.top[:k]])
                          for lp in out.logprobs]}
    tokens, offsets = [], []
    for lp in out.logprobs:
      tokens.append(self._token(lp.token_id))
      offsets.append(self.offset[choice])
      self.offset[choice] += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in out.logprobs],
            "top_logprobs": [self._top(lp, k) for lp in out.logprobs], "text_offset": offsets}

  def choice(self, prompt: int, sample: int) -> int:
    return prompt * self.parsed.n + sample

  def _usage_of(self, choice: int) -> dict[str, int]:
    prompt = self.prompts[choice // self.parsed.n].tokens
    done = self.generated[choice]
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

  def _text(self, choice: int, out: RequestOutput) -> str:
    if self.echoed[choice]:
      return out.text
    self.echoed[choice] = True
    return self.prompts[choice // self.parsed.n].text + out.text

  def _finish(self, out: RequestOutput) -> str | None:
    return (FINISH.get(out.finish_reason)
            if out.finished and out.finish_reason is not None else None)

  def _tool_finish(self, finish: str | None, called: bool) -> str | None:
    tools = self.parsed.tools
    if called and finish == "stop" and tools is not None and tools.choice != "named":
      return "tool_calls"
    return finish

  def chunk(self, choice: int, out: RequestOutput) -> dict[str, Any] | None:
    """One streamed output as an event object (None: nothing to send)."""
    self.generated[choice] += len(out.token_ids)
    finish = self._finish(out)
    text = self._text(choice, out)
    calls: list[dict[str, Any]] = []
    if self.parsers is not None:
      parser = self.parsers[choice]
      text, calls = parser.push(text)
      if out.finished:
        more, last = parser.finish()
        text, calls = text + more, merge(calls + last)
      finish = self._tool_finish(finish, parser.called)
    if not (text or calls or finish or
            (out.logprobs and self.parsed.top_logprobs is not None)):
      return None
    lp = self._logprobs(choice, out)
    stop_reason = out.stop_reason if finish else None
    if self.parsed.chat:
      delta: dict[str, Any] = {"content": text} if text else {}
      if calls:
        delta["tool_calls"] = calls
      c = {"index": choice, "delta": delta, "logprobs": lp,
           "finish_reason": finish, "stop_reason": stop_reason}
    else:
      c = {"index": choice, "text": text, "logprobs": lp, "finish_reason": finish,
           "stop_reason": stop_reason}
    obj = dict(self._head(True), choices=[c])
    self._chunk_usage(obj, choice)
    return obj

  def _chunk_usage(self, obj: dict[str, Any], choice: int) -> None:
    if self.parsed.continuous_usage:
      obj["usage"] = self._usage_of(choice)
    elif self.parsed.include_usage:
      obj["usage"] = None

  def role_chunk(self, choice: int) -> dict[str, Any]:
    obj = dict(self._head(True), choices=[{"index": choice, "delta": {"role": "assistant",
                                                                       "content": ""},
                                           "logprobs": None, "finish_reason": None}])
    self._chunk_usage(obj, choice)
    return obj

  def usage_chunk(self, streams: Sequence[Stream]) -> dict[str, Any]:
    return dict(self._head(True), choices=[], usage=usage(streams))

  def add(self, choice: int, out: RequestOutput) -> None:
    self.text[choice] += self._text(choice, out)
    self.generated[choice] += len(out.token_ids)
    if out.finished:
      self.finish[choice] = self._finish(out)
      self.stop_reason[choice] = out.stop_reason
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
        message: dict[str, Any] = {"role": "assistant", "content": self.text[c]}
        finish = self.finish[c]
        if self.parsed.tools is not None:
          message["content"], calls = extract(self.parsed.tools, self.text[c])
          message["tool_calls"] = calls
          finish = self._tool_finish(finish, bool(calls))
        choices.append({"index": c, "message": message, "logprobs": lp,
                        "finish_reason": finish, "stop_reason": self.stop_reason[c]})
      else:
        choices.append({"index": c, "text": self.text[c], "logprobs": lp,
                        "finish_reason": self.finish[c], "stop_reason": self.stop_reason[c],
                        "prompt_logprobs": None})
    return dict(self._head(False), choices=choices, usage=usage(streams))
