"""Multi-turn sessions: a finished turn's KV stays pinned in the prefix cache for the next turn.

Contract: ``Sessions(cache, idle_s, max_pinned_pages, clock)``. ``pin(session_id, match, t)``
locks ``match`` (the cached path of the turn's prompt + generated ids) until ``t + idle_s`` or
until the session's next turn takes it (``take``); a session pinned again replaces its old pin.
Pinned pages are bounded by ``max_pinned_pages``, each distinct device page counted once however
many sessions pin it (a common system prompt's pages are shared; a shared page counts until the
last session holding it is unpinned): beyond it the least recently pinned sessions are unpinned
first. ``pinned_pages`` is that count. ``expire(now)`` unpins the sessions idle past
``idle_s``. ``take(session_id) -> paused_at | None`` unpins a session for its next turn (whose
own match then locks the path) and returns when it was pinned (for the trace's pause phase).
``clear()`` forgets every pin (after an engine fault the cache itself is cleared). Unpinned
pages stay cached, only evictable. A next turn is matched on token ids, never on re-rendered text.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

from serving.prefix_cache import Match, PrefixCache


@dataclasses.dataclass(frozen=True)
class SessionPolicy:
  idle_s: float = 300.0  # how long a paused session's KV stays pinned
  max_pinned_pages: int = 256  # pinned pages over all sessions

  def __post_init__(self):
    if self.idle_s <= 0 or self.max_pinned_pages < 0:
      raise ValueError(f"bad session policy {self}")


@dataclasses.dataclass
class _Pin:
  match: Match
  at: float


class Sessions:
  def __init__(self, cache: PrefixCache, policy: SessionPolicy,
               clock: Callable[[], float] = time.monotonic):
    self.cache = cache
    self.policy = policy
    self.clock = clock
    self._pins: collections.OrderedDict[str, _Pin] = collections.OrderedDict()
    self._held: collections.Counter[object] = collections.Counter()  # device node -> its pins
    self.unpinned_for_budget = 0
    self.expired = 0

  @property
  def pinned_pages(self) -> int:
    return len(self._held)

  def __contains__(self, session_id: str) -> bool:
    return session_id in self._pins

  def pin(self, session_id: str, match: Match, t: float | None = None) -> None:
    self.take(session_id)
    self.cache.lock(match)
    self._pins[session_id] = _Pin(match, self.clock() if t is None else t)
    self._held.update(match.nodes)
    while self.pinned_pages > self.policy.max_pinned_pages and self._pins:
      _, old = self._pins.popitem(last=False)
      self._unpin(old)
      self.unpinned_for_budget += 1

  def take(self, session_id: str) -> float | None:
    pin = self._pins.pop(session_id, None)
    if pin is None:
      return None
    self._unpin(pin)
    return pin.at

  def _unpin(self, pin: _Pin) -> None:
    self.cache.unlock(pin.match)
    for n in pin.match.nodes:
      if self._held[n] <= 1:
        self._held.pop(n, None)
      else:
        self._held[n] -= 1

  def expire(self, now: float | None = None) -> None:
    now = self.clock() if now is None else now
    for sid in [s for s, p in self._pins.items() if now - p.at > self.policy.idle_s]:
      self.take(sid)
      self.expired += 1

  def clear(self) -> None:
    self._pins.clear()
    self._held.clear()
