"""Speculative decoding's proposers: draft ids a step verifies on the target model in one call.

Contract: a ``Proposer`` has ``k`` (the most draft ids a row carries) and ``propose(tokens, k)
-> tuple[int, ...]``: at most ``k`` ids to continue the context ``tokens`` (prompt and generated
ids so far), ``()`` when it has none. A proposal is a deterministic function of the context: the
engine accepts a draft id exactly where the target, sampling that position with the key it
uses without speculation (``serving.sampling``: seed and position), draws that id, and emits
the target's own id at the first miss. For a deterministic proposer this is speculative
sampling's rule (accept with probability p(d), else draw from p without d, renormalized) with
the same random numbers as plain decoding, so speculation keeps the target's ids themselves,
greedy or sampled, up to the numerics of a k+1-token call against a one-token one.
  * ``NgramProposer(k, max_n=4, min_n=1, window=4096)``: prompt lookup (vLLM's ``ngram``): the
    longest suffix of ``max_n`` down to ``min_n`` ids that also occurs earlier in the last
    ``window`` ids of the context; the ids that followed its latest earlier occurrence.
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
from typing import Protocol, Sequence

import numpy as np

from serving.request import Request
from serving.sampling import SamplingParams


# SmolLM2 bf16 on an AMD EPYC Zen 4: k = 4 gains up to 4 rows (20 tokens a call), loses at 8;
# k = 7 gains at 2 rows (16), loses at 4 (32).
AUTO_VERIFY_TOKENS = 20


def auto_max_rows(k: int) -> int:
  return max(1, AUTO_VERIFY_TOKENS // (k + 1))


class Proposer(Protocol):
  @property
  def k(self) -> int: ...

  def propose(self, tokens: Sequence[int], k: int) -> tuple[int, ...]: ...


@dataclasses.dataclass(frozen=True)
class NgramProposer:
  """Prompt lookup; see the module contract."""
  k: int
  max_n: int = 4
  min_n: int = 1
  window: int = 4096

  def __post_init__(self):
    if self.k < 1 or not 1 <= self.min_n <= self.max_n or self.window < 2:
      raise ValueError(f"n-gram proposer needs k >= 1, 1 <= min_n <= max_n, window >= 2: {self}")

  def propose(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
    k = min(k, self.k)
    if k < 1 or len(tokens) < self.min_n + 1:
      return ()
    ctx = np.asarray(tokens[-self.window:], np.int64)
    for n in range(min(self.max_n, len(ctx) - 1), self.min_n - 1, -1):
      # Windows that end before the last id: each has at least one id after it.
      windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
      hits = np.flatnonzero((windows == ctx[-n:]).all(axis=1))
      if hits.size:
        start = int(hits[-1]) + n
        return tuple(int(t) for t in ctx[start:start + k])
    return ()


def verifiable(s: SamplingParams) -> bool:
  """Sampling the verify call computes in full: no penalties, bias, grammar or logprobs."""
  return not (s.penalized or s.logit_bias or s.grammar is not None or s.logprobs)


def speculable(req: Request) -> bool:
  return req.speculate and verifiable(req.sampling) and req.sinks is None




@dataclasses.dataclass
class SpecCounts:
  """Running totals (vLLM's ``spec_decode`` counters): rows that carried draft ids, the ids
  proposed, those accepted, and accepted ones by draft position (0: the first draft id)."""
  drafts: int = 0
  draft_tokens: int = 0
  accepted_tokens: int = 0
  accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

  def record(self, proposed: int, accepted: int) -> None:
    self.drafts += 1
    self.draft_tokens += proposed
    self.accepted_tokens += accepted
    if len(self.accepted_per_pos) < proposed:
      self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
    for i in range(accepted):
      self.accepted_per_pos[i] += 1


__all__ = ["Proposer", "NgramProposer", "SpecCounts", "speculable", "verifiable", "auto_max_rows",
           "AUTO_VERIFY_TOKENS"]
