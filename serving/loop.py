"""The serving loop: requests in, streamed outputs out, scheduler and engine stepping in between.

Contract: ``ServingLoop(scheduler, engine: EngineApi, metrics=None, clock=time.monotonic, ...)``.
  * ``submit(request, on_output)`` / ``cancel(request_id)`` are thread-safe; ``on_output`` runs on
    the loop's thread for every update, the last with the finish reason (a request cancelled
    before admission ends ``cancelled`` without reaching the scheduler). ``step()`` admits, plans,
    executes (results lag ``engine.lag`` steps), delivers; ``run_until_idle()`` (offline) or
    ``start()`` / ``stop()`` (a background thread). One monotonic clock for every trace event;
    ``traces`` keeps them by id (``max_traces``: that many finished ones).
  * Faults: an engine exception (or ``fault_hook(plan)``'s) ends the step's sequences as ``error``
    and the loop goes on; a ``FatalEngineError`` or ``max_faults`` in a row sets ``failed``. An
    exception in the loop itself fails it too, then ``rebuild`` (a fresh scheduler) restarts it
    up to ``max_restarts`` times. ``dead``, ``beat``, ``step_started``, ``fail(message)``: for a
    watchdog. Observers (metrics, traces, cost model, callbacks) run inside ``guard``;
    ``timeline`` (``serving.step_timeline``) times the phases of every busy step.
  * The read-only face, the one place that reads the scheduler's memory: ``capacity()`` (fixed),
    ``occupancy()`` (queues now, KV pages as of the last step), ``can_ever_fit``,
    ``slot_wait_steps`` and the thread-safe ``cached_prefix_tokens(ids)`` (under the lock the
    loop holds while the scheduler changes, never across an engine call).
  * ``tasks.call(fn, timeout)`` (``serving.loop_tasks``) runs ``fn`` on the loop's thread
    between steps: work on the scheduler and the engine's pages from another thread.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Callable, Sequence

from serving.engine_api import EngineApi
from serving.guard import Guard
from serving.kv_pages import Refusal
from serving.lifecycle import Metrics, RequestTrace
from serving.lora import LoraRegistry
from serving.loop_tasks import LoopTasks
from serving.loop_views import Capacity, Occupancy
from serving.request import Request, RequestOutput, Usage
from serving.scheduler import Scheduler, StepPlan, StepResult
from serving.step_cost import StepCostModel
from serving.step_timeline import StepTimeline
from serving.stop import FinishReason

OutputFn = Callable[[RequestOutput], None]
_log = logging.getLogger(__name__)


class FatalEngineError(RuntimeError):
  """The engine cannot run another step (device lost, state corrupt)."""


class ServingLoop:
  def __init__(self, scheduler: Scheduler, engine: EngineApi, metrics: Metrics | None = None,
               clock: Callable[[], float] = time.monotonic, *, max_traces: int | None = None,
               fault_hook: Callable[[StepPlan], None] | None = None, max_faults: int = 3,
               rebuild: Callable[[], Scheduler] | None = None, max_restarts: int = 3,
               guard: Guard | None = None, cost_model: StepCostModel | None = None,
               loras: LoraRegistry | None = None):
    self.scheduler = scheduler
    self.loras = loras  # the LoRA adapters served: the front ends resolve names here
    self.engine = engine
    self.metrics = metrics
    self.clock = clock
    self.traces: dict[str, RequestTrace] = {}
    self.max_traces = max_traces
    self._finished_ids: collections.deque[str] = collections.deque()
    self.fault_hook = fault_hook
    self.max_faults = max_faults
    self.faults = 0  # faults so far
    self._faults_in_row = 0
    self.failed: str | None = None  # why the engine cannot continue
    self.failures = 0
    self.rebuild = rebuild
    self.max_restarts = max_restarts
    self.restarts = 0
    self.guard = guard or Guard(None if metrics is None else metrics.internal_errors)
    self.beat: float | None = None
    self._restarting = False
    self.step_started: float | None = None
    self.step_s = 0.0  # moving average of a busy step's wall time (admission predictions)
    # Step seconds vs its composition, fitted as it runs.
    self.cost_model = cost_model or StepCostModel()
    self.timeline = StepTimeline()  # where each busy step's time goes (serving.step_timeline)
    if metrics is not None:
      metrics.watch_timeline(self.timeline)
      metrics.watch_spec(lambda: self.scheduler.spec)  # the scheduler's, rebuilt or not
      metrics.watch_lora(lambda: self.scheduler.lora_info())
    self._timed: collections.deque[tuple[int, int]] = collections.deque()
    self._callbacks: dict[str, OutputFn] = {}
    self._inbox: queue.Queue[tuple[Request, RequestTrace, OutputFn]] = queue.Queue()
    # Ids submitted and not yet admitted, and those of them already cancelled: a cancel the
    # scheduler would not know yet (it drops unknown ids) is kept for the admission.
    self._arriving_lock = threading.Lock()
    self._arriving: set[str] = set()
    self._cancelled_early: set[str] = set()
    self._thread: threading.Thread | None = None
    self._stop = threading.Event()
    self._wake = threading.Event()
    self.tasks = LoopTasks(self._wake.set)  # calls that must not race a step (KV transfers)
    # Held by the loop while the scheduler changes (never across an engine call), so that
    # ``cached_prefix_tokens`` reads the prefix cache from another thread consistently.
    self._sched_lock = threading.RLock()
    self._kv_counts = (0, 0, 0, 0)  # pages used, free, cached, in the host tier (``_count_kv``)
    self._count_kv()

  def submit(self, request: Request, on_output: OutputFn,
             trace: RequestTrace | None = None) -> RequestTrace:
    trace = trace or RequestTrace(request.request_id, self.clock, self.guard.report)
    if not trace.events:
      trace.record("arrival")
    with self._arriving_lock:
      self._arriving.add(request.request_id)
    self._inbox.put((request, trace, on_output))
    self._wake.set()
    return trace

  def cancel(self, request_id: str) -> None:
    with self._arriving_lock:
      if request_id in self._arriving:
        self._cancelled_early.add(request_id)
    self.scheduler.cancel(request_id)
    self._wake.set()

  @property
  def idle(self) -> bool:
    return self._inbox.empty() and self.scheduler.idle

  @property
  def num_arriving(self) -> int:
    """Submitted, not yet admitted by the loop."""
    return self._inbox.qsize()

  def _admit(self) -> None:
    while True:
      try:
        req, trace, cb = self._inbox.get_nowait()
      except queue.Empty:
        return
      self.traces[req.request_id] = trace
      with self._arriving_lock:
        self._arriving.discard(req.request_id)
        cancelled = req.request_id in self._cancelled_early
        self._cancelled_early.discard(req.request_id)
      if cancelled:
        trace.record("finished", FinishReason.CANCELLED.value)
        self._deliver_one(RequestOutput(req.request_id, finish_reason=FinishReason.CANCELLED,
                                        message="cancelled by the client",
                                        usage=Usage(len(req.prompt_ids), 0)), cb)
        continue
      if self.failed is not None:
        trace.record("finished", FinishReason.ERROR.value)
        self._deliver_one(RequestOutput(req.request_id, finish_reason=FinishReason.ERROR,
                                        message=self.failed), cb)
        continue
      with self._sched_lock:
        rejected = self.scheduler.add(req, trace)
      if rejected is not None:
        self._deliver_one(rejected, cb)
      else:
        self._callbacks[req.request_id] = cb

  def _deliver_one(self, out: RequestOutput, cb: OutputFn) -> None:
    if out.finished:
      if self.metrics is not None and out.request_id in self.traces:
        self.guard.call("metrics", self.metrics.observe, self.traces[out.request_id])
      if self.max_traces is not None:
        self._finished_ids.append(out.request_id)
        while len(self._finished_ids) > self.max_traces:
          self.traces.pop(self._finished_ids.popleft(), None)
    try:
      cb(out)
    except Exception as e:  # a consumer's bug costs its own request, never the loop
      self.guard.report("stream_callback", e)
      if not out.finished:
        self.scheduler.cancel(out.request_id)

  def _deliver(self, outs: list[RequestOutput]) -> None:
    for o in outs:
      cb = self._callbacks.get(o.request_id)
      if cb is None:
        continue
      if o.finished:
        del self._callbacks[o.request_id]
      self._deliver_one(o, cb)

  def step(self) -> bool:
    """One iteration; returns False when there was nothing to do."""
    tl = self.timeline
    tl.begin()
    self._admit()
    self.tasks.run_pending()
    self._deliver(self._drain())
    if self.failed is not None:
      tl.idle()
      return False
    if self.scheduler.idle:
      try:
        for res in self.engine.flush():
          self._deliver(self._update(res))
      except Exception as e:
        self._fault(e)
      self._update_gauges()
      tl.idle()
      return False
    tl.mark("admit")
    with self._sched_lock:
      plan = self.scheduler.schedule()
      sync = plan.empty or self.scheduler.synchronous  # collect this step before the next plan
    self._deliver(self._drain())
    started = {c.request_id for c in plan.prefill}
    for c in plan.prefill:  # detail: the positions this chunk computes
      self.traces[c.request_id].record("prefill_start",
                                       f"{c.start}-{c.start + len(c.token_ids)}")
    tl.mark("plan")
    t0 = self.step_started = self.clock()
    programs = self.engine.programs
    try:
      if self.fault_hook is not None:
        self.fault_hook(plan)
      result = self.engine.execute(plan)
      results = [result] if result is not None else []
      if sync:  # everything planned is in flight, or speculation needs this step's ids
        results += self.engine.flush()
    except Exception as e:
      self.step_started = None
      tl.idle()
      self._fault(e)
      return True
    tl.mark("execute")
    self.step_started = None
    compiled = self.engine.programs != programs
    composition = (sum(len(c.token_ids) for c in plan.prefill), len(plan.decode))
    if not plan.empty:
      dt = self.clock() - t0
      self.step_s = 0.9 * self.step_s + 0.1 * dt if self.step_s else dt
      if self.metrics is not None:
        self.guard.call("metrics", self._step_metrics, dt, composition)
      # With lagged results, a call waits for the previous step's ids: its wall time is that
      # step's device time, so it is fitted to the composition of the plan ``lag`` steps back.
      # A flushed call waited for its own step: a sample only when nothing else was in flight.
      self._timed.append(composition)
      timed = self._timed.popleft() if len(self._timed) > (0 if sync else self.engine.lag) \
          and (not sync or len(self._timed) == 1) else None
      if sync:
        self._timed.clear()
      # A call that compiled a program timed the compiler, not a step: not a sample.
      if timed is not None and not compiled:
        self.guard.call("cost_model", self.cost_model.observe, *timed, dt)
    self._faults_in_row = 0
    for rid in started:
      self.traces[rid].record("prefill_end")
    for res in results:
      outs = self._update(res)
      tl.mark("update")
      self._deliver(outs)
      tl.mark("deliver")
    self._update_gauges()
    tl.mark("deliver")
    self.guard.call("timeline", tl.end, *composition, sum(r.wait_s for r in results), compiled)
    return True

  def _drain(self) -> list[RequestOutput]:
    with self._sched_lock:
      return self.scheduler.drain_outputs()

  def _update(self, result: StepResult) -> list[RequestOutput]:
    with self._sched_lock:
      return self.scheduler.update(result)

  def _fail_scheduler(self, message: str, waiting: bool) -> list[RequestOutput]:
    with self._sched_lock:
      return self.scheduler.fail(message, waiting=waiting)

  def _step_metrics(self, dt: float, composition: tuple[int, int]) -> None:
    m, limit = self.metrics, self.scheduler.last_prefill_limit
    assert m is not None  # called only with metrics
    m.step_seconds.observe(dt)
    m.step_prefill_tokens.set(composition[0])
    m.step_decode_rows.set(composition[1])
    m.prefill_limit.set(-1 if limit is None else limit)

  def _count_failure(self, kind: str) -> None:
    self.failures += 1
    m = self.metrics
    if m is not None:
      self.guard.call("metrics", lambda: m.loop_failures.labels(kind=kind).inc())

  def _fault(self, exc: Exception) -> None:
    self.faults += 1
    self._faults_in_row += 1
    message = f"engine step failed: {type(exc).__name__}: {exc}"
    _log.error("%s", message)
    fatal = isinstance(exc, FatalEngineError) or self._faults_in_row >= self.max_faults
    if fatal:
      self.failed = f"the engine cannot continue ({message})"
      self._count_failure("fatal")
    self.engine.reset()
    self._timed.clear()
    self._deliver(self._fail_scheduler(self.failed or message, waiting=fatal))
    self._update_gauges()

  @property
  def dead(self) -> str | None:
    """Why the loop cannot serve (failed and not about to restart), else None."""
    return None if self._restarting else self.failed

  def fail(self, message: str) -> None:
    """Marks the engine as unable to continue (a watchdog saw the loop hang): no later step
    runs and the loop is not restarted. Streams are ended by the caller (the loop thread may
    be stuck in the engine)."""
    if self.failed is None:
      self.failed = message
      self._count_failure("hung")

  def _update_gauges(self) -> None:
    """On the loop's thread, after each step: the KV counts ``occupancy`` reports, then the
    gauges."""
    self.guard.call("metrics", self._count_kv)
    if self.metrics is not None:
      self.guard.call("metrics", self._set_gauges)

  def _set_gauges(self) -> None:
    m, o = self.metrics, self.occupancy()
    assert m is not None  # called only with metrics
    m.queue_length.set(o.waiting)
    m.running.set(o.running)
    m.kv_pages_used.set(o.pages_used)
    m.kv_pages_free.set(o.pages_free)
    m.kv_pages_cached.set(o.pages_cached)

  # -- the read-only face: every read of the scheduler's memory (pool, prefix cache) is here ----

  def capacity(self) -> Capacity:
    s = self.scheduler
    pool, cache = s.kv.pool, s.kv.prefix_cache
    return Capacity(
        kv_pages=pool.budget.num_pages, page_size=pool.page_size, kv_bytes=pool.budget.bytes,
        bytes_per_page=pool.budget.bytes_per_page, max_slots=s.max_slots,
        max_context=s.max_context, max_step_tokens=s.max_step_tokens,
        max_prefill_chunks=s.max_prefill_chunks, max_chunk=s.max_chunk,
        prefix_cache=s.kv.caching, host_tier_pages=cache.host_capacity,
        attention_sinks=s.sinks, vocab_size=s.tokenizer.vocab_size)

  def _count_kv(self) -> None:
    kv = self.scheduler.kv
    self._kv_counts = (kv.pool.pages_used, kv.pool.pages_free, kv.pool.pages_cached,
                       kv.prefix_cache.host_pages_used)

  def occupancy(self) -> Occupancy:
    """From any thread: the queue counts now, the KV page counts as of the last step."""
    s = self.scheduler
    used, free, cached, host = self._kv_counts
    return Occupancy(
        waiting=s.num_waiting, arriving=self.num_arriving, running=s.num_running,
        decoding=s.num_decoding, pages_used=used, pages_free=free, pages_cached=cached,
        host_tier_pages_used=host)

  def can_ever_fit(self, n_tokens: int, ring: int = 0) -> Refusal | None:
    """Why a sequence of ``n_tokens`` positions (or a window's ring of ``ring`` pages) could
    never be held, whatever else runs; None when it could (``serving.kv_pages.PagePool``)."""
    return self.scheduler.kv.pool.can_ever_fit(n_tokens, ring)

  def slot_wait_steps(self, ahead: int) -> int:
    """Steps until a slot frees for a request with ``ahead`` requests before it."""
    return self.scheduler.slot_wait_steps(ahead)

  def in_flight_s(self) -> float:
    """What is left of the engine call running now, by the average busy step (0 between
    steps)."""
    started = self.step_started
    return 0.0 if started is None else max(0.0, self.step_s - (self.clock() - started))

  def prefill_limit(self, decoding: int) -> int | None:
    """The prefill tokens a step with ``decoding`` rows may carry by the TPOT budget (None: no
    budget, or none while nothing decodes)."""
    limit = self.scheduler.prefill_limit
    return None if limit is None or decoding == 0 else limit(decoding)

  def cached_prefix_tokens(self, ids: Sequence[int], ns: int = 0, timeout: float = 0.1) -> int:
    """Thread-safe: the leading tokens of ``ids`` the prefix cache holds now in namespace
    ``ns`` (a LoRA adapter's uid, ``serving.kv_manager.namespace``; 0 without a cache, or when
    the loop keeps the scheduler longer than ``timeout`` seconds)."""
    if not self._sched_lock.acquire(timeout=timeout):
      return 0
    try:
      return self.scheduler.kv.cached_prefix(ids, ns)
    finally:
      self._sched_lock.release()

  def run_until_idle(self, max_steps: int = 10_000_000) -> None:
    for _ in range(max_steps):
      if not self.step() and self.idle:
        return
    raise RuntimeError(f"not idle after {max_steps} steps")

  # -- background thread (servers) --------------------------------------------------------------

  def start(self) -> None:
    if self._thread is not None:
      raise RuntimeError("already started")
    self._stop.clear()
    self._thread = threading.Thread(target=self._run, name="phaseserve-loop", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while not self._stop.is_set():
      self.beat = self.clock()
      try:
        if self.failed is not None:
          self._admit()  # later submissions end at once
          self._wake.wait(0.05)
          self._wake.clear()
        elif not self.step():
          self._wake.wait(0.05)
          self._wake.clear()
      except Exception as e:  # a bug outside the engine call: fail loudly, never hang streams
        self._restarting = self.rebuild is not None and self.restarts < self.max_restarts
        try:
          self._internal_error(e)
          if self._restarting:
            self._restart()
        finally:
          self._restarting = False

  def _internal_error(self, exc: Exception) -> None:
    """An exception from the scheduler or the loop itself (engine faults are handled in
    ``step``): its state cannot be trusted, so the loop fails like a fatal engine fault; every
    request still known ends as ``error`` and later submissions end at once."""
    _log.exception("serving loop failed")
    self.failed = f"internal error in the serving loop: {type(exc).__name__}: {exc}"
    self._count_failure("internal")
    try:
      self._deliver(self._fail_scheduler(self.failed, waiting=True))
    except Exception:
      _log.exception("ending the requests after the failure also failed")
    for rid, cb in list(self._callbacks.items()):  # whatever fail() could not end
      self._callbacks.pop(rid, None)
      self._deliver_one(RequestOutput(rid, finish_reason=FinishReason.ERROR,
                                      message=self.failed), cb)

  def _restart(self) -> None:
    """After an internal error (every request already ended): a fresh scheduler on the same
    engine; the engine drops its results in flight (its device pages are addressed only through
    the new pool's tables, so stale contents are never read)."""
    try:
      assert self.rebuild is not None  # _restarting says so
      scheduler = self.rebuild()
      self.engine.reset()
    except Exception:
      _log.exception("rebuilding the serving loop failed: it stays failed")
      return
    with self._sched_lock:
      self.scheduler = scheduler
    self._timed.clear()
    self._callbacks.clear()
    self._faults_in_row = 0
    self.restarts += 1
    if self.metrics is not None:
      self.guard.call("metrics", self.metrics.loop_restarts.inc)
    _log.warning("serving loop restarted (%d of at most %d)", self.restarts, self.max_restarts)
    self.failed = None
    self._update_gauges()

  def stop(self, timeout: float | None = None) -> None:
    """Stops the background thread; ``timeout`` bounds the wait (a hung engine call)."""
    self._stop.set()
    self._wake.set()
    if self._thread is not None:
      self._thread.join(timeout)
      self._thread = None
