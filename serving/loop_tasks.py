"""Work for the serving loop's thread: calls that must not race a step (the KV pages, the
scheduler's prefix cache).

Contract: ``LoopTasks(wake)``; ``call(fn, timeout)`` (any thread) queues ``fn``, calls ``wake``
and waits for its result (its exception re-raised); after ``timeout`` seconds it raises
``TimeoutError`` and ``fn`` will not run if it has not started. ``run_pending()`` (the loop's
thread, between steps) runs what is queued, in order, each at most once.
"""

from __future__ import annotations

import concurrent.futures
import queue
from typing import Callable, TypeVar

T = TypeVar("T")


class LoopTasks:
  def __init__(self, wake: Callable[[], None]):
    self._wake = wake
    self._queue: queue.SimpleQueue[tuple[Callable[[], object], concurrent.futures.Future]] = \
        queue.SimpleQueue()

  def call(self, fn: Callable[[], T], timeout: float) -> T:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    self._queue.put((fn, fut))
    self._wake()
    try:
      return fut.result(timeout)
    except concurrent.futures.TimeoutError:
      fut.cancel()
      raise TimeoutError(f"the serving loop did not run the call in {timeout} s") from None

  def run_pending(self) -> None:
    while True:
      try:
        fn, fut = self._queue.get_nowait()
      except queue.Empty:
        return
      if not fut.set_running_or_notify_cancel():
        continue  # its caller gave up
      try:
        fut.set_result(fn())
      except Exception as e:  # the caller's to handle, not the loop's
        fut.set_exception(e)
