"""Prefix caches over the page pool (RadixAttention): whole KV pages of earlier sequences, reused.

Contract: ``BasePrefixCache`` is the interface the KV manager (``serving.kv_manager``) drives;
``PrefixCache`` is the radix tree, ``NullPrefixCache`` (SGLang's ``ChunkCache``) caches nothing.
  * The tree works at page granularity, one tree per sub-pool: an edge is one page's
    ``page_size`` token ids, a node holds that page's KV (given the path above it) and one pool
    reference (``PagePool.retain`` / ``drop``), so a cached page outlives its writer.
  * ``match`` finds the longest cached path and always leaves the last token to compute;
    ``insert`` caches written pages; a running sequence ``lock``s the path it reuses, and
    ``evict`` only removes unlocked leaves held by nothing but the cache, least recently used
    first. ``reclaimable(shard)`` counts what ``evict`` could free now.
  * Host tier (``host_pages`` > 0, Mooncake's DRAM tier): an evicted page goes to host memory
    while the tier has room (its own LRU), keeping its place in the tree; device nodes form the
    top of a path, host nodes hang below. The device copies to plan come from ``take_spills``,
    the loads back from ``promote``, the host keys to drop from ``take_forgotten``. ``adopt``
    adds host nodes for pages computed elsewhere (KV sent by a prefill process).
  * Namespaces: ``ns`` > 0 (a LoRA adapter's uid: its KV differs from the base model's) keys
    a separate tree under the same root; 0 is the base model's.
  * Counters (hits, misses, evictions, spills, loads) are plain ints; ``check()`` verifies the
    tree's invariants. Pure host bookkeeping: no JAX.
"""

from __future__ import annotations

import abc
import dataclasses
import heapq
import itertools
from typing import Sequence

from serving.kv_pages import PagePool


@dataclasses.dataclass(frozen=True)
class PageSpill:
  """Device page -> host tier entry ``key`` (planned before the page is written again)."""
  page: int
  key: int


@dataclasses.dataclass(frozen=True)
class PageLoad:
  """Host tier entry ``key`` -> device page ``page`` (planned before the step reading it)."""
  key: int
  page: int


@dataclasses.dataclass(eq=False)
class _Node:
  key: tuple[int, ...]
  page: int | None  # None: the page is in the host tier under ``host_key``
  parent: "_Node | None"
  children: dict[tuple[int, ...], "_Node"] = dataclasses.field(default_factory=dict)
  locks: int = 0
  used: int = 0  # last access tick
  host_key: int | None = None


@dataclasses.dataclass(frozen=True)
class Match:
  shard: int
  nodes: tuple[_Node, ...]  # on the device
  host: tuple[_Node, ...] = ()  # then in the host tier

  @property
  def pages(self) -> tuple[int, ...]:
    return tuple(n.page for n in self.nodes)  # type: ignore[misc]  # device nodes hold a page

  def tokens(self, page_size: int) -> int:
    return (len(self.nodes) + len(self.host)) * page_size


class BasePrefixCache(abc.ABC):
  """What the KV manager asks of a prefix cache (see the module contract)."""
  enabled: bool = True  # False: the null cache (no prefix caching)
  page_size: int = 0
  host_capacity = pages = host_pages_used = 0
  hits = misses = hit_tokens = evicted = 0
  host_hits = host_hit_tokens = spilled = loaded = host_evicted = adopted = 0

  @abc.abstractmethod
  def match(self, tokens: Sequence[int], shard: int, *, count: bool = True, ns: int = 0
            ) -> Match:
    """The longest cached path of whole pages covering ``tokens`` on ``shard``, never all of
    them (the last token is left to compute: its logits start decoding), so at most
    ``(len - 1) // page_size`` pages: the device part, then the host part. ``count=False``: not
    counted (``record`` counts it once it is used)."""

  @abc.abstractmethod
  def record(self, m: Match | None) -> None:
    """Counts one lookup (``None``: a miss) and marks its path used now."""

  @abc.abstractmethod
  def best_shard(self, tokens: Sequence[int], ns: int = 0) -> int | None:
    """The sub-pool holding the longest cached prefix of ``tokens`` (None: no hit anywhere)."""

  @abc.abstractmethod
  def reclaimable(self, shard: int) -> int:
    """Pages of ``shard`` that ``evict`` could free now."""

  @abc.abstractmethod
  def insert(self, tokens: Sequence[int], pages: Sequence[int], shard: int, ns: int = 0
             ) -> int:
    """Caches the whole pages of ``tokens`` (``pages[i]`` holds positions ``[i Z, (i+1) Z)``,
    written, or written by a step planned before any step that reads them); a block already
    cached keeps its page (the caller's stays private). Returns the pages newly cached."""

  def adopt(self, tokens: Sequence[int], shard: int, ns: int = 0) -> list[tuple[int, int]]:
    """Host-tier nodes for the whole pages of ``tokens`` the tree does not hold yet (KV computed
    by another process): ``(i, key)`` per new node, ``i`` the page's index in ``tokens``; the
    caller puts that page's data in the host store under ``key``. Stops at the first page the
    host tier has no room for; none without a host tier."""
    return []

  @abc.abstractmethod
  def lock(self, m: Match) -> None:
    """Keeps ``m``'s path from eviction until ``unlock`` (locks count)."""

  @abc.abstractmethod
  def unlock(self, m: Match) -> None: ...

  @abc.abstractmethod
  def evict(self, shard: int, n: int) -> int:
    """Frees up to ``n`` pages of ``shard``; returns how many."""

  @abc.abstractmethod
  def promote(self, node: _Node, page: int) -> PageLoad:
    """Host node -> device ``page``; returns the load to plan."""

  @abc.abstractmethod
  def take_spills(self) -> tuple[PageSpill, ...]:
    """The device -> host copies of the pages evicted since the last call."""

  @abc.abstractmethod
  def take_forgotten(self) -> list[int]:
    """The host keys dropped since the last call (the engine's store discards them)."""

  @abc.abstractmethod
  def clear(self) -> None:
    """Drops every node (after an engine fault: pages a failed step wrote must not be reused)."""

  @abc.abstractmethod
  def check(self) -> None:
    """Verifies the cache's own invariants (raises ``AssertionError``)."""


class NullPrefixCache(BasePrefixCache):
  """Caches nothing (prefix caching off): every lookup misses, nothing is held or evicted."""
  enabled = False

  def match(self, tokens: Sequence[int], shard: int, *, count: bool = True, ns: int = 0
            ) -> Match:
    return Match(shard, ())

  def record(self, m: Match | None) -> None:
    pass

  def best_shard(self, tokens: Sequence[int], ns: int = 0) -> int | None:
    return None

  def reclaimable(self, shard: int) -> int:
    return 0

  def insert(self, tokens: Sequence[int], pages: Sequence[int], shard: int, ns: int = 0
             ) -> int:
    return 0

  def lock(self, m: Match) -> None:
    pass

  def unlock(self, m: Match) -> None:
    pass

  def evict(self, shard: int, n: int) -> int:
    return 0

  def promote(self, node: _Node, page: int) -> PageLoad:
    raise ValueError("the null prefix cache holds no host page")

  def take_spills(self) -> tuple[PageSpill, ...]:
    return ()

  def take_forgotten(self) -> list[int]:
    return []

  def clear(self) -> None:
    pass

  def check(self) -> None:
    pass


class PrefixCache(BasePrefixCache):
  """The radix tree (SGLang's ``RadixCache``); see the module contract."""

  def __init__(self, pool: PagePool, host_pages: int = 0):
    self.pool = pool
    self.page_size = pool.page_size
    self.host_capacity = host_pages
    self._roots = [_Node((), -1, None) for _ in range(pool.budget.num_shards)]
    self._tick = itertools.count(1)
    self._keys = itertools.count(1)
    self._spills: list[PageSpill] = []
    self.forgotten: list[int] = []  # host keys dropped; the engine's store discards them
    self.pages = 0
    self.host_pages_used = 0
    self.hits = self.misses = self.hit_tokens = self.evicted = 0
    self.host_hits = self.host_hit_tokens = self.spilled = self.loaded = self.host_evicted = 0
    self.adopted = 0  # host pages that arrived from another process (``adopt``)

  def _blocks(self, tokens: Sequence[int], n: int, ns: int) -> list[tuple[int, ...]]:
    """Edge keys: a page's ids each; the first led by ``-ns`` in a namespace (ids are >= 0)."""
    z = self.page_size
    out = [tuple(tokens[i * z:(i + 1) * z]) for i in range(n)]
    if ns and out:
      out[0] = (-ns,) + out[0]
    return out

  def match(self, tokens: Sequence[int], shard: int, *, count: bool = True, ns: int = 0
            ) -> Match:
    node, path = self._roots[shard], []
    for key in self._blocks(tokens, (len(tokens) - 1) // self.page_size, ns):
      child = node.children.get(key)
      if child is None:
        break
      node = child
      path.append(node)
    dev = [n for n in path if n.page is not None]
    m = Match(shard, tuple(dev), tuple(path[len(dev):]))
    if count:
      self.record(m)
    return m

  def record(self, m: Match | None) -> None:
    """Counts one lookup (``None``: a miss) and marks its path used now: what ``match`` does
    unless ``count=False`` (a caller that may retry the same lookup counts it once, on use)."""
    if m is None or not (m.nodes or m.host):
      self.misses += 1
      return
    tick = next(self._tick)
    for n in m.nodes + m.host:
      n.used = tick
    self.hits += 1
    self.hit_tokens += (len(m.nodes) + len(m.host)) * self.page_size
    if m.host:
      self.host_hits += 1
      self.host_hit_tokens += len(m.host) * self.page_size

  def reclaimable(self, shard: int) -> int:
    """Pages of ``shard`` that ``evict`` could free now: on the device, unlocked, and held by
    nothing but the cache (a session's pin or a running sequence's match locks a path; a page a
    running sequence still holds frees nothing when dropped)."""
    return sum(1 for x in self._walk(self._roots[shard]) if self._droppable(x))

  def _droppable(self, x: _Node) -> bool:
    """On the device, unlocked, and dropping it frees its page (no sequence holds it)."""
    return x.page is not None and not x.locks and self.pool.retained_only(x.page)

  def promote(self, node: _Node, page: int) -> PageLoad:
    """Host node -> device ``page`` (a page the caller holds; the cache retains it too)."""
    if node.page is not None or node.host_key is None:
      raise ValueError("promote of a node that is not in the host tier")
    key, node.host_key, node.page = node.host_key, None, page
    self.pool.retain([page])
    self.pages += 1
    self.host_pages_used -= 1
    self.loaded += 1
    return PageLoad(key, page)

  def take_spills(self) -> tuple[PageSpill, ...]:
    out, self._spills = tuple(self._spills), []
    return out

  def take_forgotten(self) -> list[int]:
    out, self.forgotten = self.forgotten, []
    return out

  def best_shard(self, tokens: Sequence[int], ns: int = 0) -> int | None:
    """The sub-pool holding the longest cached prefix of ``tokens`` (None: no hit anywhere)."""
    best, best_len = None, 0
    for s in range(len(self._roots)):
      m = self.match(tokens, s, count=False, ns=ns)
      k = len(m.nodes) + len(m.host)
      if k > best_len:
        best, best_len = s, k
    return best

  def insert(self, tokens: Sequence[int], pages: Sequence[int], shard: int, ns: int = 0
             ) -> int:
    n = min(len(tokens) // self.page_size, len(pages))
    node, added, tick = self._roots[shard], 0, next(self._tick)
    for key, page in zip(self._blocks(tokens, n, ns), pages):
      child = node.children.get(key)
      if child is None:
        child = _Node(key, page, node)
        node.children[key] = child
        self.pool.retain([page])
        self.pages += 1
        added += 1
      elif child.page is None:  # in the host tier: the caller's page is the same KV
        self.pool.retain([page])
        self.forgotten.append(child.host_key)  # type: ignore[arg-type]  # a host node has a key
        child.page, child.host_key = page, None
        self.pages += 1
        self.host_pages_used -= 1
      child.used = tick
      node = child
    return added

  def adopt(self, tokens: Sequence[int], shard: int, ns: int = 0) -> list[tuple[int, int]]:
    root = node = self._roots[shard]
    path, out, tick = [], [], next(self._tick)
    for i, key in enumerate(self._blocks(tokens, len(tokens) // self.page_size, ns)):
      child = node.children.get(key)
      if child is None:
        if not self.host_capacity or not self._host_room(root):  # locked: not forgotten
          break
        host_key = next(self._keys)
        child = _Node(key, None, node, host_key=host_key)
        node.children[key] = child
        self.host_pages_used += 1
        self.adopted += 1
        out.append((i, host_key))
      child.used, child.locks = tick, child.locks + 1
      path.append(child)
      node = child
    for x in path:
      x.locks -= 1
    return out

  def lock(self, m: Match) -> None:
    for n in m.nodes + m.host:
      n.locks += 1

  def unlock(self, m: Match) -> None:
    for n in m.nodes + m.host:
      if n.locks < 1:
        raise ValueError("unlock of an unlocked prefix")
      n.locks -= 1

  def evict(self, shard: int, n: int) -> int:
    """Frees up to ``n`` pages of ``shard`` by dropping unlocked leaves, oldest first. A leaf
    whose page a running sequence still holds is kept: dropping it would free nothing now and
    lose the prefix (and, with a host tier, copy out a page that is still in use)."""
    root = self._roots[shard]
    device_leaf = lambda x: (self._droppable(x) and
                             all(c.page is None for c in x.children.values()))
    leaves = [(x.used, id(x), x) for x in self._walk(root) if device_leaf(x)]
    heapq.heapify(leaves)
    freed = 0
    while leaves and freed < n:
      _, _, x = heapq.heappop(leaves)
      page, parent = x.page, x.parent
      self.pages -= 1
      self.evicted += 1
      if self.host_capacity and self._host_room(root):
        x.host_key, x.page = next(self._keys), None  # to the host tier, in place
        self._spills.append(PageSpill(page, x.host_key))
        self.host_pages_used += 1
        self.spilled += 1
      else:
        self._forget(x)
      freed += len(self.pool.drop([page]))
      if parent is not None and parent is not root and device_leaf(parent):
        heapq.heappush(leaves, (parent.used, id(parent), parent))
    return freed

  def _forget(self, x: _Node) -> None:
    """Drops ``x`` and everything below it (all in the host tier) from the tree."""
    del x.parent.children[x.key]  # type: ignore[union-attr]  # only the roots have no parent
    for y in [x, *self._walk(x)]:
      if y.host_key is not None:
        self.forgotten.append(y.host_key)
        self.host_pages_used -= 1
        self.host_evicted += 1

  def _host_room(self, root: _Node) -> bool:
    """Room for one more host page, forgetting the oldest unlocked host leaves if needed."""
    while self.host_pages_used >= self.host_capacity:
      leaves = [x for r in self._roots for x in self._walk(r)
                if x.page is None and not x.children and not x.locks]
      if not leaves:
        return False
      self._forget(min(leaves, key=lambda x: x.used))
    return True

  def clear(self) -> None:
    for shard, root in enumerate(self._roots):
      nodes = list(self._walk(root))
      pages = [x.page for x in nodes if x.page is not None]
      self.pool.drop(pages)
      self.pages -= len(pages)
      self.forgotten += [x.host_key for x in nodes if x.host_key is not None]
      self.host_pages_used -= sum(x.host_key is not None for x in nodes)
      self._roots[shard] = _Node((), -1, None)
    self._spills = []

  def _walk(self, root: _Node):
    stack = list(root.children.values())
    while stack:
      x = stack.pop()
      yield x
      stack.extend(x.children.values())

  def check(self) -> None:
    seen = host = 0
    for shard, root in enumerate(self._roots):
      n = self.pool.budget.pages_per_shard
      for x in self._walk(root):
        assert len(x.key) == self.page_size, x.key
        assert x.locks >= 0
        if x.locks:
          assert x.parent is root or x.parent.locks >= x.locks, "a locked node's parent is locked"
        if x.page is None:
          host += 1
          assert x.host_key is not None, "a node is on the device or in the host tier"
          continue
        seen += 1
        assert x.host_key is None
        assert x.parent is root or x.parent.page is not None, "a device node's parent is too"
        assert shard * n <= x.page < (shard + 1) * n, (x.page, shard)
        assert self.pool.refcount(x.page) >= 1, x.page
    assert seen == self.pages, (seen, self.pages)
    assert host == self.host_pages_used <= max(self.host_capacity, 0), (host, self.host_pages_used)


__all__ = ["BasePrefixCache", "PrefixCache", "NullPrefixCache", "Match", "PageSpill", "PageLoad"]
