"""Prefix cache (RadixAttention) over the page pool: whole KV pages of earlier sequences, reused.

Contract:
  * The tree is a radix tree at page granularity: an edge is one page's ``page_size`` token ids,
    a node holds the KV page for those positions (given the path above it); one tree per
    sub-pool (a sequence's pages never leave its shard). The cache holds one pool reference per
    node (``PagePool.retain`` / ``drop``), so a cached page outlives the sequence that wrote it.
  * ``match(tokens, shard) -> Match``: the longest cached path of whole pages covering
    ``tokens``, never all of them: at least the last token is left to compute (its logits start
    decoding), so at most ``(len - 1) // page_size`` pages. ``best_shard(tokens)`` is the
    sub-pool with the longest match.
  * ``insert(tokens, pages, shard) -> int``: caches the whole pages of ``tokens`` (``pages[i]``
    holds positions ``[i Z, (i+1) Z)``, already written or written by a step planned before any
    step that reads them); a block already cached keeps its page (the caller's stays private).
    Returns the pages newly cached.
  * ``lock(match)`` / ``unlock(match)``: a running sequence locks the path it reuses; eviction
    only ever removes unlocked leaves, least recently used first (``evict(shard, n)`` frees up to
    ``n`` pages, returns how many). ``clear()`` drops every node (after an engine fault: pages
    written by a failed step must not be reused).
  * Counters: ``hits`` / ``misses`` (lookups), ``hit_tokens``, ``evicted`` pages. ``pages``
    is the number of cached pages; ``check()`` verifies the tree's own invariants.
Pure host bookkeeping: no JAX.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Sequence

from serving.kv_pages import PagePool


@dataclasses.dataclass(eq=False)
class _Node:
  key: tuple[int, ...]
  page: int
  parent: "_Node | None"
  children: dict[tuple[int, ...], "_Node"] = dataclasses.field(default_factory=dict)
  locks: int = 0
  used: int = 0  # last access tick


@dataclasses.dataclass(frozen=True)
class Match:
  shard: int
  nodes: tuple[_Node, ...]

  @property
  def pages(self) -> tuple[int, ...]:
    return tuple(n.page for n in self.nodes)

  def tokens(self, page_size: int) -> int:
    return len(self.nodes) * page_size


class PrefixCache:
  def __init__(self, pool: PagePool):
    self.pool = pool
    self.page_size = pool.page_size
    self._roots = [_Node((), -1, None) for _ in range(pool.budget.num_shards)]
    self._tick = itertools.count(1)
    self.pages = 0
    self.hits = self.misses = self.hit_tokens = self.evicted = 0

  def _blocks(self, tokens: Sequence[int], n: int) -> list[tuple[int, ...]]:
    z = self.page_size
    return [tuple(tokens[i * z:(i + 1) * z]) for i in range(n)]

  def match(self, tokens: Sequence[int], shard: int, *, count: bool = True) -> Match:
    node, path = self._roots[shard], []
    for key in self._blocks(tokens, (len(tokens) - 1) // self.page_size):
      node = node.children.get(key)  # type: ignore[assignment]
      if node is None:
        break
      path.append(node)
    if count:
      tick = next(self._tick)
      for n in path:
        n.used = tick
      if path:
        self.hits += 1
        self.hit_tokens += len(path) * self.page_size
      else:
        self.misses += 1
    return Match(shard, tuple(path))

  def best_shard(self, tokens: Sequence[int]) -> int | None:
    """The sub-pool holding the longest cached prefix of ``tokens`` (None: no hit anywhere)."""
    best, best_len = None, 0
    for s in range(len(self._roots)):
      k = len(self.match(tokens, s, count=False).nodes)
      if k > best_len:
        best, best_len = s, k
    return best

  def insert(self, tokens: Sequence[int], pages: Sequence[int], shard: int) -> int:
    n = min(len(tokens) // self.page_size, len(pages))
    node, added, tick = self._roots[shard], 0, next(self._tick)
    for key, page in zip(self._blocks(tokens, n), pages):
      child = node.children.get(key)
      if child is None:
        child = _Node(key, page, node)
        node.children[key] = child
        self.pool.retain([page])
        self.pages += 1
        added += 1
      child.used = tick
      node = child
    return added

  def lock(self, m: Match) -> None:
    for n in m.nodes:
      n.locks += 1

  def unlock(self, m: Match) -> None:
    for n in m.nodes:
      if n.locks < 1:
        raise ValueError("unlock of an unlocked prefix")
      n.locks -= 1

  def evict(self, shard: int, n: int) -> int:
    """Frees up to ``n`` pages of ``shard`` by dropping unlocked leaves, oldest first; a page
    still used by a running sequence is dropped from the cache but frees nothing."""
    leaves = [(x.used, id(x), x) for x in self._walk(self._roots[shard])
              if not x.children and not x.locks]
    heapq.heapify(leaves)
    freed = 0
    while leaves and freed < n:
      _, _, x = heapq.heappop(leaves)
      parent = x.parent
      del parent.children[x.key]  # type: ignore[union-attr]
      self.pages -= 1
      self.evicted += 1
      freed += len(self.pool.drop([x.page]))
      if parent is not self._roots[shard] and not parent.children and not parent.locks:
        heapq.heappush(leaves, (parent.used, id(parent), parent))
    return freed

  def clear(self) -> None:
    for shard, root in enumerate(self._roots):
      pages = [x.page for x in self._walk(root)]
      self.pool.drop(pages)
      self.pages -= len(pages)
      self._roots[shard] = _Node((), -1, None)

  def _walk(self, root: _Node):
    stack = list(root.children.values())
    while stack:
      x = stack.pop()
      yield x
      stack.extend(x.children.values())

  def check(self) -> None:
    seen = 0
    for shard, root in enumerate(self._roots):
      n = self.pool.budget.pages_per_shard
      for x in self._walk(root):
        seen += 1
        assert len(x.key) == self.page_size, x.key
        assert shard * n <= x.page < (shard + 1) * n, (x.page, shard)
        assert self.pool.refcount(x.page) >= 1, x.page
        assert x.locks >= 0
        if x.locks:
          assert x.parent is root or x.parent.locks >= x.locks, "a locked node's parent is locked"
    assert seen == self.pages, (seen, self.pages)


__all__ = ["PrefixCache", "Match"]
