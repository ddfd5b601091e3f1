"""The soak's requests (``launch.lab.soak``): its clients, its prompts, every request variant and
the check of each answer.

Contract:
  * ``Senders(server, model_name, vocab, max_context, rng, cfg)`` opens the load generator's
    drivers (``launch.lab.loadgen_lib.drivers``) against ``server`` (``.http``, ``.target``):
    ``oai`` (OpenAI), ``ps`` (phaseserve gRPC), ``ps_eos`` (the same with ``ignore_eos``: the
    steady lanes) and ``js`` (JetStream); fits the shared prefix (``prefix_text`` /
    ``prefix_ids``, at most ``cfg["prefix_tokens"]``) and ``cfg["max_tokens"]`` into
    ``max_context`` with the server's ``Tokenize`` (``CliError`` where they cannot fit); and
    lists ``variants``: ``(api, kind, stream, n, make)``, ``make(i)`` a coroutine sending the
    ``i``-th request of that kind (its ids and seeds drawn from ``rng``) and returning a ``Res``.
  * ``await http(path, body, cancel_after=0, read_delay_s=0.0, timeout_s=None)`` (on ``oai``'s
    session), ``await grpc(request, n=1, want_lp=False, cancel_after=0, read_delay_s=0.0)`` (on
    ``ps``'s stub), ``await via(driver, ids, text, max_tokens)`` (a driver's own greedy
    generation): one request each; a failed one is a ``Res.status``, not an exception: ``ok``,
    ``http_<code>``, the gRPC status name, ``stream_error``, ``stream_truncated``,
    ``cancelled_by_client`` (after ``cancel_after`` chunks or tokens), ``bad_response`` (not a
    stop / length finish for each of the ``n`` choices, or logprobs asked for and missing) or
    the class of the client's exception. Times are ``time.monotonic()``; ``read_delay_s``: a
    slow reader's sleep after each message.
  * ``body(chat, i, prefix=False, **fields)``: an OpenAI request body (greedy unless
    ``fields`` say otherwise; usage asked for when streaming); ``ids(n)``: ``n`` random ids.
  * ``await close()`` closes the drivers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Awaitable, Callable

from launch.cli import CliError
from launch.lab.loadgen_lib import drivers

STOPS = ["\n", "e"]  # "e": frequent in any model's text, so stop strings do end requests
OK_FINISH = frozenset({"stop", "length"})


@dataclasses.dataclass
class Res:
  status: str
  error: str = ""
  sent: float = 0.0
  first: float | None = None
  end: float = 0.0
  tokens: int = 0
  cached: int | None = None
  finish: str = ""


def _verdict(finished: dict, missing: str, n: int, lp_ok: bool, sent: float, first: float | None,
             end: float, tokens: int, cached: int | None) -> Res:
  """``ok``, else ``bad_response`` with the first problem: ``finished`` (choice -> finish
  reason) is not choices 0 to ``n - 1`` (``missing`` names them), a reason is not stop / length,
  or logprobs asked for are missing (``not lp_ok``)."""
  reasons = sorted(str(v) for v in finished.values())
  problem = ""
  if sorted(finished) != list(range(n)):
    problem = f"{missing} {sorted(finished)}, expected {n}"
  elif not set(reasons) <= OK_FINISH:
    problem = f"finish reasons {reasons}"
  elif not lp_ok:
    problem = "logprobs missing"
  return Res("bad_response" if problem else "ok", problem, sent, first, end, tokens, cached,
             ",".join(reasons))


class Senders:
  """The soak's clients and every request it sends (see the module's contract)."""

  def __init__(self, server, model_name: str, vocab: int, max_context: int, rng, cfg: dict):
    self.server, self.model, self.vocab, self.max_context = server, model_name, vocab, max_context
    self.rng, self.cfg = rng, cfg
    timeout = cfg["request_timeout_s"]
    dc = lambda api, target, ignore_eos: drivers.DriverConfig(
        api, target, model_name, "", timeout, ignore_eos)
    self.oai = drivers.make_driver(dc("openai", server.http, False))
    self.ps = drivers.make_driver(dc("phaseserve", server.target, False))
    self.ps_eos = drivers.make_driver(dc("phaseserve", server.target, True))  # steady lanes
    self.js = drivers.make_driver(dc("jetstream", server.target, False))
    from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
    self.pb = pb
    self.variants = self._variants()
    self._setup_prompts()

  # ---- prompts

  def _tokenize(self, text: str | None = None, messages=None) -> list[int]:
    import grpc
    from serving.api.proto.phaseserve.v1 import generation_pb2_grpc as pb_grpc
    pb = self.pb
    with grpc.insecure_channel(self.server.target) as ch:
      stub = pb_grpc.GenerationStub(ch)
      if messages is not None:
        req = pb.TokenizeRequest(messages=pb.Messages(messages=[
            pb.ChatMessage(role=r, content=c) for r, c in messages]))
      else:
        req = pb.TokenizeRequest(text=text, add_bos=True)
      return list(stub.Tokenize(req, timeout=30).token_ids)

  def _setup_prompts(self) -> None:
    from launch.lab.loadgen_lib.workload import ids_to_text
    mt = self.cfg["max_tokens"]
    room = self.max_context - mt
    if room < 24:
      raise CliError(f"the server's context ({self.max_context}) leaves too little room for "
                     f"--max_tokens {mt}")
    target = max(8, min(self.cfg["prefix_tokens"], room // 2))
    words = list(range(0, 4 * target))
    text = ids_to_text(words)
    while True:  # the longest prefix of whole words within ``target`` tokens
      ids = self._tokenize(text)
      if len(ids) <= target or len(text.split()) <= 1:
        break
      text = " ".join(text.split()[:max(1, int(len(text.split()) * target / len(ids)) - 1)])
      text = " " + text
    self.prefix_text = "Background:" + text
    self.prefix_ids = self._tokenize(self.prefix_text)
    longest_user = self._question(None)
    for _ in range(20):  # the chat form must fit too (its template adds tokens)
      chat = self._tokenize(messages=[("system", self.prefix_text), ("user", longest_user)])
      plain = self._tokenize(self.prefix_text + " " + longest_user)
      if max(len(chat), len(plain)) + mt + 4 <= self.max_context:  # 4: tokenizer merges
        break
      words = self.prefix_text.split()
      self.prefix_text = " ".join(words[:max(1, int(len(words) * 0.8))])
      self.prefix_ids = self._tokenize(self.prefix_text)
    else:
      raise CliError("cannot fit the shared prefix in the server's context")
    if len(self._tokenize(messages=[("user", longest_user)])) + mt > self.max_context:
      raise CliError(f"--max_tokens {mt} does not fit the server's context ({self.max_context})")

  @staticmethod
  def _question(i: int | None) -> str:
    """A short question, distinct per ``i``; ``None``: the longest one (for the fit checks)."""
    from launch.lab.loadgen_lib.workload import WORDS, ids_to_text
    if i is None:
      return "Request 999999:" + (" " + max(WORDS, key=len)) * 4 + "?"
    return f"Request {i % 10**6}:" + ids_to_text([i, i * 7 + 3, i * 13 + 5, i * 31 + 1]) + "?"

  def ids(self, n: int) -> tuple[int, ...]:
    lo = min(100, self.vocab // 4)
    return tuple(int(x) for x in self.rng.integers(lo, self.vocab, n))

  def _seed(self) -> int:
    return int(self.rng.integers(0, 2**31))

  # ---- HTTP

  async def http(self, path: str, body: dict, *, cancel_after: int = 0, read_delay_s: float = 0.0,
                 timeout_s: float | None = None) -> Res:
    """One OpenAI request on the load generator's HTTP session; checks the answer's shape."""
    import aiohttp
    session = self.oai.session
    chat = path.endswith("chat/completions")
    stream = bool(body.get("stream"))
    n = body.get("n") or 1
    want_lp = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
    sent = time.monotonic()
    first, tokens, chunks, finish, usage, lp_ok = None, 0, 0, {}, None, True
    timeout = aiohttp.ClientTimeout(total=timeout_s or self.cfg["request_timeout_s"])
    try:
      async with session.post(self.server.http + path, json=body, timeout=timeout) as resp:
        if resp.status != 200:
          return Res(f"http_{resp.status}", (await resp.text())[:300], sent, None,
                     time.monotonic())
        if not stream:
          obj = await resp.json()
          end = time.monotonic()
          choices = obj.get("choices") or []
          finish = {c.get("index"): c.get("finish_reason") for c in choices}
          lp_ok = not want_lp or all(c.get("logprobs") for c in choices)
          usage = obj.get("usage") or {}
          tokens = int(usage.get("completion_tokens") or 0)
        else:
          events = drivers.EventStream(resp.content)
          async for obj in events:
            if obj.get("error"):
              return Res("stream_error", str(obj["error"])[:300], sent, first, time.monotonic(),
                         chunks)
            for c in obj.get("choices") or ():
              piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
              if piece or c.get("logprobs"):
                first = first or time.monotonic()
                chunks += 1
                if want_lp and not c.get("logprobs"):
                  lp_ok = False
              if c.get("finish_reason"):
                finish[c.get("index")] = c["finish_reason"]
            usage = obj.get("usage") or usage
            if cancel_after and chunks >= cancel_after:
              resp.close()  # the client goes away mid-stream
              return Res("cancelled_by_client", "", sent, first, time.monotonic(), chunks)
            if read_delay_s:
              await asyncio.sleep(read_delay_s)
          end = time.monotonic()
          if not events.done:
            return Res("stream_truncated", "the stream ended before [DONE]", sent, first, end,
                       chunks)
          tokens = int(usage["completion_tokens"]) if usage else chunks
    except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as e:
      return Res(type(e).__name__, str(e)[:300], sent, first, time.monotonic(), chunks)
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return _verdict(finish, "finish reasons for choices", n, lp_ok, sent, first, end, tokens,
                    cached)

  def body(self, chat: bool, i: int, prefix: bool = False, **kw) -> dict:
    q = self._question(i)
    mt = self.cfg["max_tokens"]
    if chat:
      msgs = ([{"role": "system", "content": self.prefix_text}] if prefix else []) + \
          [{"role": "user", "content": q}]
      body = {"model": self.model, "messages": msgs, "max_tokens": mt}
    else:
      body = {"model": self.model, "prompt": (self.prefix_text + " " + q) if prefix else q,
              "max_tokens": mt}
    body.setdefault("temperature", 0)
    body.update(kw)
    if body.get("stream"):
      body["stream_options"] = {"include_usage": True}
    return body

  # ---- gRPC

  async def grpc(self, req, *, n: int = 1, want_lp: bool = False, cancel_after: int = 0,
                 read_delay_s: float = 0.0) -> Res:
    import grpc
    pb = self.pb
    sent = time.monotonic()
    first, tokens, finals, cached, lp_ok = None, 0, {}, None, True
    call = self.ps.stub.Generate(req, timeout=self.cfg["request_timeout_s"])
    try:
      async for r in call:
        if r.token_ids:
          first = first or time.monotonic()
          tokens += len(r.token_ids)
          if want_lp and len(r.logprobs) != len(r.token_ids):
            lp_ok = False
        if r.HasField("final"):
          finals[r.index] = pb.FinishReason.Name(r.final.finish_reason).lower()
          if r.index == 0:
            cached = r.final.usage.cached_tokens
        if cancel_after and tokens >= cancel_after:
          call.cancel()
          return Res("cancelled_by_client", "", sent, first, time.monotonic(), tokens)
        if read_delay_s:
          await asyncio.sleep(read_delay_s)
    except grpc.aio.AioRpcError as e:
      return Res(e.code().name, e.details() or "", sent, first, time.monotonic(), tokens)
    return _verdict(finals, "final messages for samples", n, lp_ok, sent, first, time.monotonic(),
                    tokens, cached)

  def _greq(self, i: int, *, prefix: bool = False, text: bool = False, **kw):
    pb = self.pb
    mt = self.cfg["max_tokens"]
    sampling = kw.pop("sampling", None)
    if prefix:
      req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=self.prefix_ids + list(self.ids(8))),
                               max_tokens=mt, **kw)
    elif text:
      req = pb.GenerateRequest(text=self._question(i), max_tokens=mt, **kw)
    else:
      req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=self.ids(16)), max_tokens=mt, **kw)
    if sampling:
      for k, v in sampling.items():
        setattr(req.sampling, k, v)
    return req

  # ---- driver calls (the load generator's own clients)

  @staticmethod
  def _from_outcome(o) -> Res:
    return Res(o.status, o.error, o.sent_s, o.first_s, o.end_s, o.output_tokens, o.cached_tokens,
               o.finish_reason)

  async def via(self, driver, ids, text, max_tokens) -> Res:
    return self._from_outcome(await driver.generate(ids, text, max_tokens, ""))

  # ---- the variants: (api, kind, stream, n, factory(i) -> coroutine)

  def _variants(self):
    C, H = "/v1/completions", "/v1/chat/completions"
    mt = lambda: self.cfg["max_tokens"]
    slow = lambda: self.cfg["slow_read_s"]
    s = lambda: self._seed()
    sampled = lambda: dict(temperature=0.8, top_k=20, top_p=0.9, seed=s())
    v: list[tuple[str, str, bool, int, Callable[[int], Awaitable[Res]]]] = []
    for chat, api, path in ((False, "openai_completions", C), (True, "openai_chat", H)):
      b = lambda i, chat=chat, **kw: self.body(chat, i, **kw)
      if chat:
        v.append((api, "stream_greedy", True, 1,
                  lambda i, p=path, b=b: self.http(p, b(i, stream=True))))
      else:  # the load generator's own OpenAI driver
        v.append((api, "stream_greedy", True, 1,
                  lambda i: self.via(self.oai, (), self._question(i), mt())))
      v += [
          (api, "nostream_greedy", False, 1, lambda i, p=path, b=b: self.http(p, b(i))),
          (api, "stream_n3_seed", True, 3, lambda i, p=path, b=b: self.http(
              p, b(i, stream=True, n=3, temperature=1.0, seed=s()))),
          (api, "nostream_n3_seed", False, 3, lambda i, p=path, b=b: self.http(
              p, b(i, n=3, temperature=1.0, seed=s()))),
          (api, "stop_stream", True, 1, lambda i, p=path, b=b: self.http(
              p, b(i, stream=True, stop=STOPS))),
          (api, "topk_topp_stream", True, 1, lambda i, p=path, b=b: self.http(
              p, b(i, stream=True, **sampled()))),
          (api, "prefix_stream", True, 1, lambda i, p=path, b=b: self.http(
              p, b(i, prefix=True, stream=True))),
          (api, "prefix_nostream", False, 1, lambda i, p=path, b=b: self.http(
              p, b(i, prefix=True))),
          (api, "cancel_stream", True, 1, lambda i, p=path, b=b: self.http(
              p, b(i, stream=True), cancel_after=3)),
          (api, "slow_reader_stream", True, 1, lambda i, p=path, b=b: self.http(
              p, b(i, stream=True), read_delay_s=slow())),
          (api, "json_object_stream", True, 1, lambda i, p=path, b=b: self.http(
              p, b(i, stream=True, response_format={"type": "json_object"}, **sampled()))),
          (api, "penalties_min_p", False, 1, lambda i, p=path, b=b: self.http(
              p, b(i, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                   logit_bias={"13": -5}, min_p=0.05, **sampled()))),
      ]
      if chat:
        v += [
            (api, "logprobs_top3", False, 1, lambda i, p=path, b=b: self.http(
                p, b(i, logprobs=True, top_logprobs=3))),
            (api, "logprobs_top3_stream", True, 1, lambda i, p=path, b=b: self.http(
                p, b(i, stream=True, logprobs=True, top_logprobs=3))),
        ]
      else:
        v += [
            (api, "logprobs0", False, 1, lambda i, p=path, b=b: self.http(p, b(i, logprobs=0))),
            (api, "logprobs5_stream", True, 1, lambda i, p=path, b=b: self.http(
                p, b(i, stream=True, logprobs=5))),
        ]
    api = "phaseserve_grpc"
    v += [
        (api, "generate_greedy", True, 1,  # the load generator's own gRPC driver
         lambda i: self.via(self.ps, self.ids(16), "", mt())),
        (api, "text_n3_seed_logprobs", True, 3, lambda i: self.grpc(
            self._greq(i, text=True, n=3, logprobs=2, sampling=dict(temperature=1.0, seed=s())),
            n=3, want_lp=True)),
        (api, "stop_topk_topp", True, 1, lambda i: self.grpc(
            self._greq(i, text=True, stop=STOPS, sampling=dict(temperature=0.8, top_k=20,
                                                               top_p=0.9, seed=s())))),
        (api, "prefix", True, 1, lambda i: self.grpc(self._greq(i, prefix=True))),
        (api, "cancel", True, 1, lambda i: self.grpc(self._greq(i), cancel_after=3)),
        (api, "slow_reader", True, 1, lambda i: self.grpc(self._greq(i), read_delay_s=slow())),
        ("jetstream", "decode", True, 1,  # the load generator's own JetStream driver
         lambda i: self.via(self.js, self.ids(16), "", mt())),
    ]
    return v

  async def close(self) -> None:
    for d in (self.oai, self.ps, self.ps_eos, self.js):
      try:
        await d.close()
      except Exception:  # closing after a dead server
        pass

