"""Async clients for one generation each: phaseserve, JetStream and any OpenAI-compatible server.

Contract: ``make_driver(cfg)`` returns a ``Driver``; ``await driver.generate(prompt_ids,
prompt_text, max_tokens, session_id)`` streams one greedy answer and returns an ``Outcome``
(never raises for a failed request: ``status`` is ``ok``, the gRPC status name, ``http_<code>``,
``stream_error`` or the exception's class; ``on_first()``, if given, is called as the first
generated token arrives); ``await driver.close()``. Times are
``time.monotonic()`` seconds on this machine's clock: sent, first generated token, end.

* ``phaseserve``: ``Generation.Generate`` with ``token_ids`` (``ignore_eos``, ``session_id``,
  optionally ``slo_class``); the final message's usage and server timings are kept.
* ``jetstream``: ``Orchestrator.Decode`` with ``token_content`` and ``has_bos`` (the ids as
  given); JetStream has no ``ignore_eos`` and no server timings.
* ``openai``: ``POST /v1/completions`` with ``stream: true`` and
  ``stream_options.include_usage``, text prompts; the first token is the first chunk with
  non-empty ``text``; the token count is the usage chunk's ``completion_tokens`` (else the number
  of content chunks). ``ignore_eos`` is sent (a vLLM extension) only when asked.

``server_info(cfg)`` asks a phaseserve port for ``(vocab_size, max_context)``, ``None`` if it
cannot. ``EventStream(resp.content)``: ``async for`` over the JSON objects of an OpenAI
server-sent-event body (the ``openai`` driver's and ``launch.lab.soak``'s streams).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Callable, Protocol

APIS = ("phaseserve", "jetstream", "openai")
REJECTED = frozenset({"RESOURCE_EXHAUSTED", "http_429"})


@dataclasses.dataclass(frozen=True)
class DriverConfig:
  api: str
  target: str
  model: str = ""             # openai: the request's "model"
  api_key: str = ""
  timeout_s: float = 600.0
  ignore_eos: bool = True
  slo_class: str = ""         # phaseserve: the request's slo_class ("" = the server's default)


@dataclasses.dataclass(frozen=True)
class Outcome:
  status: str
  error: str = ""
  sent_s: float = 0.0
  first_s: float | None = None
  end_s: float = 0.0
  output_ids: tuple[int, ...] = ()
  output_text: str = ""
  output_tokens: int = 0
  prompt_tokens: int | None = None
  cached_tokens: int | None = None
  finish_reason: str = ""
  queue_s: float | None = None
  prefill_s: float | None = None
  server_ttft_s: float | None = None
  server_tpot_s: float | None = None
  server_e2e_s: float | None = None


class Driver(Protocol):
  async def generate(self, prompt_ids: tuple[int, ...], prompt_text: str, max_tokens: int,
                     session_id: str, on_first: Callable[[], None] | None = None
                     ) -> Outcome: ...

  async def close(self) -> None: ...


def _meta(cfg: DriverConfig) -> list[tuple[str, str]]:
  return [("authorization", f"Bearer {cfg.api_key}")] if cfg.api_key else []


def _opt(msg, field: str) -> float | None:
  return getattr(msg, field) if msg.HasField(field) else None


class PhaseserveDriver:
  def __init__(self, cfg: DriverConfig):
    import grpc
    from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
    from serving.api.proto.phaseserve.v1 import generation_pb2_grpc as pb_grpc
    self.cfg, self.grpc, self.pb = cfg, grpc, pb
    self.channel = grpc.aio.insecure_channel(cfg.target)
    self.stub = pb_grpc.GenerationStub(self.channel)

  async def generate(self, prompt_ids, prompt_text, max_tokens, session_id,
                     on_first=None) -> Outcome:
    pb = self.pb
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), max_tokens=max_tokens,
                             ignore_eos=self.cfg.ignore_eos, session_id=session_id,
                             slo_class=self.cfg.slo_class)
    req.sampling.temperature = 0.0
    sent = time.monotonic()
    first, ids, text, final = None, [], [], None
    try:
      async for r in self.stub.Generate(req, metadata=_meta(self.cfg),
                                        timeout=self.cfg.timeout_s):
        if r.token_ids and first is None:
          first = time.monotonic()
          if on_first is not None:
            on_first()
        ids.extend(r.token_ids)
        text.append(r.text)
        if r.HasField("final"):
          final = r.final
    except self.grpc.aio.AioRpcError as e:
      return Outcome(e.code().name, e.details() or "", sent, first, time.monotonic(),
                     tuple(ids), "".join(text), len(ids))
    end = time.monotonic()
    if final is None:
      return Outcome("no_final", "the stream ended without a final message", sent, first, end,
                     tuple(ids), "".join(text), len(ids))
    t = final.timings
    return Outcome("ok", "", sent, first, end, tuple(ids), "".join(text), len(ids),
                   final.usage.prompt_tokens, final.usage.cached_tokens,
                   pb.FinishReason.Name(final.finish_reason).lower(), _opt(t, "queue_s"),
                   _opt(t, "prefill_s"), _opt(t, "ttft_s"), _opt(t, "tpot_s"), _opt(t, "e2e_s"))

  async def close(self) -> None:
    await self.channel.close()


class JetstreamDriver:
  def __init__(self, cfg: DriverConfig):
    import grpc
    from serving.api.proto.jetstream import jetstream_pb2 as js
    from serving.api.proto.jetstream import jetstream_pb2_grpc as js_grpc
    self.cfg, self.grpc, self.js = cfg, grpc, js
    self.channel = grpc.aio.insecure_channel(cfg.target)
    self.stub = js_grpc.OrchestratorStub(self.channel)

  async def generate(self, prompt_ids, prompt_text, max_tokens, session_id,
                     on_first=None) -> Outcome:
    js = self.js
    req = js.DecodeRequest(token_content=js.DecodeRequest.TokenContent(token_ids=prompt_ids),
                           max_tokens=max_tokens, has_bos=True)
    sent = time.monotonic()
    first, ids = None, []
    try:
      async for r in self.stub.Decode(req, metadata=_meta(self.cfg), timeout=self.cfg.timeout_s):
        got = r.stream_content.samples[0].token_ids if r.stream_content.samples else ()
        if got and first is None:
          first = time.monotonic()
          if on_first is not None:
            on_first()
        ids.extend(got)
    except self.grpc.aio.AioRpcError as e:
      return Outcome(e.code().name, e.details() or "", sent, first, time.monotonic(),
                     tuple(ids), "", len(ids))
    return Outcome("ok", "", sent, first, time.monotonic(), tuple(ids), "", len(ids))

  async def close(self) -> None:
    await self.channel.close()


class EventStream:
  """``async for obj in EventStream(content)``: the JSON object of each ``data:`` line of a
  server-sent-event body (``content``: an async iterator of lines, aiohttp's ``resp.content``),
  other lines skipped, until ``data: [DONE]`` (then ``done`` is true and nothing after it is
  read) or the body's end. What reading, decoding or ``json.loads`` raises goes to the caller."""

  def __init__(self, content):
    self.content, self.done = content, False

  async def __aiter__(self):
    async for raw in self.content:
      line = raw.decode("utf-8").strip()
      if not line.startswith("data:"):
        continue
      data = line[5:].strip()
      if data == "[DONE]":
        self.done = True
        return
      yield json.loads(data)


class OpenAIDriver:
  def __init__(self, cfg: DriverConfig):
    import aiohttp
    self.cfg, self.aiohttp = cfg, aiohttp
    base = cfg.target if "://" in cfg.target else f"http://{cfg.target}"
    self.url = base.rstrip("/") + "/v1/completions"
    self.session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
        connector=aiohttp.TCPConnector(limit=0))

  async def generate(self, prompt_ids, prompt_text, max_tokens, session_id,
                     on_first=None) -> Outcome:
    body = {"model": self.cfg.model, "prompt": prompt_text, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if self.cfg.ignore_eos:
      body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
    sent = time.monotonic()
    first, text, chunks, usage, finish = None, [], 0, None, ""
    try:
      async with self.session.post(self.url, json=body, headers=headers) as resp:
        if resp.status != 200:
          detail = (await resp.text())[:300]
          return Outcome(f"http_{resp.status}", detail, sent, None, time.monotonic())
        events = EventStream(resp.content)
        async for obj in events:
          if obj.get("error"):
            return Outcome("stream_error", str(obj["error"])[:300], sent, first,
                           time.monotonic(), (), "".join(text), chunks)
          for choice in obj.get("choices") or ():
            piece = choice.get("text") or ""
            if piece:
              if first is None:
                first = time.monotonic()
                if on_first is not None:
                  on_first()
              text.append(piece)
              chunks += 1
            finish = choice.get("finish_reason") or finish
          usage = obj.get("usage") or usage
        done = events.done
    except (self.aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as e:
      return Outcome(type(e).__name__, str(e)[:300], sent, first, time.monotonic(), (),
                     "".join(text), chunks)
    end = time.monotonic()
    if not (done or finish):  # the body ended with neither [DONE] nor a finish reason: cut off
      return Outcome("stream_truncated", "the stream ended before [DONE] or a finish_reason",
                     sent, first, end, (), "".join(text), chunks)
    tokens = int(usage["completion_tokens"]) if usage else chunks
    prompt = int(usage["prompt_tokens"]) if usage else None
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")
              if usage else None)
    return Outcome("ok", "", sent, first, end, (), "".join(text), tokens, prompt, cached, finish)

  async def close(self) -> None:
    await self.session.close()


def make_driver(cfg: DriverConfig) -> Driver:
  if cfg.api == "phaseserve":
    return PhaseserveDriver(cfg)
  if cfg.api == "jetstream":
    return JetstreamDriver(cfg)
  if cfg.api == "openai":
    return OpenAIDriver(cfg)
  raise ValueError(f"api {cfg.api!r} is not one of {APIS}")


def server_info(cfg: DriverConfig, timeout_s: float = 10.0) -> tuple[int, int] | None:
  import grpc
  from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
  from serving.api.proto.phaseserve.v1 import generation_pb2_grpc as pb_grpc
  with grpc.insecure_channel(cfg.target) as ch:
    try:
      info = pb_grpc.GenerationStub(ch).ServerInfo(pb.ServerInfoRequest(), metadata=_meta(cfg),
                                                   timeout=timeout_s)
    except grpc.RpcError:
      return None
  return info.vocab_size, info.max_context
