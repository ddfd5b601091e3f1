"""The KV manager: the one door between the scheduler and its KV memory (vLLM v1's KVCacheManager).

Contract: ``KVManager(pool, prefix_cache, sessions=, host_store=, cache_generated=)`` holds
the page pool (``serving.kv_pages``), a prefix cache (``serving.prefix_cache``; the null one when
caching is off), the sessions' pins (``serving.sessions``) and the host tier's store
(``serving.host_tier``; its bookkeeping is the cache's). Sequences are named by request id.
  * ``admit`` gives a waiting request pages for its longest cached prefix plus its first chunk,
    or None (nothing changed) when no sub-pool can hold it now; ``extend`` reserves positions
    before the step that writes them; both reclaim cached pages before they give up;
    ``shrink`` gives back positions (speculative decoding's rejected drafts).
  * ``cache`` shares a sequence's written pages; ``finish`` also pins them for the session's next
    turn and frees the rest; ``free`` gives everything back (a preemption, an error).
  * ``take_moves`` hands over the page copies, spills, forgotten host keys and loads planned
    since the last call, for the step plan.
  * ``reclaimable(shard)``: the cached pages that eviction could free there now.
  * Attention-sink sequences (``Request.sinks``) hold a ring of pages and neither use nor feed
    the prefix cache and sessions.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Hashable, Sequence

import numpy as np

from serving.host_tier import HostStore
from serving.kv_pages import PageBudget, PageCopy, PagePool, Refusal, ShardUsage, ring_entries
from serving.prefix_cache import (BasePrefixCache, Match, NullPrefixCache, PageLoad, PageSpill,
                                  PrefixCache)
from serving.request import Request, Sinks
from serving.sessions import SessionPolicy, Sessions


def namespace(req: Request) -> int:
  """The prefix cache's namespace of ``req``'s KV: its LoRA adapter's uid, 0 for the base."""
  return req.lora.uid if req.lora is not None else 0


@dataclasses.dataclass(frozen=True)
class Admission:
  start: int  # positions reused from the cache: the sequence computes from here
  paused_at: float | None = None  # when the session's previous turn ended (None: no pin taken)


@dataclasses.dataclass(frozen=True)
class PageMoves:
  """Device page work for one step plan, in the plan's order (``serving.scheduler.StepPlan``)."""
  copies: tuple[PageCopy, ...] = ()
  spills: tuple[PageSpill, ...] = ()
  forget: tuple[int, ...] = ()
  loads: tuple[PageLoad, ...] = ()


@dataclasses.dataclass
class _Held:
  req: Request
  match: Match | None  # the cached path it reuses, locked while it holds pages


class KVManager:
  """Pages, cached prefixes, session pins and host tier behind one interface; see the module."""

  def __init__(self, pool: PagePool, prefix_cache: BasePrefixCache | None = None, *,
               sessions: Sessions | None = None, host_store: HostStore | None = None,
               cache_generated: bool = True):
    self.pool = pool
    self.prefix_cache: BasePrefixCache = (NullPrefixCache() if prefix_cache is None
                                          else prefix_cache)
    if sessions is not None and sessions.cache is not self.prefix_cache:
      raise ValueError("sessions pin pages of the scheduler's own prefix cache")
    self.sessions = sessions
    self.host_store = host_store
    # False when decode writes another pool than prefill reads: only prompt pages are cached.
    self.cache_generated = cache_generated
    self.prefix_copied_pages = 0  # reused prefix pages copied to another sub-pool
    self._held: dict[Hashable, _Held] = {}
    self._copies: list[PageCopy] = []
    self._loads: list[PageLoad] = []

  # -- queries ----------------------------------------------------------------------------------

  @property
  def page_size(self) -> int:
    return self.pool.page_size

  @property
  def max_seq_tokens(self) -> int:
    return self.pool.max_seq_tokens

  @property
  def caching(self) -> bool:
    """Prefix caching is on (the cache is not the null one)."""
    return self.prefix_cache.enabled

  def __contains__(self, rid: Hashable) -> bool:
    return rid in self._held

  def ring_pages(self, sinks: Sinks | None) -> int:
    """Pages of an attention-sink ring, 0 for a whole-context sequence."""
    return ring_entries(sinks.window, self.page_size) if sinks is not None else 0

  def can_ever_fit(self, n_tokens: int, sinks: Sinks | None = None) -> Refusal | None:
    """The arrival check: the refusal a sequence of ``n_tokens`` positions (with ``sinks``: its
    ring, whatever its length) would certainly meet, or None."""
    if sinks is not None:
      return self.pool.can_ever_fit(0, self.ring_pages(sinks))
    return self.pool.can_ever_fit(n_tokens)

  def shard_of(self, rid: Hashable) -> int:
    return self.pool.shard_of(rid)

  def reclaimable(self, shard: int) -> int:
    """Cached pages of ``shard`` that eviction could free now (not those a session pins or a
    running sequence's match locks, nor those a sequence still holds)."""
    return self.prefix_cache.reclaimable(shard)

  def usage(self) -> tuple[ShardUsage, ...]:
    return self.pool.usage()

  def page_table(self, rids: Sequence[Hashable | None]) -> np.ndarray:
    return self.pool.page_table(rids)

  def cached_prefix(self, tokens: Sequence[int], ns: int = 0) -> int:
    """Tokens of ``tokens`` the cache holds now (an estimate; counts no lookup); ``ns``: the
    namespace (``namespace(req)``)."""
    shard = self.prefix_cache.best_shard(tokens, ns)
    if shard is None:
      return 0
    return self.prefix_cache.match(tokens, shard, count=False, ns=ns).tokens(self.page_size)

  @property
  def host_tier_bytes(self) -> int:
    return self.prefix_cache.host_pages_used * self.pool.budget.bytes_per_page

  # -- admission --------------------------------------------------------------------------------

  def admit(self, req: Request, tokens: Sequence[int], max_new: int, *,
            first: bool = True) -> Admission | None:
    """Pages for ``req`` (its context is ``tokens``: the prompt and any ids generated before a
    preemption): its longest cached prefix of whole pages, reused in place (or copied into
    another sub-pool when its own is full: ``PageMoves.copies``; host-tier pages are loaded
    onto its first fresh pages: ``PageMoves.loads``), then at most ``max_new`` more positions.
    Without a hit it goes to the sub-pool with the most free or reclaimable pages. The lookup
    is counted once, on success. ``first`` (not a re-admission after preemption): the
    session's pin, if any, is taken over by this sequence's own lock."""
    ring = self.ring_pages(req.sinks)
    hit = None if ring else self._lookup(tokens, namespace(req))
    start = self._allocate(req, tokens, max_new, hit, ring)
    if start is None:
      return None
    if not ring:
      self.prefix_cache.record(hit)  # once per admission, however often it had to wait
    paused_at = None
    if self.sessions is not None and req.session_id and first:
      paused_at = self.sessions.take(req.session_id)
    return Admission(start, paused_at)

  def _lookup(self, tokens: Sequence[int], ns: int) -> Match | None:
    shard = self.prefix_cache.best_shard(tokens, ns)
    return None if shard is None else self.prefix_cache.match(tokens, shard, count=False, ns=ns)

  def _room(self, shard: int, usage: tuple[ShardUsage, ...]) -> int:
    """Pages ``shard`` could give a new sequence now: free, or cached and reclaimable."""
    return usage[shard].free + self.prefix_cache.reclaimable(shard)

  def _allocate(self, req: Request, tokens: Sequence[int], max_new: int, hit: Match | None,
                ring: int) -> int | None:
    """Allocates starting on ``hit``'s pages; returns the reused length, None on refusal."""
    rid, cache, pool = req.request_id, self.prefix_cache, self.pool
    start = hit.tokens(pool.page_size) if hit is not None else 0
    total = start + min(max_new, len(tokens) - start)
    if hit is not None:
      shard = hit.shard
      cache.lock(hit)  # never evicted to make room for itself
    else:
      usage = pool.usage()
      shard = max(range(len(usage)), key=lambda s: (self._room(s, usage), -s))
    prefix = hit.pages if hit is not None else ()
    short = (ring or pool.pages_for(total)) - len(prefix) - pool.usage()[shard].free
    if short > 0:
      cache.evict(shard, short)
    refusal = pool.allocate(rid, total, shard, prefix=prefix, ring=ring)
    if refusal is None:
      self._held[rid] = _Held(req, hit)
      if hit is not None and hit.host:  # host-tier pages come back onto its first new pages
        table = pool.table(rid)
        for node, page in zip(hit.host, table[len(prefix):]):
          self._loads.append(cache.promote(node, page))
      return start
    if hit is not None:
      cache.unlock(hit)
      if refusal.kind == "no_pages":  # its sub-pool is full: copy the prefix to another
        copied = self._allocate_copy(req, tokens, max_new, hit)
        return copied if copied is not None else self._allocate(req, tokens, max_new, None, 0)
    return None

  def _allocate_copy(self, req: Request, tokens: Sequence[int], max_new: int,
                     hit: Match) -> int | None:
    """The sub-pool holding ``hit`` is full: start on the sub-pool with the most room, the
    first pages copies of the prefix's device pages (run before the step's writes; the source
    path stays locked while the sequence holds pages; a host part is recomputed)."""
    if not hit.nodes:
      return None
    rid, pool, cache = req.request_id, self.pool, self.prefix_cache
    usage = pool.usage()
    others = [s for s in range(len(usage)) if s != hit.shard]
    if not others:
      return None
    shard = max(others, key=lambda s: (self._room(s, usage), -s))
    device = Match(hit.shard, hit.nodes)
    start = device.tokens(pool.page_size)
    total = start + min(max_new, len(tokens) - start)
    cache.lock(device)
    short = pool.pages_for(total) - usage[shard].free
    if short > 0:
      cache.evict(shard, short)
    if pool.allocate(rid, total, shard) is not None:
      cache.unlock(device)
      return None
    self._copies += [PageCopy(src, dst) for src, dst in zip(device.pages, pool.table(rid))]
    self.prefix_copied_pages += len(device.nodes)
    self._held[rid] = _Held(req, device)
    return start

  # -- running sequences ------------------------------------------------------------------------

  def extend(self, rid: Hashable, n: int) -> Refusal | None:
    """``n`` more positions for a held sequence (``PagePool.extend``'s refusals); cached pages
    of its sub-pool are reclaimed one at a time before it refuses ``no_pages``."""
    while True:
      refusal = self.pool.extend(rid, n)
      if (refusal is None or refusal.kind != "no_pages"
          or not self.prefix_cache.evict(self.pool.shard_of(rid), 1)):
        return refusal

  def shrink(self, rid: Hashable, n: int) -> None:
    """A held sequence now holds ``n`` positions: the pages past them are freed."""
    if rid in self._held:
      self.pool.shrink(rid, n)

  def cache(self, rid: Hashable, tokens: Sequence[int]) -> None:
    """Caches the whole pages of ``tokens``, ids whose KV a step planned earlier writes (cut to
    the positions the sequence holds, and to its prompt unless ``cache_generated``)."""
    held = self._held.get(rid)
    if held is None or held.req.sinks is not None:
      return
    n = min(len(tokens), self.pool.tokens(rid))
    if not self.cache_generated:
      n = min(n, len(held.req.prompt_ids))
    self.prefix_cache.insert(tokens[:n], self.pool.table(rid), self.pool.shard_of(rid),
                             namespace(held.req))

  def finish(self, rid: Hashable, tokens: Sequence[int]) -> None:
    """A sequence ended well with context ``tokens`` (the last id's KV is not written): its
    pages are cached, a session's turn keeps them pinned for the next turn, then ``free``."""
    held = self._held.get(rid)
    if held is not None and held.req.sinks is None:
      self.cache(rid, tokens[:len(tokens) - 1])
      if self.sessions is not None and held.req.session_id:
        self.sessions.pin(held.req.session_id,
                          self.prefix_cache.match(tokens, self.pool.shard_of(rid), count=False,
                                                  ns=namespace(held.req)))
    self.free(rid)

  def free(self, rid: Hashable) -> None:
    """Unlocks the sequence's cached path and releases its pages (nothing for an unknown id)."""
    held = self._held.pop(rid, None)
    if held is None:
      return
    if held.match is not None:
      self.prefix_cache.unlock(held.match)
    self.pool.release(rid)

  # -- steps ------------------------------------------------------------------------------------

  def expire_sessions(self) -> None:
    """Unpins the sessions idle past their policy's time (once per step)."""
    if self.sessions is not None:
      self.sessions.expire()

  def take_moves(self) -> PageMoves:
    copies, self._copies = tuple(self._copies), []
    loads, self._loads = tuple(self._loads), []
    return PageMoves(copies, self.prefix_cache.take_spills(), tuple(self.prefix_cache.take_forgotten()),
                     loads)

  def drop_cached(self) -> None:
    """After an engine fault: pages a failed step was writing must not be reused, so the cache
    and the session pins are emptied (held sequences are ``free``d by their owner)."""
    self.prefix_cache.clear()
    if self.sessions is not None:
      self.sessions.clear()

  def check(self) -> None:
    """The pool's and the cache's invariants (raises ``AssertionError``)."""
    self.pool.check()
    self.prefix_cache.check()
    assert set(self._held) == set(self.pool.sequences), (set(self._held), self.pool.sequences)


def build_kv(budget: PageBudget, max_seq_tokens: int, *, prefix_cache: bool = True,
             host_store: HostStore | None = None, host_pages: int = 0,
             sessions: SessionPolicy | None = None, cache_generated: bool = True,
             clock: Callable[[], float] = time.monotonic) -> KVManager:
  """A fresh pool, prefix cache (the null one when off; a host tier of ``host_pages`` with a
  ``host_store``, which is emptied: a new cache hands out its keys anew) and sessions (with
  the cache and a ``sessions`` policy)."""
  pool = PagePool(budget, max_seq_tokens=max_seq_tokens)
  if host_store is not None:
    host_store.clear()
  cache: BasePrefixCache = NullPrefixCache()
  pins = None
  if prefix_cache:
    real = PrefixCache(pool, host_pages if host_store is not None else 0)
    pins = Sessions(real, sessions, clock) if sessions is not None else None
    cache = real
  return KVManager(pool, cache, sessions=pins, host_store=host_store,
                   cache_generated=cache_generated)


__all__ = ["KVManager", "Admission", "PageMoves", "build_kv"]
