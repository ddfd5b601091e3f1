"""A thread pool that grows with the calls in flight and shrinks when they are gone.

Contract: ``ElasticThreadPool(max_workers, idle_s=60.0, name="pool")`` is a
``concurrent.futures.Executor`` (what ``grpc.server`` takes). ``submit`` starts a thread only when
every live one is busy (at most ``max_workers``; beyond that the work waits in the queue); a
thread idle for ``idle_s`` ends. ``threads`` is how many live now. ``shutdown(wait)`` lets the
queued work finish, then every thread ends. Why not ``ThreadPoolExecutor``: BUILD_NOTES
"Design: The API".
"""

from __future__ import annotations

import concurrent.futures as futures
import itertools
import queue
import threading
from typing import Any, Callable

_STOP = object()


class ElasticThreadPool(futures.Executor):
  def __init__(self, max_workers: int, idle_s: float = 60.0, name: str = "pool"):
    if max_workers < 1 or idle_s <= 0:
      raise ValueError(f"want max_workers >= 1 and idle_s > 0, got {max_workers}, {idle_s}")
    self._max = max_workers
    self._idle_s = idle_s
    self._name = name
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._threads: set[threading.Thread] = set()
    self._idle = 0  # threads waiting for work
    self._queued = 0  # work items not yet taken
    self._ids = itertools.count()
    self._shutdown = False

  @property
  def threads(self) -> int:
    return len(self._threads)

  def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future:
    future: futures.Future = futures.Future()
    with self._lock:
      if self._shutdown:
        raise RuntimeError("cannot submit after shutdown")
      self._queued += 1
      self._queue.put((future, fn, args, kwargs))
      if self._queued > self._idle and len(self._threads) < self._max:
        t = threading.Thread(target=self._work, name=f"{self._name}_{next(self._ids)}",
                             daemon=True)
        self._threads.add(t)
        self._idle += 1  # counted idle until it takes an item
        t.start()
    return future

  def _work(self) -> None:
    me = threading.current_thread()
    while True:
      try:
        item = self._queue.get(timeout=self._idle_s)
      except queue.Empty:
        with self._lock:
          if self._queued > 0:  # work arrived as the wait ended: take it
            continue
          self._idle -= 1
          self._threads.discard(me)
          return
      if item is _STOP:
        with self._lock:
          self._idle -= 1
          self._threads.discard(me)
        return
      with self._lock:
        self._idle -= 1
        self._queued -= 1
      future, fn, args, kwargs = item
      result, error = None, None
      run = future.set_running_or_notify_cancel()
      if run:
        try:
          result = fn(*args, **kwargs)
        except BaseException as e:  # the future carries it, as ThreadPoolExecutor's does
          error = e
      with self._lock:  # idle again before the caller can see the result and submit more
        self._idle += 1
      if run:
        if error is None:
          future.set_result(result)
        else:
          future.set_exception(error)
      del item, future, fn, args, kwargs, result, error

  def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
    with self._lock:
      self._shutdown = True
      threads = list(self._threads)
    for _ in threads:
      self._queue.put(_STOP)  # after the queued work: it finishes first
    if wait:
      for t in threads:
        if t is not threading.current_thread():
          t.join()
