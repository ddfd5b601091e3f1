"""Does a cost model rank layouts as the measurements do, within the measurements' own noise?

Contract: a program is ``Timed(reps_s, predicted_s)``: every timed call of it (seconds) and a
prediction. A program's measured band is the range of its calls, [fastest, slowest]. Two
programs are *resolved* when their bands do not overlap: the measurements order them beyond
their own repetition noise; otherwise they are a tie at the measured resolution. ``reproduced(first, second)`` counts how many resolved pairs keep their
order in a second run: the test of a band (``launch.lab.sweep_noise``). (Measured on
this project's CPUs, BUILD_NOTES "Partitioning sweep, calibration and frontier": of the pairs a sweep resolves with the
full range, 95% keep their order in a second sweep; with the narrower [fastest, median] band,
77%, so a narrower band claims orderings the machine does not reproduce.) ``judge(programs)`` returns a ``Ranking``: of the resolved pairs, how many
the predictions order the same way; and whether the predicted fastest program (the planner's
pick) is the measured fastest or unresolved from it (``pick_within_noise``). Programs without a
prediction are left out; a program with one timed call has a zero-width range. Pure Python.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class Timed:
  reps_s: tuple[float, ...]
  predicted_s: float | None


@dataclasses.dataclass(frozen=True)
class Ranking:
  pairs: int  # pairs of predicted programs
  resolved: int  # pairs whose measured bands do not overlap
  agree: int  # resolved pairs the predictions order the same way
  pick_within_noise: bool | None  # None: nothing predicted

  @property
  def rate(self) -> float | None:
    return self.agree / self.resolved if self.resolved else None


def band(calls: Sequence[float]) -> tuple[float, float]:
  """[fastest, slowest] of a program's timed calls."""
  return min(calls), max(calls)


def resolved(a: Sequence[float], b: Sequence[float]) -> bool:
  """Whether the measured bands of ``a`` and ``b`` are disjoint."""
  (lo_a, hi_a), (lo_b, hi_b) = band(a), band(b)
  return max(lo_a, lo_b) > min(hi_a, hi_b)


def judge(programs: Sequence[Timed]) -> Ranking:
  timed = [p for p in programs if p.predicted_s is not None and p.reps_s]
  if not timed:
    return Ranking(0, 0, 0, None)
  pairs = res = agree = 0
  for a, b in itertools.combinations(timed, 2):
    pairs += 1
    if resolved(a.reps_s, b.reps_s):
      res += 1
      # A predicted tie does not order a resolved pair: it counts as a disagreement.
      agree += (a.predicted_s != b.predicted_s
                and (min(a.reps_s) < min(b.reps_s)) == (a.predicted_s < b.predicted_s))
  best = min(timed, key=lambda p: min(p.reps_s))
  pick = min(timed, key=lambda p: p.predicted_s)
  return Ranking(pairs, res, agree, pick is best or not resolved(pick.reps_s, best.reps_s))


def reproduced(first: Sequence[Sequence[float]], second: Sequence[float],
               narrow: bool = False) -> tuple[int, int]:
  """Pairs the calls of one run resolve (``first[i]``: program i's calls), and how many of them
  keep their order in a second run (``second[i]``: program i's best time there). ``narrow``
  judges with the [fastest, median] band instead of the full range, for comparison."""
  def bands_apart(a: Sequence[float], b: Sequence[float]) -> bool:
    if not narrow:
      return resolved(a, b)
    return max(min(a), min(b)) > min(statistics.median(a), statistics.median(b))
  res = same = 0
  for i, j in itertools.combinations(range(len(first)), 2):
    if bands_apart(first[i], first[j]):
      res += 1
      same += (min(first[i]) < min(first[j])) == (second[i] < second[j])
  return res, same


__all__ = ["Timed", "Ranking", "band", "resolved", "judge", "reproduced"]
