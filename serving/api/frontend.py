"""The protocol-neutral service: admission, streams, usage, drain and health over one ServingLoop.

Contract: ``Frontend(loop, tokenizer, FrontendConfig, registry, usage_log, faults=None)`` is what
every wire API calls; they only translate messages and statuses. It reads the loop only through
its read-only face (``capacity``, ``occupancy``, ``cached_prefix_tokens``, ...).
  * ``generate(args, key, client_request_id, api) -> Stream`` checks in order the state
    (``UNAVAILABLE`` unless serving), the request (``INVALID_ARGUMENT``; an adapter ``loras``
    does not hold: ``NOT_FOUND``, reason ``model_not_found``), the KV budget, the queue
    bound, the key's quota and the predicted SLO miss (``serving.api.admission``; early rejection
    never on an idle server), then submits its ``n`` samples (seeds ``seed + i``; with the prefix
    cache samples 1..n-1 wait for sample 0's prefill). A refused request gets its usage record.
  * ``Stream.events()`` / ``poll()`` / ``on_ready(fn)`` read a bounded buffer (past
    ``stream_buffer_bytes`` or ``stream_stall_s`` the request is cancelled); every request ends
    once on one path (``end``): usage record, metrics, quota, by one usage rule.
  * ``state``: ``loading`` -> ``serving`` -> ``draining`` | ``failed`` (``on_state`` listeners);
    ``drain(grace_s)``; a watchdog fails every live stream when the loop stops going round for
    ``watchdog_s`` or is dead. ``prediction_error()``: predicted vs actual TTFT.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import secrets
import threading
import time
from typing import Callable, Sequence

import prometheus_client as prom

from models.text.tokenizer import Tokenizer
from serving.api import admission, loads
from serving.api.admission import SloClass
from serving.api.auth import KeyInfo, OverQuota, Quotas
from serving.api.faults import FaultInjector
from serving.kv_pages import ring_entries
from serving.lifecycle import RequestTrace
from serving.loop import ServingLoop
from serving.lora import LoraRef, LoraRegistry
from serving.request import Request, RequestOutput
from serving.api.service_metrics import LiveGauges, ServiceMetrics
from serving.api.stream import ServiceError, Status, Stream, StreamOwner
from serving.api.usage import UsageLog
from serving.api.validation import GenerateArgs, InvalidArgument, Limits, validate
from serving.grammar import GrammarCompiler

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FrontendConfig:
  limits: Limits
  slo_classes: tuple[SloClass, ...] = admission.MLPERF_CLASSES
  slo_scale: float = 1.0  # multiplies every SLO target (small machines)
  early_reject: bool = True
  max_queue: int = 256  # requests waiting for their first prefill chunk
  stream_buffer_bytes: int = 1 << 20
  stream_stall_s: float = 30.0
  watchdog_s: float = 60.0


class Frontend(StreamOwner):
  def __init__(self, loop: ServingLoop, tokenizer: Tokenizer, config: FrontendConfig,
               registry: prom.CollectorRegistry, usage: UsageLog | None = None, *,
               faults: FaultInjector | None = None, grammars: GrammarCompiler | None = None,
               loras: LoraRegistry | None = None):
    self.loop = loop
    self.loras = loras  # the LoRA adapters served (None: none)
    self.grammars = grammars  # structured outputs (None: refused with a 400)
    self.tokenizer = tokenizer
    self.config = config
    self.usage = usage or UsageLog(None)
    self.quotas = Quotas()
    self.classes = {c.name: c for c in config.slo_classes}
    if set(self.classes) != set(config.limits.slo_classes):
      raise ValueError("FrontendConfig: limits.slo_classes must name the SLO classes")
    self.state = "loading"
    self._listeners: list[Callable[[str], None]] = []
    self._lock = threading.Lock()
    self._live: dict[str, Stream] = {}
    self._backlog = 0
    self._held = 0  # samples held back for a sibling's prefill (Stream._deferred), not yet queued
    self._ids = itertools.count()
    self._prefix = secrets.token_hex(3)
    self._hurry = threading.Event()
    self._watchdog: threading.Thread | None = None
    self._stop_watchdog = threading.Event()
    self.faults = faults  # test-only: client_request_id "fault:..." arms it
    self.predictions: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)
    # Read through the loop's views at each use: the loop may rebuild its scheduler.
    cap = loop.capacity()
    self.metrics = ServiceMetrics(registry, LiveGauges(
        waiting=lambda: (lambda o: o.waiting + o.arriving)(loop.occupancy()),
        running=lambda: loop.occupancy().running,
        kv_usage=lambda: loads.token_usage(loop.occupancy(), cap),
        slots_used_fraction=lambda: loop.occupancy().running / cap.max_slots,
        live_streams=lambda: len(self._live), engine_faults=lambda: loop.faults))
    if cap.prefix_cache:
      self.metrics.host_tier_bytes.set_function(
          lambda: loop.occupancy().host_tier_pages_used * cap.bytes_per_page)

  # -- state ----------------------------------------------------------------------------------

  def on_state(self, fn: Callable[[str], None]) -> None:
    self._listeners.append(fn)
    fn(self.state)

  def set_state(self, state: str) -> None:
    with self._lock:
      if self.state == state or (self.state == "failed" and state != "failed"):
        return
      self.state = state
    _log.warning("service state: %s", state)
    for fn in self._listeners:
      fn(state)

  @property
  def live(self) -> int:
    return len(self._live)

  # -- admission ------------------------------------------------------------------------------

  def _refuse(self, status: Status, reason: str, message: str, key: KeyInfo,
              client_request_id: str, api: str, slo: str = "", prompt_tokens: int = 0,
              user: str = "") -> None:
    self.metrics.rejections.labels(reason=reason).inc()
    self.metrics.requests.labels(status=status.value, finish_reason="", slo_class=slo).inc()
    self.loop.guard.call("usage", self.usage.write, {"request_id": "", "client_request_id": client_request_id,
                      "api_key": key.name, "api": api, "slo_class": slo, "status": status.value,
                      "message": message, "prompt_tokens": prompt_tokens, "cached_tokens": 0,
                      "completion_tokens": 0, "finish_reason": [],
                      **({"user": user} if user else {})})
    raise ServiceError(status, message, reason)

  def generate(self, args: GenerateArgs, key: KeyInfo, client_request_id: str = "",
               api: str = "phaseserve", field_names: dict[str, str] | None = None,
               user: str = "") -> Stream:
    """``user``: the caller's end-user id (OpenAI's ``user``), kept in the usage record."""
    refuse = functools.partial(self._refuse, user=user)
    if self.state != "serving":
      why = {"loading": "the server is loading and warming up",
             "draining": "the server is shutting down"}.get(self.state, "the engine is down")
      refuse(Status.UNAVAILABLE, "unavailable", why, key, client_request_id, api)
    try:
      v = validate(args, self.tokenizer, self.config.limits, field_names, self.grammars)
    except InvalidArgument as e:
      refuse(Status.INVALID_ARGUMENT, "invalid_argument", str(e), key, client_request_id, api)
    lora: LoraRef | None = None
    if args.lora:
      try:
        if self.loras is None:
          raise LookupError(f"unknown model or LoRA adapter {args.lora!r}: this server serves "
                            "no adapters")
        lora = self.loras.resolve(args.lora)
      except LookupError as e:
        refuse(Status.NOT_FOUND, "model_not_found", str(e.args[0]), key, client_request_id,
               api)
    prompt = len(v.prompt_ids)
    loop, cap = self.loop, self.loop.capacity()
    if v.sinks is not None:  # a ring of a fixed size, whatever max_tokens
      refusal = loop.can_ever_fit(0, ring_entries(v.sinks.window, cap.page_size))
      field = "attention_sinks.window"
    else:
      refusal = loop.can_ever_fit(prompt + v.stop.max_tokens)
      field = "max_tokens"
    if refusal is not None:
      refuse(Status.INVALID_ARGUMENT, "invalid_argument",
             f"{(field_names or {}).get(field, field)}: {refusal.message}",
             key, client_request_id, api, v.slo_class, prompt)
    occ = loop.occupancy()
    # Waiting: in the scheduler's queue, on their way to it, and samples held back for a sibling's
    # prefill (they join the queue later, so they count now).
    waiting = occ.waiting + occ.arriving + self._held
    if waiting + v.n > self.config.max_queue:
      refuse(Status.REJECTED, "queue_full",
             f"the queue is full ({self.config.max_queue} requests waiting)", key,
             client_request_id, api, v.slo_class, prompt)
    slo = self.classes.get(v.slo_class)  # None: best effort, predicted but never judged
    # What this request adds to the prefill backlog: its prompt less the cached prefix it would
    # reuse (the loop's thread-safe answer), and about one token per further sample.
    new_tokens = prompt - loop.cached_prefix_tokens(v.prompt_ids, lora.uid if lora else 0) + (
        v.n - 1)
    load = admission.Load(
        loop.step_s, self._backlog, occ.decoding, cap.max_step_tokens, new_tokens,
        model=loop.cost_model, slot_wait_steps=loop.slot_wait_steps(waiting),
        max_chunk=cap.max_chunk, max_prefill_chunks=cap.max_prefill_chunks,
        prefill_limit=loop.prefill_limit(occ.decoding), host_s=loop.timeline.host_s,
        in_flight_s=loop.in_flight_s())
    judged = loop.guard.call("cost_model", admission.judge, load, slo, self.config.slo_scale) \
        if slo is not None else loop.guard.call(
            "cost_model", lambda: (admission.predict(load), None))
    pred, miss = judged if judged is not None else (None, None)
    if self.config.early_reject and not self._idle():
      if miss is not None:
        refuse(Status.REJECTED, "slo", f"rejected early: {miss}", key, client_request_id,
               api, v.slo_class, prompt)
    try:
      quota = self.quotas.admit(key, prompt + v.n * v.stop.max_tokens, time.monotonic())
    except OverQuota as e:
      refuse(Status.REJECTED, "quota", str(e), key, client_request_id, api, v.slo_class, prompt)
    rid = f"req-{self._prefix}-{next(self._ids)}"
    stream = Stream(self, rid, v, key, client_request_id, api, quota, user,
                    buffer_bytes=self.config.stream_buffer_bytes,
                    stall_s=self.config.stream_stall_s)
    stream.backlog, stream.predicted_ttft = new_tokens, pred.ttft_s if pred else None
    with self._lock:  # set_state takes the lock: drain sees this stream, or it is refused here
      serving = self.state == "serving"
      if serving:
        self._live[rid] = stream
        self._backlog += new_tokens
    if not serving:  # a drain (or failure) began while this request was being admitted
      self.quotas.settle(quota, 0)
      refuse(Status.UNAVAILABLE, "unavailable", "the server is shutting down", key,
             client_request_id, api, v.slo_class, prompt)
    if self.faults is not None and client_request_id.startswith("fault:"):
      for sid in stream.ids:
        self.faults.arm(sid, client_request_id.split(":", 1)[1])
    # With the prefix cache, samples 1..n-1 wait for sample 0's prefill and then reuse its
    # prompt pages (only the last prompt token is computed again for each).
    share = v.n > 1 and cap.prefix_cache
    if share:  # counted before sample 0 is submitted, whose first output releases them
      with self._lock:
        self._held += v.n - 1
    for i, sid in enumerate(stream.ids):
      assert v.sampling.seed is not None  # validation gives every request a seed
      samp = dataclasses.replace(v.sampling, seed=(v.sampling.seed + i) % 2**32)
      # Only sample 0 of a session continues it (one conversation, one pinned path).
      req = Request(sid, v.prompt_ids, samp, v.stop, v.priority,
                    v.session_id if i == 0 else "", v.sinks, speculate=v.speculative, lora=lora)
      trace = RequestTrace(sid, self.loop.clock, self.loop.guard.report)
      trace.record("arrival")
      stream.add_sample(i, req, trace, defer=share and i > 0)
    return stream

  def _idle(self) -> bool:
    """Nothing queued, running, arriving or held back: early rejection has nothing to protect,
    and its estimate was fitted to a load that is gone (extrapolated to one row it can be far
    off, and with nothing admitted no step would ever refresh it)."""
    o = self.loop.occupancy()
    return not (o.waiting or o.running or o.arriving or self._held)

  def release_held(self, samples: int) -> None:
    if samples:
      with self._lock:
        self._held = max(0, self._held - samples)

  def prefilled(self, stream: Stream) -> None:
    with self._lock:
      self._backlog = max(0, self._backlog - stream.backlog)
      stream.backlog = 0

  def submit_sample(self, req: Request, callback: Callable[[RequestOutput], None],
                    trace: RequestTrace) -> None:
    self.loop.submit(req, callback, trace)

  def cancel_sample(self, request_id: str) -> None:
    self.loop.cancel(request_id)

  def prediction_error(self) -> dict[str, float | int | None]:
    """The TTFT predictor against what admitted requests got: actual / predicted ratios."""
    ratios = sorted(a / p for p, a in self.predictions if p > 0)
    if not ratios:
      return {"requests": 0, "median_ratio": None, "p10_ratio": None, "p90_ratio": None,
              "median_abs_rel_error": None, "p90_abs_rel_error": None}
    q = lambda x: ratios[min(len(ratios) - 1, int(x * (len(ratios) - 1)))]
    errs = sorted(abs(r - 1) for r in ratios)
    e = lambda x: errs[min(len(errs) - 1, int(x * (len(errs) - 1)))]
    return {"requests": len(ratios), "median_ratio": round(q(0.5), 3),
            "p10_ratio": round(q(0.1), 3), "p90_ratio": round(q(0.9), 3),
            "median_abs_rel_error": round(e(0.5), 3), "p90_abs_rel_error": round(e(0.9), 3)}

  # -- the one end path -----------------------------------------------------------------------

  def end(self, stream: Stream) -> None:
    never_submitted = stream.finish()
    if never_submitted is None:
      return
    self.release_held(never_submitted)
    with self._lock:
      self._live.pop(stream.request_id, None)
      self._backlog = max(0, self._backlog - stream.backlog)
      stream.backlog = 0
    if self.faults is not None:
      for sid in stream.ids:
        self.faults.disarm(sid)
    v = stream.validated
    use = stream.usage()
    self.metrics.prefix_hit_tokens.inc(  # every sample's hits: prefill the cache saved
        sum(f.usage.cached_tokens for f in stream.finals if f is not None and f.usage))
    self.quotas.settle(stream.quota, use.prompt_tokens + use.completion_tokens)
    t = stream.timings()
    prefill_s, ttft_s = t.get("prefill_s"), t.get("ttft_s")
    if prefill_s is not None:
      self.metrics.prefill.observe(prefill_s)
    if ttft_s is not None and stream.predicted_ttft:
      self.predictions.append((stream.predicted_ttft, ttft_s))
      self.metrics.ttft_prediction.observe(ttft_s / stream.predicted_ttft)
    finish = [f.finish_reason.value if f is not None and f.finish_reason is not None else ""
              for f in stream.finals]
    for reason in finish:
      self.metrics.requests.labels(status=stream.status.value, finish_reason=reason,
                                   slo_class=v.slo_class).inc()
    self.loop.guard.call("usage", self.usage.write, {
        "request_id": stream.request_id, "client_request_id": stream.client_request_id,
        "api_key": stream.key.name, "api": stream.api, "slo_class": v.slo_class,
        "status": stream.status.value, "message": stream.message,
        "prompt_tokens": use.prompt_tokens, "cached_tokens": use.cached_tokens,
        "completion_tokens": use.completion_tokens,
        "finish_reason": finish, "n": v.n, **({"user": stream.user} if stream.user else {}),
        **{k: t.get(k) for k in ("queue_s", "prefill_s", "ttft_s", "tpot_s", "e2e_s")}})

  # -- shutdown and the watchdog --------------------------------------------------------------

  def hurry(self) -> None:
    """A second SIGTERM: stop waiting for the live streams."""
    self._hurry.set()

  def drain(self, grace_s: float) -> int:
    """Returns how many streams had to be cancelled."""
    self.set_state("draining")
    deadline = time.monotonic() + grace_s
    while self._live and time.monotonic() < deadline and not self._hurry.is_set():
      self._hurry.wait(0.05)
    rest = list(self._live.values())
    for s in rest:
      s.cancel(Status.UNAVAILABLE, "the server is shutting down")
    deadline = time.monotonic() + 5.0
    while self._live and time.monotonic() < deadline and self.loop.failed is None:
      time.sleep(0.02)
    for s in list(self._live.values()):
      s.abort(Status.UNAVAILABLE, "the server is shutting down")
    self.stop_watchdog()
    return len(rest)

  def start_watchdog(self, period_s: float = 0.1) -> None:
    self._stop_watchdog.clear()
    self._watchdog = threading.Thread(target=self._watch, args=(period_s,), daemon=True,
                                      name="phaseserve-watchdog")
    self._watchdog.start()

  def stop_watchdog(self) -> None:
    self._stop_watchdog.set()
    if self._watchdog is not None and self._watchdog is not threading.current_thread():
      self._watchdog.join()
      self._watchdog = None

  def _watch(self, period_s: float) -> None:
    while not self._stop_watchdog.wait(period_s):
      beat = self.loop.beat
      why = self.loop.dead
      if why is None and beat is not None and \
          self.loop.clock() - beat > self.config.watchdog_s:
        why = (f"the serving loop has not completed a step for more than "
               f"{self.config.watchdog_s:g} s (a hung engine step, compile or deadlock); the "
               "engine is considered hung")
        self.loop.fail(why)
      if why is not None:
        self.set_state("failed")
        for s in list(self._live.values()):
          s.abort(Status.UNAVAILABLE, why)
        return

  def streams(self) -> Sequence[Stream]:
    return list(self._live.values())
