"""The OpenAI-compatible HTTP server: aiohttp on its own asyncio loop thread, over the Frontend.

Contract: ``serve(frontend, keys, registry, HttpOptions) -> RunningHttp`` binds ``host:port``
(0: any free port; ``RunningHttp.port`` is the bound one; HTTPS with ``tls_cert`` / ``tls_key``)
and serves over the same ``serving.api.frontend.Frontend`` as the gRPC service (same validation,
quotas, early rejection, drain, usage and metrics); ``RunningHttp.stop(timeout)`` closes it.
Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (Bearer key, bounded body, parsed
by ``serving.api.http_api``, shaped by ``serving.api.http_response``; JSON, or server-sent events
with ``stream: true``; the ``X-Ignored-Fields`` header names fields accepted and ignored), ``GET
/v1/models`` (with the LoRA adapters; each also without ``/v1``), ``POST /tokenize`` and
``/detokenize``
(``serving.api.http_tokens``), ``GET /version``, ``/health`` (liveness), ``/ready`` (readiness),
``/metrics``, ``/v1/loads`` (the replica's load for a router: ``serving.api.loads``); with
``kv_role`` "prefill", ``POST /v1/kv/pages`` and a ``kv_transfer_params`` handoff in every
non-streamed answer, with "decode", a request's handoff pulled before admission
(``serving.api.http_kv``); with
``lora_admin``, ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` for admin keys
(``serving.api.http_lora``). Errors are OpenAI's JSON shape (``http_errors.ApiError``); an
unexpected exception is a logged 500.
``Frontend.generate`` runs in an elastic thread pool (``serving.api.thread_pool``: idle threads
end); streams hold no thread (the loop thread wakes the
event loop, the handler polls one output per write, so unread outputs stay in the Stream's bounded
buffer; one step's wake-ups are one ``serving.api.wakeups`` batch). A client that closes the
connection cancels every sample it still has running.
The route-by-route behaviour: docs/http_api.md and BUILD_NOTES "Design: The API".
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import ssl
import threading
import time
from typing import Any, AsyncGenerator, Sequence

import prometheus_client as prom
from aiohttp import web

from serving.api import (http_api, http_errors, http_kv, http_lora, http_response, http_tokens,
                         loads)
from serving.api.auth import ApiKeys, KeyInfo, Unauthenticated
from models.text.tokenizer import Tokenizer
from serving.api.frontend import Frontend
from serving.api.validation import GenerateArgs
from serving.api.thread_pool import ElasticThreadPool
from serving.api.stream import ServiceError, Status, Stream
from serving.api.wakeups import Wakeups
from serving.api.http_errors import ApiError
from serving.request import RequestOutput
from serving.stop import FinishReason

_log = logging.getLogger(__name__)
_DONE = b"data: [DONE]\n\n"
_OK_FINISH = (FinishReason.STOP, FinishReason.LENGTH)


@dataclasses.dataclass(frozen=True)
class HttpOptions:
  model: str  # the served model's id (``model`` in requests, ``GET /v1/models``)
  host: str = "127.0.0.1"
  port: int = 0
  max_body_bytes: int = 4 << 20
  max_concurrent: int = 512  # threads for Frontend.generate calls (admission; streams hold none)
  max_context: int = 0  # reported by /v1/models
  defaults: http_api.SamplingDefaults = http_api.SamplingDefaults()  # for fields left out
  version: str = "dev"  # /version and the responses' system_fingerprint
  shutdown_s: float = 2.0
  tls_cert: str | None = None  # PEM files: HTTPS (the gRPC port's certificate and key)
  tls_key: str | None = None
  lora_admin: bool = False  # the adapter load / unload routes (admin keys only)
  kv_role: str = "none"  # "prefill" / "decode": one side of a KV handoff (serving.api.http_kv)
  kv_url: str = ""  # a prefill server's HTTP base for decode servers ("": as requests reach it)


def _echo_text(args: GenerateArgs, stream: Stream, tok: Tokenizer) -> str:
  """The prompt as ``echo`` repeats it: the text given, else the prompt's ids decoded."""
  if isinstance(args.text, str) and args.truncate_prompt_tokens is None:
    return args.text
  return tok.decode(stream.validated.prompt_ids)


def _cancel_admitted(fut: asyncio.Future) -> None:
  if not fut.cancelled() and fut.exception() is None:
    fut.result().cancel(Status.CANCELLED, "the client closed the connection")


def _sse(obj: Any) -> bytes:
  return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


def _error_response(e: ApiError) -> web.Response:
  return web.json_response(e.body(), status=e.status, headers=e.headers)


class _Api:
  def __init__(self, frontend: Frontend, keys: ApiKeys, registry: prom.CollectorRegistry,
               options: HttpOptions):
    self.frontend = frontend
    self.keys = keys
    self.registry = registry
    self.options = options
    self.created = int(time.time())
    # Threads follow the calls in flight and idle ones end (as gRPC's; BUILD_NOTES "Staying in
    # service"): a ThreadPoolExecutor keeps its peak for good.
    self.pool = ElasticThreadPool(options.max_concurrent + 8, name="http")
    self._wakeups_by_loop: dict[asyncio.AbstractEventLoop, Wakeups] = {}
    self.served = http_api.Served(options.model, options.defaults, frontend.loras)
    self.fingerprint = "fp_" + hashlib.sha256(
        f"{options.model}/{options.version}".encode()).hexdigest()[:10]
    self._kv_source = http_kv.HttpKvSource()

  def _wakeups(self, loop: asyncio.AbstractEventLoop) -> Wakeups:
    """The loop's coalesced wake-ups: a step's outputs to many streams wake it once."""
    w = self._wakeups_by_loop.get(loop)
    if w is None:
      w = self._wakeups_by_loop[loop] = Wakeups(loop)
    return w

  # -- plumbing -------------------------------------------------------------------------------

  @web.middleware
  async def errors(self, request: web.Request, handler) -> web.StreamResponse:
    try:
      return await handler(request)
    except ApiError as e:
      return _error_response(e)
    except web.HTTPRequestEntityTooLarge:
      return _error_response(ApiError(413, f"the request body is larger than "
                                      f"{self.options.max_body_bytes} bytes"))
    except web.HTTPException as e:
      if e.status < 400:
        raise
      return _error_response(ApiError(e.status, e.reason or "error",
                                      "not_found_error" if e.status == 404 else
                                      "invalid_request_error"))
    except (asyncio.CancelledError, ConnectionResetError):
      raise
    except Exception as e:  # a bug: logged, answered in the API's shape
      _log.exception("HTTP handler failed")
      return _error_response(ApiError(500, f"internal error: {type(e).__name__}",
                                      "server_error"))

  def authenticate(self, request: web.Request) -> KeyInfo:
    auth = request.headers.get("Authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
    try:
      return self.keys.authenticate(key)
    except Unauthenticated as e:
      self.frontend.metrics.rejections.labels(reason="unauthenticated").inc()
      msg = str(e).replace("metadata 'authorization", "header 'Authorization")
      raise ApiError(401, msg, "authentication_error", code="invalid_api_key") from None

  async def body(self, request: web.Request) -> Any:
    limit = self.options.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
      raise ApiError(413, f"the request body is larger than {limit} bytes")
    data = await request.read()  # aiohttp refuses more than client_max_size (413 above)
    return http_errors.decode_body(data)

  async def call(self, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

  # -- generation -----------------------------------------------------------------------------

  async def admit(self, parsed: http_api.Parsed, key: KeyInfo,
                  request: web.Request) -> list[Stream]:
    rid = request.headers.get("X-Request-Id", "")[:256]
    streams: list[Stream] = []
    loop = asyncio.get_running_loop()
    try:
      for args in parsed.prompts:
        fut = loop.run_in_executor(self.pool, self.frontend.generate, args, key, rid, "openai",
                                   dict(parsed.field_names), parsed.user)
        try:
          streams.append(await asyncio.shield(fut))
        except asyncio.CancelledError:  # the client left while it was being admitted
          fut.add_done_callback(_cancel_admitted)
          raise
    except ServiceError as e:
      for s in streams:  # one prompt of a batch was refused: so is the whole request
        s.cancel(Status.CANCELLED, "another prompt of the request was refused")
      raise http_errors.api_error(e) from None
    except BaseException:
      for s in streams:
        s.cancel(Status.CANCELLED, "cancelled by the client")
      raise
    return streams

  async def events(self, streams: Sequence[Stream]
                   ) -> AsyncGenerator[tuple[int, int, RequestOutput], None]:
    """(prompt, sample, output) from every stream as they come; ServiceError at a failure."""
    ready = asyncio.Event()
    wakeups = self._wakeups(asyncio.get_running_loop())
    def wake() -> None:
      wakeups.wake(ready)
    for s in streams:
      s.on_ready(wake)
    live = list(range(len(streams)))
    try:
      while live:
        ready.clear()  # before polling: a push after this sets it again, none is missed
        got = False
        for p in list(live):
          item = streams[p].poll()  # raises the stream's ServiceError
          if item is Stream.END:
            live.remove(p)
          elif item is not None:
            got = True
            yield p, item[0], item[1]  # type: ignore[index]  # poll() is typed `| object` (END)
        if live and not got:
          await ready.wait()
    finally:
      for s in streams:
        s.off_ready(wake)

  async def generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
    key = self.authenticate(request)
    body = await self.body(request)
    served = self.served
    parsed = http_api.parse_chat(body, served) if chat else \
        http_api.parse_completion(body, served)
    if self.options.kv_role == "decode" and isinstance(body, dict) and \
        "kv_transfer_params" in body:  # the prompt's pages from the prefill server
      await self.call(http_kv.pull, self.frontend.loop, self._kv_source, body,
                      request.headers.get("Authorization", ""))
    streams = await self.admit(parsed, key, request)
    tok = self.frontend.tokenizer
    shape = http_response.Response(parsed, parsed.prompts[0].lora or served.model,
                                   streams[0].request_id, tok, [
        http_response.PromptInfo(len(s.validated.prompt_ids), _echo_text(a, s, tok)
                                 if parsed.echo else "")
        for a, s in zip(parsed.prompts, streams)], self.fingerprint)
    headers = {"X-Ignored-Fields": ", ".join(parsed.ignored)} if parsed.ignored else {}
    try:
      if parsed.stream:
        try:
          return await self._stream(request, parsed, shape, streams, headers)
        except ConnectionResetError:  # the client went away mid-stream: a normal event
          _log.info("request %s: the client closed its stream", streams[0].request_id)
          return web.Response(status=499)  # nobody reads it (nginx's "client closed request")
      try:
        async for p, i, out in self.events(streams):
          shape.add(shape.choice(p, i), out)
      except ServiceError as e:
        raise http_errors.api_error(e) from None
      answer = shape.body(streams)
      if self.options.kv_role == "prefill":  # where the decode server fetches the pages
        url = self.options.kv_url or f"{request.scheme}://{request.host}"
        answer["kv_transfer_params"] = http_kv.handoff(url, streams[0].validated.prompt_ids)
      return web.json_response(answer, headers=headers, dumps=lambda o: json.dumps(
          o, ensure_ascii=False))
    finally:
      for s in streams:  # the client went away (handler cancelled, reset on write)
        if not s.ended:
          s.cancel(Status.CANCELLED, "the client closed the connection")

  async def _stream(self, request: web.Request, parsed: http_api.Parsed,
                    shape: http_response.Response, streams: list[Stream],
                    headers: dict[str, str]) -> web.StreamResponse:
    events = self.events(streams)
    resp: web.StreamResponse | None = None
    held: list[dict[str, Any]] = []  # empty endings other than stop / length, before any event

    async def start() -> web.StreamResponse:
      r = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                      "Cache-Control": "no-cache", **headers})
      await r.prepare(request)
      if parsed.chat:
        for choice in range(len(streams) * parsed.n):
          await r.write(_sse(shape.role_chunk(choice)))
      return r

    try:
      async for p, i, out in events:
        obj = shape.chunk(shape.choice(p, i), out)
        if obj is None:
          continue
        if resp is None and out.finished and not out.text and \
            out.finish_reason not in _OK_FINISH:
          held.append(obj)  # a failed sample: the stream's error (a plain HTTP one) follows
          continue
        if resp is None:  # headers go with the first event: earlier failures are HTTP errors
          resp = await start()
        await resp.write(_sse(obj))
    except ServiceError as e:
      err = http_errors.api_error(e)
      if resp is None:
        raise err from None
      await resp.write(_sse(err.body()))
      await resp.write(_DONE)
      await resp.write_eof()
      return resp
    finally:
      await events.aclose()
    if resp is None:  # nothing but empty outputs (e.g. every sample stopped at once)
      resp = await start()
    for obj in held:
      await resp.write(_sse(obj))
    if parsed.include_usage:
      await resp.write(_sse(shape.usage_chunk(streams)))
    await resp.write(_DONE)
    await resp.write_eof()
    return resp

  async def completions(self, request: web.Request) -> web.StreamResponse:
    return await self.generate(request, chat=False)

  async def chat_completions(self, request: web.Request) -> web.StreamResponse:
    return await self.generate(request, chat=True)

  # -- the rest -------------------------------------------------------------------------------

  def _model(self) -> dict[str, Any]:
    return {"id": self.options.model, "object": "model", "created": self.created,
            "owned_by": "phaseserve", "max_model_len": self.options.max_context}

  def _models(self) -> list[dict[str, Any]]:
    return [self._model()] + http_lora.cards(self._model(), self.frontend.loras)

  async def models(self, request: web.Request) -> web.Response:
    self.authenticate(request)
    return web.json_response({"object": "list", "data": self._models()})

  async def model(self, request: web.Request) -> web.Response:
    self.authenticate(request)
    name = request.match_info["name"]
    for card in self._models():
      if card["id"] == name:
        return web.json_response(card)
    raise ApiError(404, f"The model {name!r} does not exist", param="model",
                   code="model_not_found")

  async def lora_admin(self, request: web.Request) -> web.Response:
    """Adapter load / unload: an admin key's, on a server that serves adapters."""
    key = self.authenticate(request)
    if not key.admin:
      raise ApiError(403, "loading or unloading LoRA adapters needs an admin API key",
                     "permission_error")
    body = await self.body(request)
    loras = self.frontend.loras
    if loras is None or not isinstance(body, dict):
      raise ApiError(400, "this server serves no LoRA adapters (start it with --max_loras)"
                     if loras is None else "the body must be a JSON object")
    fn = http_lora.load if request.path.endswith("/load_lora_adapter") else http_lora.unload
    return web.Response(text=await self.call(fn, body, loras))

  async def health(self, request: web.Request) -> web.Response:
    state = self.frontend.state
    return web.json_response({"status": state}, status=503 if state == "failed" else 200)

  async def ready(self, request: web.Request) -> web.Response:
    state = self.frontend.state
    return web.json_response({"status": state}, status=200 if state == "serving" else 503)

  async def tokenize(self, request: web.Request) -> web.Response:
    self.authenticate(request)
    body = await self.body(request)
    return web.json_response(await self.call(
        http_tokens.tokenize, body, self.served, self.frontend.tokenizer,
        self.frontend.config.limits))

  async def detokenize(self, request: web.Request) -> web.Response:
    self.authenticate(request)
    body = await self.body(request)
    return web.json_response(http_tokens.detokenize(body, self.served, self.frontend.tokenizer),
                             dumps=lambda o: json.dumps(o, ensure_ascii=False))

  async def version(self, request: web.Request) -> web.Response:
    return web.json_response({"version": self.options.version})

  async def loads(self, request: web.Request) -> web.Response:
    loop = self.frontend.loop
    return web.json_response(loads.load_report(loop.occupancy(), loop.capacity(), time.time()))

  async def kv_pages(self, request: web.Request) -> web.Response:
    self.authenticate(request)  # the pages say what prompts were computed: keys, as every route
    body = await self.body(request)
    try:
      data = await self.call(http_kv.export, self.frontend.loop, body)
    except ValueError as e:
      raise http_errors.ApiError(400, str(e), "invalid_request_error") from None
    if data is None:
      raise http_errors.ApiError(404, "no KV pages held for this prompt", "not_found_error")
    return web.Response(body=data, content_type="application/octet-stream")

  async def metrics(self, request: web.Request) -> web.Response:
    data = await self.call(prom.generate_latest, self.registry)
    return web.Response(body=data, headers={"Content-Type": prom.CONTENT_TYPE_LATEST})

  def app(self) -> web.Application:
    app = web.Application(middlewares=[self.errors],
                          client_max_size=self.options.max_body_bytes)
    for prefix in ("/v1", ""):  # llama.cpp's server (and some clients) leave out /v1
      app.add_routes([web.post(f"{prefix}/completions", self.completions),
                      web.post(f"{prefix}/chat/completions", self.chat_completions),
                      web.get(f"{prefix}/models", self.models),
                      web.get(prefix + "/models/{name:.+}", self.model)])  # ids may hold "/"
      if self.options.lora_admin:
        app.add_routes([web.post(f"{prefix}/load_lora_adapter", self.lora_admin),
                        web.post(f"{prefix}/unload_lora_adapter", self.lora_admin)])
    if self.options.kv_role == "prefill":
      app.add_routes([web.post("/v1/kv/pages", self.kv_pages)])
    app.add_routes([web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize),
                    web.get("/version", self.version),
                    web.get("/health", self.health), web.get("/ready", self.ready),
                    web.get("/metrics", self.metrics), web.get("/v1/loads", self.loads)])
    return app


class RunningHttp:
  def __init__(self, api: _Api):
    self._api = api
    self._loop = asyncio.new_event_loop()
    self._runner: web.AppRunner | None = None
    self._started = threading.Event()
    self._error: BaseException | None = None
    self.port = 0
    self._thread = threading.Thread(target=self._run, daemon=True, name="phaseserve-http")

  def _run(self) -> None:
    asyncio.set_event_loop(self._loop)
    try:
      opts = self._api.options
      self._runner = web.AppRunner(self._api.app(), handler_cancellation=True, access_log=None,
                                   shutdown_timeout=opts.shutdown_s)
      self._loop.run_until_complete(self._runner.setup())
      ctx = None
      if opts.tls_cert or opts.tls_key:
        if not (opts.tls_cert and opts.tls_key):
          raise ValueError("TLS needs both a certificate and a key")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(opts.tls_cert, opts.tls_key)
      site = web.TCPSite(self._runner, opts.host, opts.port, reuse_port=False,
                         ssl_context=ctx)
      self._loop.run_until_complete(site.start())
      self.port = self._runner.addresses[0][1]
    except BaseException as e:  # reported to serve()'s caller
      self._error = e
      self._started.set()
      return
    self._started.set()
    self._loop.run_forever()

  def start(self) -> "RunningHttp":
    self._thread.start()
    self._started.wait()
    if self._error is not None:
      raise OSError(f"cannot serve HTTP on {self._api.options.host}:{self._api.options.port}: "
                    f"{self._error}")
    return self

  def stop(self, timeout: float = 5.0) -> None:
    if self._runner is not None and self._thread.is_alive():
      try:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout)
      except Exception:  # closing anyway
        _log.warning("HTTP server did not close cleanly", exc_info=True)
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join(timeout)
    self._api.pool.shutdown(wait=False, cancel_futures=True)


def serve(frontend: Frontend, keys: ApiKeys, registry: prom.CollectorRegistry,
          options: HttpOptions) -> RunningHttp:
  return RunningHttp(_Api(frontend, keys, registry, options)).start()
