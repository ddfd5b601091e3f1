"""The fault boundary around what only observes the serving loop.

Contract: ``Guard(counter=None)`` runs the parts that watch the loop (the step-cost model,
metrics, the lifecycle trace, the usage log, stream callbacks): ``call(part, fn, *args,
default=None)`` returns ``fn(*args)``, or ``default`` when it raised; ``wrap(part, fn, default)``
is the same as a function; ``report(part, exc)`` records an exception caught elsewhere. Every
exception is logged with its traceback and counted by part, in ``counts`` and in ``counter``
(``phaseserve_internal_errors_total{part}``); none propagates, so a bug in an observer costs at
most the request it belongs to, never the loop. ``PARTS`` names the parts.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable, TypeVar

import prometheus_client as prom

_log = logging.getLogger(__name__)
T = TypeVar("T")

PARTS = ("cost_model", "metrics", "lifecycle", "usage", "stream_callback")


class Guard:
  def __init__(self, counter: prom.Counter | None = None):
    self.counter = counter
    self.counts: collections.Counter[str] = collections.Counter()
    self._lock = threading.Lock()  # reports come from the loop's and the handlers' threads

  def report(self, part: str, exc: BaseException) -> None:
    if part not in PARTS:
      raise ValueError(f"unknown part {part!r} (one of {PARTS})")
    _log.error("internal error in %s (the loop goes on)", part, exc_info=exc)
    with self._lock:
      self.counts[part] += 1
    if self.counter is not None:
      try:
        self.counter.labels(part=part).inc()
      except Exception:  # the counter is an observer too
        _log.exception("counting an internal error failed")

  def call(self, part: str, fn: Callable[..., T], *args: Any, default: T | None = None
           ) -> T | None:
    try:
      return fn(*args)
    except Exception as e:
      self.report(part, e)
      return default

  def wrap(self, part: str, fn: Callable[..., T], default: T | None = None
           ) -> Callable[..., T | None]:
    return lambda *args: self.call(part, fn, *args, default=default)
