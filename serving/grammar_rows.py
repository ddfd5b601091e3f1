"""The engine's structured-output rows: one matcher per constrained slot, the masks of a call.

Contract: ``GrammarRows(vocab, max_rows)`` is owned by the engine (one step at a time, one
thread).
  * ``setup(slot, request_id, compiled, output_ids)``: the slot now runs ``request_id``; with a
    grammar (``serving.grammar.CompiledGrammar``) it gets a fresh matcher that has accepted
    ``output_ids`` (a request resumed after preemption continues where it was), without one the
    slot is unconstrained.
  * ``active``: some slot is constrained (else the engine skips all of this).
  * ``masks(rows) -> (mask_RW, on_R) | None``: for a call of ``R`` rows, ``rows`` the
    ``(request_id, slot, row)`` of the rows that sample, the allowed-token bitmask of each
    constrained one (``serving.token_mask`` layout) and which rows apply it; None when none is
    constrained (``none(R)``: the all-off pair, cached). Call it only once every earlier step's
    ids were given to ``accept``.
  * ``accept(tokens)``: a step's sampled ids (request id -> id; each step once, in order)
    advance the matchers of the requests their slots still run; the others are skipped (a request that finished while its
    last step was in flight). An id a matcher refuses (only possible for an id sampled without
    its mask) ends constraining that slot, logged.
  * ``constrained(rows)``: some ``(request_id, slot)`` of a coming call is constrained (the
    engine then reads the steps in flight, and ``accept``s their ids, before ``masks``).
"""

from __future__ import annotations

import logging
import time
from typing import Mapping, Sequence

import numpy as np

from serving.grammar import CompiledGrammar, Matcher
from serving.token_mask import words

_log = logging.getLogger(__name__)


class GrammarRows:
  def __init__(self, vocab: int):
    self.words = words(vocab)
    self._slots: dict[int, tuple[str, Matcher]] = {}
    self._none: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    self.mask_seconds = 0.0  # host time filling masks (BUILD_NOTES: per-step overhead)

  @property
  def active(self) -> bool:
    return bool(self._slots)

  def setup(self, slot: int, request_id: str, compiled: CompiledGrammar | None,
            output_ids: Sequence[int] = ()) -> None:
    self._slots.pop(slot, None)
    if compiled is None:
      return
    m = compiled.matcher()
    for t in output_ids:
      if not m.accept(t):
        _log.error("request %s: its generated ids do not fit its grammar (%s); unconstrained",
                   request_id, m.error())
        return
    self._slots[slot] = (request_id, m)

  def constrained(self, rows: Sequence[tuple[str, int]]) -> bool:
    return any(self._slots.get(slot, ("",))[0] == rid for rid, slot in rows)

  def none(self, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """An unconstrained call's masks (all off): one read-only pair per row count, reused."""
    got = self._none.get(num_rows)
    if got is None:
      got = (np.zeros((num_rows, self.words), np.int32), np.zeros((num_rows,), bool))
      for a in got:
        a.setflags(write=False)
      self._none[num_rows] = got
    return got

  def masks(self, rows: Sequence[tuple[str, int, int]], num_rows: int
            ) -> tuple[np.ndarray, np.ndarray] | None:
    mine = [(row, self._slots[slot][1]) for rid, slot, row in rows
            if self._slots.get(slot, ("",))[0] == rid]
    if not mine:
      return None
    t0 = time.perf_counter()
    mask_RW = np.zeros((num_rows, self.words), np.int32)
    on_R = np.zeros((num_rows,), bool)
    for row, m in mine:
      m.fill(mask_RW[row])
      on_R[row] = True
    self.mask_seconds += time.perf_counter() - t0
    return mask_RW, on_R

  def accept(self, tokens: Mapping[str, int]) -> None:
    if not self._slots:
      return
    for slot, (rid, m) in list(self._slots.items()):
      tok = tokens.get(rid)
      if tok is None:
        continue
      if m.is_terminated():
        continue  # eos or the grammar's end was accepted: later ids are discarded anyway
      if not m.accept(tok):
        _log.error("request %s: id %d is outside its grammar (%s); unconstrained from here",
                   rid, tok, m.error())
        del self._slots[slot]
