"""serving.api.thread_pool.ElasticThreadPool: grows with the work in flight, never starves queued work
behind busy threads, lets idle threads go, carries results and exceptions like
ThreadPoolExecutor."""

from __future__ import annotations

import threading
import time

import pytest

from serving.api.thread_pool import ElasticThreadPool


def _wait(cond, timeout=5.0):
  deadline = time.monotonic() + timeout
  while not cond():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.005)


def test_grows_with_blocked_work_then_shrinks_when_idle():
  pool = ElasticThreadPool(16, idle_s=0.2, name="t")
  release = threading.Event()
  started = []
  fs = [pool.submit(lambda i=i: (started.append(i), release.wait(5), i)[2]) for i in range(10)]
  _wait(lambda: len(started) == 10)  # ten long calls at once: ten threads, none starved
  assert pool.threads == 10
  release.set()
  assert [f.result(5) for f in fs] == list(range(10))
  _wait(lambda: pool.threads == 0)  # idle for idle_s: every thread ended (a plain pool keeps 10)
  assert pool.submit(lambda: 7).result(5) == 7  # and it grows again
  pool.shutdown()
  assert pool.threads == 0


def test_bounded_by_max_workers_and_queued_work_runs():
  pool = ElasticThreadPool(2, idle_s=5.0)
  release = threading.Event()
  busy = [pool.submit(release.wait, 5) for _ in range(2)]
  later = pool.submit(lambda: "ran")
  time.sleep(0.1)
  assert pool.threads == 2 and not later.done()
  release.set()
  assert later.result(5) == "ran" and all(f.result(5) for f in busy)
  pool.shutdown()


def test_sequential_work_reuses_one_thread_and_exceptions_reach_the_future():
  pool = ElasticThreadPool(8, idle_s=5.0)
  for i in range(50):
    assert pool.submit(lambda i=i: i * 2).result(5) == i * 2
  assert pool.threads == 1
  with pytest.raises(ZeroDivisionError):
    pool.submit(lambda: 1 / 0).result(5)
  done = []
  pool.submit(lambda: 3).add_done_callback(lambda f: done.append(f.result()))
  _wait(lambda: done == [3])
  pool.shutdown()
  with pytest.raises(RuntimeError):
    pool.submit(lambda: 0)
