"""One client call's stream, and the statuses every wire API maps its own onto.

Contract: ``Stream(owner, request_id, validated, key, ...)`` carries a request's ``n`` samples'
outputs through one bounded buffer (``buffer_bytes``; a generating stream unread for ``stall_s``
is cancelled as a slow consumer). The loop thread pushes outputs; the consumer reads them with
``events()`` / ``poll()`` / ``on_ready(fn)``; ``cancel`` / ``abort`` stop it early. It asks its
owner (``StreamOwner``, implemented by ``serving.api.frontend.Frontend``) to submit and cancel
samples, to release held-back samples, and to ``end`` it, once, on the one end path, where
``finish()`` sets its ``Status``. ``ServiceError(status, message, reason)`` is how a refusal or
a failed stream surfaces to the wire.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from typing import Callable, Iterator, Protocol

from serving.api.validation import Validated
from serving.api.auth import KeyInfo
from serving.lifecycle import RequestTrace
from serving.request import Request, RequestOutput, Usage
from serving.stop import FinishReason

_log = logging.getLogger(__name__)


class Status(str, enum.Enum):
  OK = "ok"
  INVALID_ARGUMENT = "invalid_argument"
  REJECTED = "rejected"  # queue full, quota, predicted SLO miss: RESOURCE_EXHAUSTED
  CANCELLED = "cancelled"
  DEADLINE_EXCEEDED = "deadline_exceeded"
  SLOW_CONSUMER = "slow_consumer"
  ERROR = "error"  # an engine fault: INTERNAL
  UNAVAILABLE = "unavailable"  # loading, draining, engine down
  NOT_FOUND = "not_found"  # a model (LoRA adapter) the server does not serve


class ServiceError(Exception):
  """``reason`` is the refusal's ``phaseserve_rejections_total`` label (``queue_full``,
  ``quota``, ``slo``, ...) when the request was refused at arrival, else ``""``."""

  def __init__(self, status: Status, message: str, reason: str = ""):
    super().__init__(message)
    self.status = status
    self.message = message
    self.reason = reason


class StreamOwner(Protocol):
  """What a ``Stream`` asks of the service that made it."""

  def submit_sample(self, req: Request, callback: Callable[[RequestOutput], None],
                    trace: RequestTrace) -> None: ...

  def cancel_sample(self, request_id: str) -> None: ...

  def release_held(self, samples: int) -> None: ...

  def prefilled(self, stream: "Stream") -> None: ...

  def end(self, stream: "Stream") -> None: ...


def _size(out: RequestOutput) -> int:
  """About what an output costs in the buffer and on the wire."""
  return 64 + len(out.text) + 4 * len(out.token_ids) + sum(16 + 8 * len(lp.top)
                                                           for lp in out.logprobs)


class Stream:
  """One client call: ``n`` samples' outputs through one bounded buffer."""

  END = object()  # poll(): every output has been read and the stream ended OK

  def __init__(self, owner: StreamOwner, request_id: str, v: Validated, key: KeyInfo,
               client_request_id: str, api: str, quota: list[float] | None, user: str = "", *,
               buffer_bytes: int, stall_s: float):
    self.owner = owner
    self.buffer_bytes = buffer_bytes  # past it (or ``stall_s`` unread) a generating stream is cut
    self.stall_s = stall_s
    self.request_id = request_id
    self.validated = v
    self.key = key
    self.client_request_id = client_request_id
    self.api = api
    self.quota = quota
    self.user = user
    self.ids = [request_id] if v.n == 1 else [f"{request_id}/{i}" for i in range(v.n)]
    self.traces: list[RequestTrace] = []
    self.finals: list[RequestOutput | None] = [None] * v.n
    self.completion = [0] * v.n
    self.backlog = 0  # prefill tokens it adds to the backlog until its first output
    self.predicted_ttft: float | None = None
    self._cond = threading.Condition()
    self._items: collections.deque[tuple[int, RequestOutput, float]] = collections.deque()
    self._bytes = 0
    self._stop: tuple[Status, str] | None = None  # why the stream was stopped early
    self._deferred: list[tuple[int, Request]] = []  # samples waiting for sample 0's prefill
    self._wakers: list[Callable[[], None]] = []  # on_ready callbacks
    self.ended = False
    self.status = Status.OK
    self.message = ""

  # -- the loop thread's side -----------------------------------------------------------------

  def add_sample(self, index: int, req: Request, trace: RequestTrace, *, defer: bool) -> None:
    """Sample ``index`` joins: submitted now, or (``defer``) held until sample 0's prefill."""
    self.traces.append(trace)
    if defer:
      self._deferred.append((index, req))
    else:
      self.owner.submit_sample(req, self._callback(index), trace)

  def _callback(self, index: int) -> Callable[[RequestOutput], None]:
    return lambda out: self._push(index, out)

  def _release_deferred(self) -> None:
    with self._cond:
      deferred, self._deferred = self._deferred, []
      stopped = self._stop is not None
    self.owner.release_held(len(deferred))
    for i, req in deferred:
      if stopped:  # cancelled before it was submitted: it ends here
        self._push(i, RequestOutput(req.request_id, finish_reason=FinishReason.CANCELLED,
                                    message=self._stop[1] if self._stop else ""))
      else:
        self.owner.submit_sample(req, self._callback(i), self.traces[i])

  def _push(self, index: int, out: RequestOutput) -> None:
    now = time.monotonic()
    if index == 0 and self._deferred:
      self._release_deferred()  # sample 0's prompt is prefilled (or it ended)
    with self._cond:
      if self.ended:
        return
      self._items.append((index, out, now))
      self._bytes += _size(out)
      self.completion[index] += len(out.token_ids)
      if out.finished:
        self.finals[index] = out
      done = all(f is not None for f in self.finals)
      # A finished request holds no engine resources: its last outputs wait for the reader
      # however slow it is (only a stream still generating is cut off as a slow consumer).
      slow = not done and self._stop is None and (
          self._bytes > self.buffer_bytes or
          now - self._items[0][2] > self.stall_s)
      self._cond.notify_all()
    self._wake()
    if self.backlog and (out.token_ids or out.finished):
      self.owner.prefilled(self)
    if slow:
      self.cancel(Status.SLOW_CONSUMER, "the client is not reading its stream")
    if done:
      self.owner.end(self)

  def finish(self) -> int | None:
    """Marks the stream ended and sets its status from how its samples finished (the owner's
    ``end`` calls it once); returns how many held-back samples were never submitted, or None
    when it had already ended."""
    with self._cond:
      if self.ended:
        return None
      self.ended = True
      never_submitted, self._deferred = len(self._deferred), []  # aborted while held back
      reasons = [f.finish_reason for f in self.finals if f is not None]
      if self._stop is not None:
        self.status, self.message = self._stop
      elif FinishReason.ERROR in reasons or len(reasons) < len(self.finals):
        self.status = Status.ERROR
        self.message = next((f.message for f in self.finals
                               if f is not None and f.finish_reason is FinishReason.ERROR),
                              "the engine failed")
      elif FinishReason.REJECTED in reasons:
        self.status = Status.REJECTED
        self.message = next(f.message for f in self.finals if f is not None and
                              f.finish_reason is FinishReason.REJECTED)
      self._cond.notify_all()
    self._wake()
    return never_submitted

  # -- the consumer's side --------------------------------------------------------------------

  def cancel(self, status: Status, message: str) -> None:
    with self._cond:
      if self.ended or self._stop is not None:
        return
      self._stop = (status, message)
      deferred = {i for i, _ in self._deferred}
      pending = [rid for i, (rid, f) in enumerate(zip(self.ids, self.finals))
                 if f is None and i not in deferred]
    for rid in pending:
      self.owner.cancel_sample(rid)
    if deferred:
      self._release_deferred()

  def abort(self, status: Status, message: str) -> None:
    """Ends the stream now, without waiting for the loop (watchdog, drain's last resort)."""
    with self._cond:
      if self._stop is None:
        self._stop = (status, message)
    self.owner.end(self)

  def on_ready(self, fn: Callable[[], None]) -> None:
    with self._cond:
      self._wakers.append(fn)
    fn()  # whatever is already buffered (or the end) is there to poll now

  def off_ready(self, fn: Callable[[], None]) -> None:
    with self._cond:
      if fn in self._wakers:
        self._wakers.remove(fn)

  def _wake(self) -> None:
    with self._cond:
      wakers = list(self._wakers)
    for fn in wakers:
      try:
        fn()
      except Exception:  # e.g. the consumer's event loop has closed: the stream goes on
        _log.debug("stream waker failed", exc_info=True)

  def poll(self) -> "tuple[int, RequestOutput] | None | object":
    with self._cond:
      if self._items:
        index, out, _ = self._items.popleft()
        self._bytes -= _size(out)
        return index, out
      if not self.ended:
        return None
      if self.status is not Status.OK:
        raise ServiceError(self.status, self.message)
      return Stream.END

  def events(self, poll_s: float = 0.1) -> Iterator[tuple[int, RequestOutput]]:
    while True:
      with self._cond:
        while not self._items and not self.ended:
          self._cond.wait(poll_s)
        if self._items:
          index, out, _ = self._items.popleft()
          self._bytes -= _size(out)
        elif self.ended:
          if self.status is not Status.OK:
            raise ServiceError(self.status, self.message)
          return
        else:
          continue
      yield index, out

  def timings(self) -> dict[str, float | None]:
    """Sample 0's timings (every sample shares the prompt's queue and prefill)."""
    return self.traces[0].timings() if self.traces else {}

  def usage(self) -> Usage:
    """The request's usage (the module's one rule): the prompt once, the completion summed
    over the samples, ``cached_tokens`` sample 0's."""
    first = self.finals[0]
    cached = first.usage.cached_tokens if first is not None and first.usage is not None else 0
    return Usage(len(self.validated.prompt_ids), sum(self.completion), cached)
