"""Host-side page allocator for paged KV memory (pure Python / numpy; the device arrays are
``models.paged_kv.PagedKV``).

Contract:
  * A ``PageBudget`` fixes the pool at start-up: ``num_shards`` sub-pools (one per
    attention-batch shard) of ``pages_per_shard`` pages of ``page_size`` positions, each page K
    and V of every layer; the allocator never hands out more, so KV memory stays in the budget.
    Page ids are global: shard ``s`` owns ``[s * pages_per_shard, (s + 1) * pages_per_shard)``.
  * A sequence (any hashable id) lives in one sub-pool; position ``p`` is slot ``p % page_size``
    of page ``table(seq)[p // page_size]``, at most ``max_pages_per_seq`` pages.
  * ``allocate`` / ``extend`` / ``fork`` return None (or ``Forked``) or a ``Refusal`` and then
    change nothing: ``capacity`` (past the page table: stop it as ``length``), ``budget`` (more
    than its sub-pool holds: reject or stop it), ``no_pages`` (full now: preempt or wait).
    Misuse (unknown or duplicate id, negative counts) raises ``ValueError``.
  * Pages are reference-counted: shared prefix pages are full, hence never written again, and
    ``retain`` / ``drop`` are references held outside any sequence (the prefix cache's).
    ``check()`` verifies the invariants; ``usage()`` gives used / cached / free per sub-pool.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Literal, Sequence

import numpy as np

from models.config import ModelConfig
from models.paged_kv import page_bytes, ring_entries

RefusalKind = Literal["capacity", "budget", "no_pages"]


@dataclasses.dataclass(frozen=True)
class Refusal:
  """Why pages were not given: ``kind`` for the scheduler, ``message`` for the user."""
  kind: RefusalKind
  message: str


@dataclasses.dataclass(frozen=True)
class PageCopy:
  """Device copy to perform for a fork: page ``src`` -> page ``dst`` (every layer, K and V)."""
  src: int
  dst: int


@dataclasses.dataclass(frozen=True)
class Forked:
  child: Hashable
  copy: PageCopy | None  # None when the parent's last page was full (nothing to copy)


@dataclasses.dataclass(frozen=True)
class ShardUsage:
  shard: int
  used: int
  free: int
  total: int
  cached: int = 0


@dataclasses.dataclass(frozen=True)
class PageBudget:
  """The KV memory of a deployment, fixed at start-up (``bytes_per_page`` = 2 * L * K *
  page_size * H * itemsize, from the model config and KV dtype)."""
  page_size: int
  pages_per_shard: int
  num_shards: int = 1
  bytes_per_page: int = 0

  def __post_init__(self):
    if self.page_size < 1 or self.pages_per_shard < 1 or self.num_shards < 1:
      raise ValueError(f"page_size, pages_per_shard and num_shards must be >= 1: {self}")

  @property
  def num_pages(self) -> int:
    return self.pages_per_shard * self.num_shards

  @property
  def bytes(self) -> int:
    return self.num_pages * self.bytes_per_page


def page_budget(cfg: ModelConfig, dtype: str | np.dtype | type, page_size: int, *,
                budget_bytes: int | None = None, num_pages: int | None = None,
                num_shards: int = 1) -> PageBudget:
  """A budget of ``num_pages`` pages in all, or as many as ``budget_bytes`` holds (rounded down
  to whole pages per sub-pool); exactly one of the two."""
  if (budget_bytes is None) == (num_pages is None):
    raise ValueError("give exactly one of budget_bytes and num_pages")
  per_page = page_bytes(cfg, page_size, dtype)
  if budget_bytes is not None:
    per_shard = budget_bytes // num_shards // per_page
  else:
    if num_pages % num_shards:  # type: ignore[operator]  # exactly one of the two is given
      raise ValueError(f"num_pages={num_pages} is not a multiple of num_shards={num_shards}")
    per_shard = num_pages // num_shards  # type: ignore[operator]  # as above
  if per_shard < 1:
    raise ValueError(f"the KV budget holds no page per shard (a page is {per_page} bytes, "
                     f"{num_shards} shards)")
  return PageBudget(page_size, per_shard, num_shards, per_page)


@dataclasses.dataclass
class _Seq:
  shard: int
  pages: list[int]
  tokens: int
  ring: int = 0  # > 0: a ring sequence of exactly this many pages


class PagePool:
  """Page pool with per-shard free lists, reference counts and a page table per sequence."""

  def __init__(self, budget: PageBudget, max_seq_tokens: int):
    if max_seq_tokens < 1:
      raise ValueError("max_seq_tokens must be >= 1")
    self.budget = budget
    self.page_size = budget.page_size
    self.max_seq_tokens = max_seq_tokens
    self.max_pages_per_seq = -(-max_seq_tokens // budget.page_size)
    self._ref = np.zeros(budget.num_pages, np.int32)
    self._retained = np.zeros(budget.num_pages, np.int32)  # references outside any sequence
    # LIFO free lists: the most recently freed page is reused first; page s * P_s first.
    self._free = [list(range((s + 1) * budget.pages_per_shard - 1, s * budget.pages_per_shard - 1,
                             -1)) for s in range(budget.num_shards)]
    self._seqs: dict[Hashable, _Seq] = {}

  # -- queries ------------------------------------------------------------------------------

  def pages_for(self, n_tokens: int) -> int:
    return -(-n_tokens // self.page_size)

  def can_ever_fit(self, n_tokens: int, ring: int = 0) -> Refusal | None:
    """The arrival check: None, or the ``capacity`` / ``budget`` refusal a sequence of
    ``n_tokens`` positions (or a ring of ``ring`` pages) would certainly meet."""
    if ring:
      if ring > self.max_pages_per_seq:
        return Refusal("capacity", f"a window needing {ring} KV pages exceeds a sequence's "
                       f"page table of {self.max_pages_per_seq}")
      if ring > self.budget.pages_per_shard:
        return Refusal("budget", f"a window needing {ring} KV pages exceeds a shard's KV "
                       f"budget of {self.budget.pages_per_shard}")
      return None
    if n_tokens > self.max_seq_tokens:
      return Refusal("capacity", f"{n_tokens} positions exceed a sequence's capacity of "
                     f"{self.max_seq_tokens} ({self.max_pages_per_seq} pages x "
                     f"{self.page_size})")
    if self.pages_for(n_tokens) > self.budget.pages_per_shard:
      return Refusal("budget", f"{n_tokens} positions need {self.pages_for(n_tokens)} KV pages; "
                     f"a shard's KV budget holds {self.budget.pages_per_shard}")
    return None

  def __contains__(self, seq: Hashable) -> bool:
    return seq in self._seqs

  @property
  def sequences(self) -> tuple[Hashable, ...]:
    return tuple(self._seqs)

  def table(self, seq: Hashable) -> tuple[int, ...]:
    return tuple(self._get(seq).pages)

  def tokens(self, seq: Hashable) -> int:
    return self._get(seq).tokens

  def shard_of(self, seq: Hashable) -> int:
    return self._get(seq).shard

  def refcount(self, page: int) -> int:
    return int(self._ref[page])

  def retained_only(self, page: int) -> bool:
    """``page`` is held, and only by ``retain``ed references (no sequence): dropping them
    frees it (what ``usage`` counts as ``cached``)."""
    return bool(0 < self._ref[page] == self._retained[page])

  def usage(self) -> tuple[ShardUsage, ...]:
    """Per sub-pool: ``used`` pages (held by a sequence), ``cached`` (held only by retained
    references: reclaimable), ``free``."""
    n = self.budget.pages_per_shard
    only = (self._ref > 0) & (self._ref == self._retained)  # retained_only, for every page
    out = []
    for s, f in enumerate(self._free):
      cached = int(only[s * n:(s + 1) * n].sum())
      out.append(ShardUsage(s, n - len(f) - cached, len(f), n, cached))
    return tuple(out)

  @property
  def pages_used(self) -> int:
    """Pages a sequence holds (shared ones once); cached-only pages are not counted."""
    return sum(u.used for u in self.usage())

  @property
  def pages_cached(self) -> int:
    return sum(u.cached for u in self.usage())

  @property
  def pages_free(self) -> int:
    return sum(u.free for u in self.usage())

  def page_table(self, seqs: Sequence[Hashable | None], *, local: bool = False) -> np.ndarray:
    """``[len(seqs), max_pages_per_seq]`` int32 device page table (None: an empty slot). Unused
    entries hold the null page (the addressed pool's size: out of range, so the device scatter
    drops writes there). ``local``: ids within each sequence's sub-pool, as a step running
    inside ``shard_map`` addresses them (the page axis is sharded like the batch)."""
    null = self.budget.pages_per_shard if local else self.budget.num_pages
    out = np.full((len(seqs), self.max_pages_per_seq), null, np.int32)
    for row, seq in enumerate(seqs):
      if seq is None:
        continue
      s = self._get(seq)
      base = s.shard * self.budget.pages_per_shard if local else 0
      out[row, :len(s.pages)] = np.asarray(s.pages, np.int32) - base
    return out

  # -- changes ------------------------------------------------------------------------------

  def allocate(self, seq: Hashable, n_tokens: int, shard: int | None = None,
               prefix: Sequence[int] = (), ring: int = 0) -> Refusal | None:
    """Creates ``seq`` with ``n_tokens`` positions in ``shard`` (None: the sub-pool with the
    most free pages), starting on the whole ``prefix`` pages it shares (their references go
    up), then fresh pages. ``ring`` > 0 (attention sinks): exactly ``ring`` private pages from
    the first step whatever its length (the device wraps positions past ``ring * page_size``
    onto pages 1..ring-1), so ``extend`` only counts its tokens; no prefix, no fork."""
    if seq in self._seqs:
      raise ValueError(f"sequence {seq!r} already holds pages")
    if n_tokens < 0:
      raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    if len(prefix) * self.page_size > n_tokens:
      raise ValueError(f"a prefix of {len(prefix)} pages is more than {n_tokens} positions")
    if shard is None:
      shard = max(range(self.budget.num_shards), key=lambda s: (len(self._free[s]), -s))
    elif not 0 <= shard < self.budget.num_shards:
      raise ValueError(f"shard {shard} not in [0, {self.budget.num_shards})")
    n = self.budget.pages_per_shard
    for page in prefix:
      if not (shard * n <= page < (shard + 1) * n and self._ref[page] > 0):
        raise ValueError(f"prefix page {page} is not a live page of shard {shard}")
    if ring and (prefix or ring < 2):
      raise ValueError("a ring sequence takes no prefix and needs at least 2 pages")
    refusal = self.can_ever_fit(n_tokens, ring)
    if refusal:
      return refusal
    need = (ring or self.pages_for(n_tokens)) - len(prefix)
    if need > len(self._free[shard]):
      return self._no_pages(shard, need)
    for page in prefix:
      self._ref[page] += 1
    self._seqs[seq] = _Seq(shard, list(prefix) + self._take(shard, need), n_tokens, ring)
    return None

  def retain(self, pages: Sequence[int]) -> None:
    """Takes a reference to live ``pages`` outside any sequence (``drop`` gives it back)."""
    for page in pages:
      if self._ref[page] < 1:
        raise ValueError(f"retain of free page {page}")
      self._ref[page] += 1
      self._retained[page] += 1

  def drop(self, pages: Sequence[int]) -> list[int]:
    """Gives back retained references; returns the pages that became free."""
    freed = []
    n = self.budget.pages_per_shard
    for page in pages:
      if self._retained[page] < 1:
        raise ValueError(f"drop of page {page}, which is not retained")
      self._retained[page] -= 1
      self._ref[page] -= 1
      if self._ref[page] == 0:
        self._free[page // n].append(page)
        freed.append(page)
    return freed

  def extend(self, seq: Hashable, n_new: int) -> Refusal | None:
    """Reserves ``n_new`` more positions (before the step that writes them)."""
    s = self._get(seq)
    if n_new < 0:
      raise ValueError(f"n_new must be >= 0, got {n_new}")
    total = s.tokens + n_new
    if s.ring:
      s.tokens = total
      return None
    refusal = self.can_ever_fit(total)
    if refusal:
      return Refusal(refusal.kind, f"sequence {seq!r} at {s.tokens} positions cannot take "
                     f"{n_new} more: {refusal.message}")
    need = self.pages_for(total) - len(s.pages)
    if need > len(self._free[s.shard]):
      return self._no_pages(s.shard, need)
    s.pages.extend(self._take(s.shard, need))
    s.tokens = total
    return None

  def shrink(self, seq: Hashable, n_tokens: int) -> list[int]:
    """Gives back the positions of ``seq`` from ``n_tokens`` on (speculative decoding's rejected
    draft ids); returns the pages that became free (its last pages, once empty)."""
    s = self._get(seq)
    if not 0 <= n_tokens <= s.tokens:
      raise ValueError(f"cannot shrink {seq!r} from {s.tokens} to {n_tokens} positions")
    s.tokens = n_tokens
    if s.ring:
      return []
    freed = []
    while len(s.pages) > self.pages_for(n_tokens):
      page = s.pages.pop()
      self._ref[page] -= 1
      if self._ref[page] == 0:
        self._free[s.shard].append(page)
        freed.append(page)
    return freed

  def fork(self, parent: Hashable, child: Hashable) -> Forked | Refusal:
    """``child`` becomes a copy of ``parent`` (once its positions are written), in the same
    sub-pool: the full pages are shared, a partly filled last page is copied now into a fresh
    one (``Forked.copy``, for ``models.paged_kv.copy_pages`` before either writes again), so
    copy-on-write happens once, at the fork."""
    p = self._get(parent)
    if p.ring:
      raise ValueError(f"ring sequence {parent!r} cannot be forked")
    if child in self._seqs:
      raise ValueError(f"sequence {child!r} already holds pages")
    full = p.tokens // self.page_size
    partial = len(p.pages) > full
    if partial and not self._free[p.shard]:
      return self._no_pages(p.shard, 1)
    pages = list(p.pages[:full])
    for page in pages:
      self._ref[page] += 1
    copy = None
    if partial:
      dst = self._take(p.shard, 1)[0]
      copy = PageCopy(src=p.pages[full], dst=dst)
      pages.append(dst)
    self._seqs[child] = _Seq(p.shard, pages, p.tokens)
    return Forked(child, copy)

  def release(self, seq: Hashable) -> list[int]:
    """Drops ``seq``; returns the pages that became free (shared ones stay with the others)."""
    s = self._seqs.pop(seq, None)
    if s is None:
      raise ValueError(f"unknown sequence {seq!r}")
    freed = []
    for page in reversed(s.pages):
      self._ref[page] -= 1
      if self._ref[page] == 0:
        self._free[s.shard].append(page)
        freed.append(page)
    return freed

  # -- invariants ---------------------------------------------------------------------------

  def check(self) -> None:
    """Raises ``AssertionError`` unless: every page's count equals its page-table references
    plus the retained ones; the free lists hold no duplicate, no used page, and with the used
    pages cover the pool; a sequence's pages are its sub-pool's, cover its tokens exactly (a
    ring: exactly its ring, private) and fit its capacity; a partly filled last page is private."""
    n, z = self.budget.pages_per_shard, self.page_size
    refs = np.zeros_like(self._ref)
    for seq, s in self._seqs.items():
      if s.ring:
        assert len(s.pages) == s.ring and all(self._ref[p] == 1 for p in s.pages), (seq, s)
      else:
        assert len(s.pages) == self.pages_for(s.tokens), (seq, len(s.pages), s.tokens)
      assert len(s.pages) <= self.max_pages_per_seq, (seq, len(s.pages))
      assert len(set(s.pages)) == len(s.pages), (seq, s.pages)
      for page in s.pages:
        assert s.shard * n <= page < (s.shard + 1) * n, (seq, page, s.shard)
        refs[page] += 1
      if s.tokens % z and not s.ring:  # the partly filled last page is written again: private
        assert self._ref[s.pages[-1]] == 1, (seq, s.pages[-1], int(self._ref[s.pages[-1]]))
    refs += self._retained
    assert np.array_equal(refs, self._ref), np.nonzero(refs != self._ref)
    for shard, free in enumerate(self._free):
      assert len(set(free)) == len(free), ("duplicate free page", shard)
      assert all(shard * n <= p < (shard + 1) * n for p in free), ("foreign free page", shard)
      used = {p for p in range(shard * n, (shard + 1) * n) if self._ref[p] > 0}
      assert used.isdisjoint(free), ("free page in use", shard, used & set(free))
      assert len(used) + len(free) == n, ("lost pages", shard, n - len(used) - len(free))

  # -- internals ----------------------------------------------------------------------------

  def _get(self, seq: Hashable) -> _Seq:
    try:
      return self._seqs[seq]
    except KeyError:
      raise ValueError(f"unknown sequence {seq!r}") from None

  def _take(self, shard: int, k: int) -> list[int]:
    free = self._free[shard]
    pages = [free.pop() for _ in range(k)]
    for page in pages:
      assert self._ref[page] == 0, page
      self._ref[page] = 1
    return pages

  def _no_pages(self, shard: int, need: int) -> Refusal:
    return Refusal("no_pages", f"shard {shard} has {len(self._free[shard])} free KV pages, "
                   f"{need} needed")


__all__ = ["PagePool", "PageBudget", "page_budget", "Refusal", "PageCopy", "Forked",
           "ShardUsage", "ring_entries"]
