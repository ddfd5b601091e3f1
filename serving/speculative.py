"""Speculative decoding's proposers: draft ids a step verifies on the target model in one call.

Contract: a ``Proposer`` has ``k`` (the most draft ids a row carries) and ``draft(queries)``:
for each ``DraftQuery`` (a sequence's key, its context ``tokens``: prompt and generated ids so
far, and ``k``) at most ``k`` ids to continue the context, ``()`` when it has none; all of a
step's rows in one call. ``forget(key)``: the sequence ended (state kept for it may go).
``warmup(threads)`` / ``seal()``: its programs compiled before readiness, then closed (a draft
model's; none for lookup). ``describe()``: what ``/v1/status`` shows of it.
A proposal is a deterministic function of the context: the
engine accepts a draft id exactly where the target, sampling that position with the key it
uses without speculation (``serving.sampling``: seed and position), draws that id, and emits
the target's own id at the first miss. For a deterministic proposer this is speculative
sampling's rule (accept with probability p(d), else draw from p without d, renormalized) with
the same random numbers as plain decoding, so speculation keeps the target's ids themselves,
greedy or sampled, up to the numerics of a k+1-token call against a one-token one.
  * ``NgramProposer(k, max_n=4, min_n=1, window=4096)``: prompt lookup (vLLM's ``ngram``): the
    longest suffix of ``max_n`` down to ``min_n`` ids that also occurs earlier in the last
    ``window`` ids of the context; the ids that followed an earlier occurrence of it: the first
    at or after the key's copy pointer (where the ids its last proposal copied and the target
    accepted end: a rewrite copies its source in order), else the latest. A suffix shorter
    than ``min_n`` (down to one id) counts only where it continues at most ``NEAR`` ids past
    the pointer (a copy resuming after an edit). With ``word_start`` (``word_starts(tok)``) and
    no suffix found, a sequence whose drafts were mostly accepted skips the source word at the
    pointer (the target wrote its own word there) and copies from the next word start.
    ``ContextProposer`` is the base of proposers that read each context alone;
    ``serving.draft_model.DraftModelProposer``: a second model's greedy continuation.
  * ``speculable(request)``: whether a request's rows may carry drafts: not opted out
    (``Request.speculate``), and nothing the verify call leaves out (penalties, logit bias, a
    grammar, logprobs, attention sinks).
  * ``SpecCounts``: the proposed and accepted totals the scheduler keeps.
  * ``auto_max_rows(k)``: the decoding sequences up to which speculation pays, measured: while a
    step's verify call holds at most ``AUTO_VERIFY_TOKENS`` tokens (BUILD_NOTES, "Speculative
    decoding").
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol, Sequence

import numpy as np

from models.text.tokenizer import Tokenizer
from serving.request import Request
from serving.sampling import SamplingParams


# SmolLM2 bf16: on an AMD EPYC Zen 4 k = 4 gained up to 4 rows (20 tokens a call), lost at 8;
# on an Intel Xeon (AMX) batch 32 ran 0.95-0.98x of plain drafting in its tail at 4 rows, 1.00x
# at 2 (each flushed step loses the lag's overlap): 10 tokens, 2 rows at k = 4.
AUTO_VERIFY_TOKENS = 10
# A suffix shorter than the n-gram proposer's min_n counts only where its continuation starts
# at most this many ids past the copy pointer (bench_spec's four tasks: better on each than min_n
# 1 or 2 alone).
NEAR = 16
# The word skip (an edit: the target wrote its own word where the copy was): the source resumes
# at the next word start within SKIP_MAX ids of the pointer, while the sequence's drafts were
# accepted at least SKIP_GATE of the time (counting a prior of SKIP_PRIOR accepted / proposed);
# measured on bench_spec's tasks (BUILD_NOTES, "Speculative decoding").
SKIP_MAX = 8
SKIP_GATE = 0.4
SKIP_PRIOR = (16, 8)  # (proposed, accepted)

_log = logging.getLogger(__name__)


def auto_max_rows(k: int) -> int:
  return max(1, AUTO_VERIFY_TOKENS // (k + 1))


@dataclasses.dataclass(frozen=True)
class DraftQuery:
  key: str  # the sequence (its request id): a proposer may keep state per key
  tokens: Sequence[int]  # its context: prompt and generated ids
  k: int  # the most ids wanted (>= 1)


class Proposer(Protocol):
  @property
  def k(self) -> int: ...

  def draft(self, queries: Sequence[DraftQuery]) -> list[tuple[int, ...]]: ...

  def forget(self, key: str) -> None: ...

  def warmup(self, threads: int | None = None) -> int: ...

  def seal(self) -> None: ...

  def describe(self) -> dict[str, object]: ...


class ContextProposer:
  """A proposer that reads each context alone (no state kept, no program): ``propose(tokens,
  k)`` per row."""
  k: int

  def propose(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
    raise NotImplementedError

  def draft(self, queries: Sequence[DraftQuery]) -> list[tuple[int, ...]]:
    return [self.propose(q.tokens, q.k) for q in queries]

  def forget(self, key: str) -> None:
    pass

  def warmup(self, threads: int | None = None) -> int:
    return 0

  def seal(self) -> None:
    pass

  def describe(self) -> dict[str, object]:
    return {"method": type(self).__name__, "num_speculative_tokens": self.k}


@dataclasses.dataclass(frozen=True)
class _Copy:
  """What the n-gram proposer last proposed for a key: the context's length then, the ids,
  where in the context they were copied from (-1: no pointer), and the key's running totals of
  ids proposed and accepted (the word skip's gate)."""
  length: int
  ids: tuple[int, ...]
  source: int
  proposed: int = 0
  accepted: int = 0


def word_starts(tokenizer: Tokenizer) -> np.ndarray:
  """bool [vocab]: the ids whose text starts a word (a space, a line break or punctuation
  first); what the n-gram proposer's word skip resumes a copy at."""
  out = np.zeros((tokenizer.vocab_size,), bool)
  for i in range(tokenizer.vocab_size):
    b = tokenizer.token_bytes(i)
    out[i] = bool(b) and b[:1] in _WORD_START
  return out


_WORD_START = {bytes([c]) for c in b" \n\t.,;:!?()[]{}\"'`-"}


@dataclasses.dataclass(frozen=True)
class NgramProposer(ContextProposer):
  """Prompt lookup with a copy pointer; see the module contract."""
  k: int
  max_n: int = 4
  min_n: int = 1
  window: int = 4096
  word_start: np.ndarray | None = None  # word_starts(tokenizer): turns the word skip on
  _copies: dict[str, _Copy] = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def __post_init__(self):
    if self.k < 1 or not 1 <= self.min_n <= self.max_n or self.window < 2:
      raise ValueError(f"n-gram proposer needs k >= 1, 1 <= min_n <= max_n, window >= 2: {self}")

  def propose(self, tokens: Sequence[int], k: int, after: int | None = None) -> tuple[int, ...]:
    return self._lookup(tokens, k, after)[0]

  def _lookup(self, tokens: Sequence[int], k: int, after: int | None
              ) -> tuple[tuple[int, ...], int]:
    """(draft ids, the context index they start at); ``after``: prefer the earliest occurrence
    whose continuation starts there or later (a rewrite copies its source in order), else the
    latest."""
    k = min(k, self.k)
    if k < 1 or len(tokens) < 2:
      return (), -1
    ctx = np.asarray(tokens[-self.window:], np.int64)
    offset = len(tokens) - len(ctx)
    shortest = 1 if after is not None else self.min_n
    for n in range(min(self.max_n, len(ctx) - 1), shortest - 1, -1):
      # Windows that end before the last id: each has at least one id after it.
      windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
      starts = np.flatnonzero((windows == ctx[-n:]).all(axis=1)) + n
      ahead = starts[starts >= after - offset] if after is not None else starts[:0]
      if n < self.min_n and after is not None:  # too short to trust anywhere: just ahead
        starts = ahead = ahead[ahead <= after - offset + NEAR]  # of the copy only
      if starts.size:
        start = int(ahead[0] if ahead.size else starts[-1])
        return tuple(int(t) for t in ctx[start:start + k]), offset + start
    return (), -1

  def draft(self, queries: Sequence[DraftQuery]) -> list[tuple[int, ...]]:
    out = []
    for q in queries:
      last = self._copies.get(q.key) or _Copy(0, (), -1, *SKIP_PRIOR)
      after, acc = None, 0
      if last.source >= 0 and len(q.tokens) > last.length:
        got = q.tokens[last.length:last.length + len(last.ids)]
        acc = next((i for i, (a, b) in enumerate(zip(got, last.ids)) if a != b), len(got))
        after = last.source + acc  # the source id after the last one the target copied
      proposed, accepted = last.proposed + len(last.ids), last.accepted + acc
      ids, source = self._lookup(q.tokens, q.k, after)
      if not ids and after is not None and accepted >= SKIP_GATE * proposed:
        ids, source = self._skip_word(q.tokens, min(q.k, self.k), after)
      # No proposal keeps the pointer where it was (the copy resumes once a suffix recurs).
      self._copies[q.key] = _Copy(len(q.tokens), ids, source if ids else
                                  (after if after is not None else -1), proposed, accepted)
      out.append(ids)
    return out

  def _skip_word(self, tokens: Sequence[int], k: int, after: int
                 ) -> tuple[tuple[int, ...], int]:
    """The source past the word at the pointer: the target wrote its own word there (an edit),
    the copy resumes at the next word start within ``SKIP_MAX`` ids."""
    if self.word_start is None:
      return (), -1
    for j in range(after + 1, min(after + SKIP_MAX, len(tokens) - 1)):
      t = tokens[j]
      if 0 <= t < len(self.word_start) and self.word_start[t]:
        return tuple(int(x) for x in tokens[j:j + k]), j
    return (), -1

  def forget(self, key: str) -> None:
    self._copies.pop(key, None)

  def describe(self) -> dict[str, object]:
    return {"method": "ngram", "num_speculative_tokens": self.k, "prompt_lookup_max": self.max_n,
            "prompt_lookup_min": self.min_n}


def propose(proposer: Proposer, queries: Sequence[DraftQuery], counts: SpecCounts
            ) -> dict[str, tuple[int, ...]] | None:
  """The drafts by key, at most each query's ``k``; None when the proposer raised (logged and
  counted: speculation should go off, the step decodes plainly)."""
  if not queries:
    return {}
  try:
    got = proposer.draft(queries)
  except Exception:
    _log.exception("the speculative proposer failed: decoding without drafts from now on")
    counts.failures += 1
    return None
  return {q.key: tuple(d[:q.k]) for q, d in zip(queries, got)}


def verifiable(s: SamplingParams) -> bool:
  """Sampling the verify call computes in full: no penalties, bias, grammar or logprobs."""
  return not (s.penalized or s.logit_bias or s.grammar is not None or s.logprobs)


def speculable(req: Request) -> bool:
  return req.speculate and verifiable(req.sampling) and req.sinks is None


@dataclasses.dataclass
class SpecCounts:
  """Running totals (vLLM's ``spec_decode`` counters): rows that carried draft ids, the ids
  proposed, those accepted, and accepted ones by draft position (0: the first draft id); and
  proposer failures."""
  drafts: int = 0
  draft_tokens: int = 0
  accepted_tokens: int = 0
  accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
  failures: int = 0  # proposer calls that raised (speculation then off: serving.scheduler)

  def record(self, proposed: int, accepted: int) -> None:
    self.drafts += 1
    self.draft_tokens += proposed
    self.accepted_tokens += accepted
    if len(self.accepted_per_pos) < proposed:
      self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
    for i in range(accepted):
      self.accepted_per_pos[i] += 1


__all__ = ["ContextProposer", "DraftQuery", "Proposer", "NgramProposer", "propose", "SpecCounts",
           "word_starts",
           "speculable", "verifiable", "auto_max_rows", "AUTO_VERIFY_TOKENS"]
