"""Speculative decoding's draft-model proposer: a second model (smaller, or the target's int8
copy) continues each context greedily over its own paged KV cache.

Contract: ``DraftModelProposer(engine, k, chunk)`` is a ``serving.speculative.Proposer`` over a
draft ``serving.engine.Engine`` (``build_draft``: the draft's step and params, ``slots``
sequences of up to ``context`` ids, greedy, results read once per call):
  * each key (a request id) holds a draft slot, its pages in the proposer's own ``PagePool``
    (its own page table: the target's pages are not shared) and ``have``, the ids whose KV the
    draft wrote, in order;
  * ``draft(queries)``: per query, the context's ids past the longest prefix it shares with
    ``have`` are prefilled (the catch-up: at least the context's last id, whose KV nobody wrote;
    all of a prompt on a key's first call; chunks of at most ``chunk`` ids, a step's chunks at
    most ``chunk`` ids in all), the last chunk sampling the first draft id; then ``k - 1``
    decode steps each sample the next. All rows go through the same steps; the ids come back
    in one read at the end. ``have`` becomes the context and the first ``k - 1`` drafts
    (rejected ones are simply not shared with the next context);
  * a key's state goes with ``forget`` or, when a new key needs a slot, the least recently
    drafted key not in the call gives its own up (its next call starts over);
  * greedy: the drafts are a deterministic function of the context, so the target keeps its
    own ids (``serving.speculative``). The draft must share the target's tokenizer
    (``check_tokenizers``).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import numpy as np

from models.step import Step
from models.text.tokenizer import Tokenizer
from models.weights import Params
from serving.engine import Engine, EngineConfig
from serving.kv_pages import PageBudget, PagePool
from serving.sampling import SamplingParams
from serving.speculative import DraftQuery
from serving.step_plan import DecodeRow, PrefillChunk, SlotSetup, StepPlan

_PAGE = 16  # the draft pool's page size (its own: nothing shared with the target's)
# The most ids a catch-up step prefills: its packed programs are 4, 8, ..., 64 ids (7 to warm,
# not the ~20 of the target's 512-id chunks); a first call's prompt takes a few more steps.
MAX_CATCH_UP = 64


@dataclasses.dataclass(frozen=True)
class DraftModel:
  """A loaded draft: its step (one device, unsharded) and params, and its name for status."""
  step: Step
  params: Params
  name: str


@dataclasses.dataclass
class _Key:
  slot: int
  have: list[int]


def check_tokenizers(target: Tokenizer, draft: Tokenizer) -> None:
  """Raises ValueError unless both tokenizers have one vocabulary (size, EOS, a sample text)."""
  text = "Speculative decoding: draft 12 ids, verify them (x + y)!\n"
  if (target.vocab_size != draft.vocab_size or target.eos_ids != draft.eos_ids
      or target.encode(text) != draft.encode(text)):
    raise ValueError("the draft model must share the target's tokenizer "
                     f"(vocab {draft.vocab_size} vs {target.vocab_size})")


def build_draft(draft: DraftModel, *, k: int, slots: int, context: int, chunk: int,
                valid_vocab: int, kv_dtype: str) -> "DraftModelProposer":
  """A proposer over a fresh draft engine: ``slots`` sequences of ``context`` ids, catch-ups of
  at most ``chunk`` (and ``MAX_CATCH_UP``) ids a step."""
  pages_per_seq = -(-context // _PAGE)
  chunk = min(chunk, MAX_CATCH_UP)
  engine = Engine(draft.step, draft.params, EngineConfig(
      max_slots=slots, num_pages=slots * pages_per_seq, page_size=_PAGE,
      max_seq_tokens=context, kv_dtype=kv_dtype, valid_vocab=valid_vocab,
      lag=k,  # a call's decode steps held: their ids read once, at its end
      min_packed=4))  # a catch-up of one or two ids costs about a decode step, not 16 ids
  return DraftModelProposer(engine, k, chunk, draft.name)


class DraftModelProposer:
  """See the module contract."""

  def __init__(self, engine: Engine, k: int, chunk: int, name: str = "draft"):
    if k < 1 or chunk < 1:
      raise ValueError(f"a draft model needs k >= 1 and chunk >= 1, got {k}, {chunk}")
    self.engine = engine
    self._k = k
    self.chunk = chunk
    self.name = name
    c = engine.config
    self.context = c.max_seq_tokens
    self.pool = PagePool(PageBudget(c.page_size, c.num_pages), max_seq_tokens=c.max_seq_tokens)
    self._keys: collections.OrderedDict[str, _Key] = collections.OrderedDict()  # LRU first
    self._free = list(range(c.max_slots))
    self._step = 0
    self.calls = 0  # draft() calls and the catch-up ids they prefilled (status, tests)
    self.caught_up = 0

  @property
  def k(self) -> int:
    return self._k

  def describe(self) -> dict[str, object]:
    return {"method": "draft_model", "draft_model": self.name, "num_speculative_tokens": self.k,
            "draft_slots": self.engine.config.max_slots}

  def warmup(self, threads: int | None = None) -> int:
    slots = self.engine.config.max_slots
    return self.engine.warmup(slots, self.chunk, threads, self.chunk)

  def seal(self) -> None:
    self.engine.seal()

  def forget(self, key: str) -> None:
    got = self._keys.pop(key, None)
    if got is not None:
      self.pool.release(key)
      self._free.append(got.slot)

  def reset(self) -> None:
    """Every key's state dropped (after a failed call)."""
    for key in list(self._keys):
      self.forget(key)
    self.engine.reset()

  def draft(self, queries: Sequence[DraftQuery]) -> list[tuple[int, ...]]:
    if len(queries) > self.engine.config.max_slots:
      raise ValueError(f"{len(queries)} rows for {self.engine.config.max_slots} draft slots")
    try:
      return self._draft(queries)
    except Exception:
      self.reset()
      raise

  def _draft(self, queries: Sequence[DraftQuery]) -> list[tuple[int, ...]]:
    self.calls += 1
    keys = {q.key for q in queries}
    setups, rows = [], []  # rows: (query index, key state, catch-up start, k)
    for i, q in enumerate(queries):
      n = len(q.tokens)
      k = min(q.k, self.k, self.context - n + 1)  # positions up to n + k - 2 are written
      if k < 1 or n < 1:
        continue
      st = self._keys.get(q.key)
      if st is None:
        st = self._admit(q.key, keys)
        setups.append(SlotSetup(st.slot, q.key, SamplingParams()))  # greedy
      self._keys.move_to_end(q.key)
      start = _shared(st.have, q.tokens)
      need = n + k - 1 - self.pool.tokens(q.key)
      if need > 0:
        refused = self.pool.extend(q.key, need)
        assert refused is None, refused  # a slot's pages hold the whole context
      rows.append((i, st, start, k))
    if not rows:
      return [()] * len(queries)
    table = self.pool.page_table([self._owner(s) for s in range(self.engine.config.max_slots)])
    plans = self._catch_up(queries, rows, table, tuple(setups))
    for j in range(max(k for *_, k in rows) - 1):  # decode: the previous step's id at n + j
      plans.append(self._plan((), tuple(
          DecodeRow(queries[i].key, st.slot, len(queries[i].tokens) + j)
          for i, st, _, k in rows if j < k - 1), table))
    got: dict[str, list[int]] = collections.defaultdict(list)
    results = [r for r in map(self.engine.execute, plans) if r is not None]
    for res in results + self.engine.flush():  # in step order
      for key, tok in res.tokens.items():
        got[key].append(tok)
    out: list[tuple[int, ...]] = [()] * len(queries)
    for i, st, _, k in rows:
      q = queries[i]
      out[i] = tuple(got[q.key][:k])
      st.have = list(q.tokens) + list(out[i][:k - 1])
    return out

  def _catch_up(self, queries: Sequence[DraftQuery], rows: list, table, setups: tuple
                ) -> list[StepPlan]:
    """Prefill plans of every row's ids from its shared prefix on, ``chunk`` ids a step."""
    todo = collections.deque((queries[i].key, st.slot, list(queries[i].tokens[start:]), start)
                             for i, st, start, _ in rows)
    plans: list[StepPlan] = []
    while todo:
      room, chunks = self.chunk, list[PrefillChunk]()
      while todo and room > 0 and len(chunks) < self.engine.config.max_slots:
        key, slot, ids, start = todo.popleft()
        take = ids[:room]
        chunks.append(PrefillChunk(key, slot, tuple(take), start, len(take) == len(ids)))
        self.caught_up += len(take)
        room -= len(take)
        if len(take) < len(ids):
          todo.appendleft((key, slot, ids[len(take):], start + len(take)))
          break
      plans.append(self._plan(tuple(chunks), (), table, setups if not plans else ()))
    return plans

  def _plan(self, prefill: tuple, decode: tuple, table, setups: tuple = ()) -> StepPlan:
    self._step += 1
    return StepPlan(self._step, prefill, decode, setups, table)

  def _admit(self, key: str, keep: set[str]) -> _Key:
    if not self._free:
      victim = next(k for k in self._keys if k not in keep)
      self.forget(victim)
    st = _Key(self._free.pop(), [])
    refused = self.pool.allocate(key, 0)
    assert refused is None, refused
    self._keys[key] = st
    return st

  def _owner(self, slot: int) -> str | None:
    return next((key for key, st in self._keys.items() if st.slot == slot), None)


def _shared(have: Sequence[int], tokens: Sequence[int]) -> int:
  """The length of the prefix ``have`` and ``tokens`` share, at most ``len(tokens) - 1`` (the
  last id is always fed: its KV is what the first draft step writes)."""
  n = min(len(have), len(tokens) - 1)
  differ = np.flatnonzero(np.asarray(have[:n]) != np.asarray(tokens[:n]))
  return int(differ[0]) if differ.size else n


__all__ = ["DraftModel", "DraftModelProposer", "build_draft", "check_tokenizers"]
