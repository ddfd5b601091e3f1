"""The serving loop: requests in, streamed outputs out, scheduler and engine stepping in between.

Contract:
  * ``ServingLoop(scheduler, engine, metrics=None, clock=time.monotonic)``. ``submit(request,
    on_output)`` is thread-safe: it records ``arrival`` on the request's trace (one monotonic
    clock for everything) and queues the request for the loop, which admits it before its next
    plan. ``on_output(RequestOutput)`` is called from the loop's thread for every update (token
    ids and text deltas), the last one with the finish reason; a request rejected at arrival gets
    exactly one, final, output. ``cancel(request_id)`` is thread-safe (pages free before the
    next planned step).
  * ``step()`` runs one iteration: admit arrivals, plan, execute (asynchronously; results lag one
    step), apply results, deliver outputs, update gauges. ``run_until_idle()`` steps until nothing
    is waiting, running or in flight (offline use). ``start()`` / ``stop()`` run the loop on a
    background thread (servers); ``stop`` joins it.
  * Prefill events: ``prefill_start`` / ``prefill_end`` bracket each step that ran a chunk of the
    request (the device time is not separable per request inside a batched step).
  * ``traces`` keeps every request's ``RequestTrace`` by id (for Chrome-trace export).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from serving.engine import Engine
from serving.lifecycle import Metrics, RequestTrace
from serving.request import Request, RequestOutput
from serving.scheduler import Scheduler

OutputFn = Callable[[RequestOutput], None]


class ServingLoop:
  def __init__(self, scheduler: Scheduler, engine: Engine, metrics: Metrics | None = None,
               clock: Callable[[], float] = time.monotonic):
    self.scheduler = scheduler
    self.engine = engine
    self.metrics = metrics
    self.clock = clock
    self.traces: dict[str, RequestTrace] = {}
    self._callbacks: dict[str, OutputFn] = {}
    self._inbox: queue.Queue[tuple[Request, RequestTrace, OutputFn]] = queue.Queue()
    self._thread: threading.Thread | None = None
    self._stop = threading.Event()
    self._wake = threading.Event()

  def submit(self, request: Request, on_output: OutputFn,
             trace: RequestTrace | None = None) -> RequestTrace:
    trace = trace or RequestTrace(request.request_id, self.clock)
    if not trace.events:
      trace.record("arrival")
    self._inbox.put((request, trace, on_output))
    self._wake.set()
    return trace

  def cancel(self, request_id: str) -> None:
    self.scheduler.cancel(request_id)
    self._wake.set()

  @property
  def idle(self) -> bool:
    return self._inbox.empty() and self.scheduler.idle

  def _admit(self) -> None:
    while True:
      try:
        req, trace, cb = self._inbox.get_nowait()
      except queue.Empty:
        return
      self.traces[req.request_id] = trace
      rejected = self.scheduler.add(req, trace)
      if rejected is not None:
        self._deliver_one(rejected, cb)
      else:
        self._callbacks[req.request_id] = cb

  def _deliver_one(self, out: RequestOutput, cb: OutputFn) -> None:
    if out.finished and self.metrics is not None:
      self.metrics.observe(self.traces[out.request_id])
    cb(out)

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
    self._admit()
    self._deliver(self.scheduler.drain_outputs())
    if self.scheduler.idle:
      for res in self.engine.flush():
        self._deliver(self.scheduler.update(res))
      return False
    plan = self.scheduler.schedule()
    self._deliver(self.scheduler.drain_outputs())
    started = {c.request_id for c in plan.prefill}
    for rid in started:
      self.traces[rid].record("prefill_start")
    result = self.engine.execute(plan)
    results = [result] if result is not None else []
    if plan.empty:  # everything planned is in flight: collect it
      results += self.engine.flush()
    for rid in started:
      self.traces[rid].record("prefill_end")
    for res in results:
      self._deliver(self.scheduler.update(res))
    if self.metrics is not None:
      self.metrics.queue_length.set(self.scheduler.num_waiting)
      self.metrics.running.set(self.scheduler.num_running)
      self.metrics.kv_pages_used.set(self.scheduler.pool.pages_used)
      self.metrics.kv_pages_free.set(self.scheduler.pool.pages_free)
    return True

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
      if not self.step():
        self._wake.wait(0.05)
        self._wake.clear()

  def stop(self) -> None:
    self._stop.set()
    self._wake.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
