"""A stand-in engine with hand-checkable outputs, for scheduler tests and offline dry runs.

Contract: ``FakeEngine(num_pages, page_size, vocab, max_slots, lag=0, host_store=None)`` is an
``serving.engine_api.EngineApi`` without programs (``warmup`` compiles nothing). It executes
``StepPlan``s on a host "device memory" of pages holding token ids, through the plan's page
table, exactly as the real engine addresses KV pages. The next id of a sequence is
``next_id(context, seed, vocab)``, a function of every (position, id) of the context read back
through the page table, so a page handed to two live sequences, a lost write or a stale table
changes the output. ``reference(prompt, seed, n, vocab)`` is the same computation without pages.
With a ``host_store`` it runs the plan's host-tier spills (the page is then scribbled over, so a
load that did not happen shows), forgets and loads. ``lag`` = 1 returns each step's result one
step late (the real engine's asynchronous token copy); ``flush()`` returns what is still held.
A decode row's draft ids (speculative decoding) are written after its last id and accepted while
each is the id ``next_id`` gives there.
"""

from __future__ import annotations

import collections

import numpy as np

from serving.engine_api import EngineApi
from serving.host_tier import HostStore
from serving.kv_pages import PageCopy
from serving.scheduler import StepPlan, StepResult


def next_id(context: list[int] | np.ndarray, seed: int, vocab: int) -> int:
  ctx = np.asarray(context, np.int64)
  weights = np.arange(1, len(ctx) + 1, dtype=np.int64)
  return int((int(np.sum(ctx * weights)) * 2654435761 + seed * 97 + len(ctx)) % vocab)


def reference(prompt: list[int], seed: int, n: int, vocab: int) -> list[int]:
  ctx = list(prompt)
  for _ in range(n):
    ctx.append(next_id(ctx, seed, vocab))
  return ctx[len(prompt):]


class FakeEngine(EngineApi):
  def __init__(self, num_pages: int, page_size: int, vocab: int, max_slots: int, lag: int = 0,
               host_store: HostStore | None = None):
    self.host_store = host_store  # for plans with spills / loads
    self.page_size = page_size
    self.vocab = vocab
    self.pages = np.full((num_pages, page_size), -1, np.int64)
    self.last = np.full(max_slots, -1, np.int64)  # each slot's last sampled id ("on device")
    self.seed = np.zeros(max_slots, np.int64)
    self._lag = lag
    self._held: collections.deque[StepResult] = collections.deque()
    self.steps = 0
    self.copied = 0  # plan page copies run

  def _write(self, table_M: np.ndarray, pos: int, tok: int) -> None:
    page = table_M[pos // self.page_size]
    assert 0 <= page < len(self.pages), f"write at position {pos} has no page"
    self.pages[page, pos % self.page_size] = tok

  def _context(self, table_M: np.ndarray, n: int) -> list[int]:
    out = []
    for pos in range(n):
      page = table_M[pos // self.page_size]
      assert 0 <= page < len(self.pages), f"read at position {pos} has no page"
      out.append(int(self.pages[page, pos % self.page_size]))
    return out

  def execute(self, plan: StepPlan) -> StepResult | None:
    self.steps += 1
    for s in plan.setups:
      self.seed[s.slot] = s.sampling.seed or 0
      self.last[s.slot] = -1
    if plan.spills or plan.forget or plan.loads:
      self._host_tier(plan)
    for c in plan.copies:
      self._copy(c)
    tokens: dict[str, int] = {}
    accepted: dict[str, tuple[int, ...]] = {}
    for row in plan.decode:
      table = plan.page_table[row.slot]
      assert self.last[row.slot] >= 0, "decode of a slot without a sampled id"
      self._write(table, row.position, int(self.last[row.slot]))
      for i, d in enumerate(row.draft):  # every draft id is written, as the real engine does
        self._write(table, row.position + 1 + i, d)
      ok: list[int] = []
      while True:  # a draft id is accepted where it is the id this engine computes there
        got = next_id(self._context(table, row.position + 1 + len(ok)),
                      int(self.seed[row.slot]), self.vocab)
        if len(ok) == len(row.draft) or got != row.draft[len(ok)]:
          break
        ok.append(got)
      tokens[row.request_id] = self.last[row.slot] = got
      if ok:
        accepted[row.request_id] = tuple(ok)
    for ch in plan.prefill:
      table = plan.page_table[ch.slot]
      for i, tok in enumerate(ch.token_ids):
        self._write(table, ch.start + i, tok)
      if ch.sample:
        ctx = self._context(table, ch.start + len(ch.token_ids))
        tokens[ch.request_id] = self.last[ch.slot] = next_id(ctx, int(self.seed[ch.slot]),
                                                             self.vocab)
    self._held.append(StepResult(plan.step, tokens, accepted=accepted))
    if len(self._held) > self._lag:
      return self._held.popleft()
    return None

  def _host_tier(self, plan: StepPlan) -> None:
    """The plan's host-tier moves, in its order: out, forget, in."""
    store = self.host_store
    assert store is not None, "a plan with host-tier moves needs a host_store"
    for sp in plan.spills:
      store.put(sp.key, (self.pages[sp.page].copy(),))
      self.pages[sp.page] = -7  # the device page is free now: stale content must not be read
    for key in plan.forget:
      store.discard(key)
    for ld in plan.loads:
      self.pages[ld.page] = store.take(ld.key)[0]

  def _copy(self, c: PageCopy) -> None:
    self.pages[c.dst] = self.pages[c.src]
    self.copied += 1

  def flush(self) -> list[StepResult]:
    out = list(self._held)
    self._held.clear()
    return out

  def reset(self) -> None:
    self._held.clear()

  def warmup(self, max_prefill_rows: int = 1, max_chunk: int | None = None,
             threads: int | None = None, max_tokens: int | None = None) -> int:
    return 0

  def seal(self) -> None:
    pass

  @property
  def programs(self) -> int:
    return 0

  @property
  def lag(self) -> int:
    return self._lag

  def describe(self) -> dict[str, object]:
    return {"kind": "fake", "pages": len(self.pages), "page_size": self.page_size}
