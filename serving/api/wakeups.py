"""Wake-ups from the serving loop's thread to an asyncio loop, coalesced.

Contract: ``Wakeups(loop).wake(event)`` (any thread) sets the ``asyncio.Event`` ``event`` on
``loop``. Calls made before the loop runs the pending batch join it: one
``call_soon_threadsafe`` (a self-pipe write and a thread wake-up) carries every event woken
since the last batch ran, however many streams got an output in that step. An event is set
at most once a batch; a wake after the batch ran schedules the next one, so none is lost. On a
closed loop ``wake`` raises ``RuntimeError`` (as ``call_soon_threadsafe`` does) and holds
nothing; ``held`` counts the events waiting for the next batch.
"""

from __future__ import annotations

import asyncio
import threading


class Wakeups:
  def __init__(self, loop: asyncio.AbstractEventLoop):
    self.loop = loop
    self._lock = threading.Lock()
    self._pending: dict[asyncio.Event, None] = {}  # insertion-ordered set
    self._scheduled = False
    self.batches = 0  # call_soon_threadsafe calls made (tests, metrics)

  def wake(self, event: asyncio.Event) -> None:
    with self._lock:
      self._pending[event] = None
      if self._scheduled:
        return
      self._scheduled = True
      self.batches += 1
    try:
      self.loop.call_soon_threadsafe(self._run)
    except RuntimeError:  # the loop has closed: nothing will run the batch, hold nothing
      with self._lock:
        self._pending.clear()
        self._scheduled = False
      raise

  @property
  def held(self) -> int:
    """Events waiting for the next batch."""
    with self._lock:
      return len(self._pending)

  def _run(self) -> None:
    with self._lock:
      events, self._pending, self._scheduled = self._pending, {}, False
    for e in events:
      e.set()
