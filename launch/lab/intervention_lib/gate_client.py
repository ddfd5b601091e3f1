"""Ask one server for the quality gates' answers: greedy, one request at a time.

Contract: ``GateClient(grpc_target, http_base)`` reads the server's context from
``ServerInfo``; ``answer(item, max_tokens, logprobs)`` returns an ``Answer``:
  * completion prompts (``text``) and chats go through ``Generation.Generate`` (temperature 0,
    ``logprobs`` top entries per generated id), a ``text`` prompt tokenized by the server and cut
    from the left to fit ``prompt + max_tokens`` in the context (the continuation point is kept);
  * ``long_context`` items get their filler built here, sized with the server's tokenizer to
    ``item.long_tokens`` tokens, the fact planted at ``item.depth``;
  * ``structured`` items go through ``POST /v1/chat/completions`` (``response_format``
    ``json_schema`` when ``constrained``), text only (the HTTP API gives no token ids), with
    twice ``max_tokens`` (an object of three fields takes about 30 ids of syntax);
  * a chat that does not fit the context is ``skipped``, never cut;
  * an item with ``sinks_window`` is sent with ``attention_sinks`` (that window, 4 sinks) and
    streams ``stream_tokens`` ids, past the context (the servers need ``--attention_sinks``).
Requests go one after another, so a config is compared with itself on the same batch shapes:
batched rows may round differently, which a gate would then count as a change.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
import zlib

import numpy as np

from launch.lab.intervention_lib import gate_sets
from launch.lab.intervention_lib.gate_sets import Item


@dataclasses.dataclass(frozen=True)
class Answer:
  status: str                                    # ok | skipped | an error
  text: str = ""
  ids: tuple[int, ...] | None = None             # None: the API gives none
  top: tuple[tuple[tuple[int, float], ...], ...] = ()  # per generated id, best first
  error: str = ""


class GateClient:
  def __init__(self, grpc_target: str, http_base: str, timeout_s: float = 600.0):
    import grpc
    from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
    from serving.api.proto.phaseserve.v1 import generation_pb2_grpc as pb_grpc
    self.grpc, self.pb = grpc, pb
    self.channel = grpc.insecure_channel(grpc_target)
    self.stub = pb_grpc.GenerationStub(self.channel)
    self.http = http_base
    self.timeout_s = timeout_s
    info = self.stub.ServerInfo(pb.ServerInfoRequest(), timeout=30)
    self.max_context = info.max_context
    self.model = self._model_id()

  def close(self) -> None:
    self.channel.close()

  def _model_id(self) -> str:
    with urllib.request.urlopen(self.http + "/v1/models", timeout=30) as r:
      return json.load(r)["data"][0]["id"]

  def _count(self, text: str = "", chat: str = "") -> int:
    pb = self.pb
    req = (pb.TokenizeRequest(messages=self._messages(chat)) if chat
           else pb.TokenizeRequest(text=text, add_bos=True))
    return len(self.stub.Tokenize(req, timeout=60).token_ids)

  def _messages(self, chat: str):
    pb = self.pb
    return pb.Messages(messages=[pb.ChatMessage(role="user", content=chat)])

  def long_prompt(self, item: Item, seed: int) -> str:
    rng = np.random.default_rng(seed)
    per = max(1, self._count(" ".join(gate_sets.filler_sentences(rng, 16))) // 16)
    sentences = gate_sets.filler_sentences(rng, max(4, item.long_tokens // per + 4))

    def render(ss: list[str]) -> str:
      at = int(item.depth * len(ss))
      return " ".join(ss[:at] + [gate_sets.long_fact(item)] + ss[at:]) + \
          gate_sets.long_question(item)

    text = render(sentences)
    while len(sentences) > 1 and (over := self._count(text) - item.long_tokens) > 0:
      sentences = sentences[:-max(1, over // per)]
      text = render(sentences)
    return text

  def answer(self, item: Item, max_tokens: int, logprobs: int) -> Answer:
    try:
      if item.schema is not None:  # JSON spends tokens on syntax: twice the budget
        return self._structured(item, 2 * max_tokens)
      return self._generate(item, max_tokens, logprobs)
    except self.grpc.RpcError as e:
      return Answer(e.code().name, error=e.details() or "")
    except (OSError, ValueError, KeyError) as e:
      return Answer(type(e).__name__, error=str(e)[:300])

  def _generate(self, item: Item, max_tokens: int, logprobs: int) -> Answer:
    pb = self.pb
    req = pb.GenerateRequest(max_tokens=max_tokens, logprobs=logprobs)
    req.sampling.temperature = 0.0
    if item.chat:
      if self._count(chat=item.chat) + max_tokens > self.max_context:
        return Answer("skipped", error="the chat does not fit the context")
      req.messages.CopyFrom(self._messages(item.chat))
    else:
      text = (self.long_prompt(item, zlib.crc32(item.name.encode())) if item.long_tokens
              else item.text)
      ids = list(self.stub.Tokenize(pb.TokenizeRequest(text=text, add_bos=True),
                                    timeout=60).token_ids)
      if item.sinks_window:  # a ring of sinks + window: the stream may pass the context
        req.attention_sinks.window = item.sinks_window
        req.max_tokens = item.stream_tokens
        req.token_ids.ids.extend(ids[-item.sinks_window:])
        return self._stream(req)
      room = self.max_context - max_tokens
      if room < 8:
        return Answer("skipped", error="max_tokens leaves no room for a prompt")
      req.token_ids.ids.extend(ids[-room:])
    return self._stream(req)

  def _stream(self, req) -> Answer:
    ids_out: list[int] = []
    text_out: list[str] = []
    top: list[tuple[tuple[int, float], ...]] = []
    for r in self.stub.Generate(req, timeout=self.timeout_s):
      ids_out.extend(r.token_ids)
      text_out.append(r.text)
      top.extend(tuple((t.token_id, t.logprob) for t in lp.top) for lp in r.logprobs)
    return Answer("ok", "".join(text_out), tuple(ids_out), tuple(top))

  def _structured(self, item: Item, max_tokens: int) -> Answer:
    body: dict = {"model": self.model, "max_tokens": max_tokens, "temperature": 0,
                  "messages": [{"role": "user", "content": item.chat}]}
    if item.constrained:
      body["response_format"] = {"type": "json_schema",
                                 "json_schema": {"name": item.name, "schema": item.schema}}
    req = urllib.request.Request(self.http + "/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
      with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
        reply = json.load(r)
    except urllib.error.HTTPError as e:
      return Answer(f"http_{e.code}", error=e.read().decode(errors="replace")[:300])
    return Answer("ok", reply["choices"][0]["message"]["content"] or "")
