"""Paired differences with bootstrap intervals, and the rule that turns them into a verdict.

Contract: both configs answer the same requests, so a metric's change is estimated by resampling
requests, keeping each request's A and B values together: ``paired_change(metric, xs_a, xs_b,
groups, stat, rng, ...)`` takes aligned value arrays (one entry per request ok in both configs) and
each request's group (its repeat: the runs at different times), resamples the groups with
replacement and then the requests within each chosen group (``n_boot`` times), and gives the
2.5th-97.5th percentiles of the relative change ``(B - A) / A`` as the interval: with repeats, a
drift of the machine between runs widens it; with one run, it is the requests' sampling noise only.
A change is ``better`` / ``worse`` only when its interval excludes 0 AND its point estimate is at
least ``min_effect`` (relative) that way AND the metric has the samples it needs (``min_samples``: a
quantile q needs ``5 / (1 - q)`` requests, so p50 10, p90 50, p99 500: a tail claimed from fewer
requests is only their maximum); otherwise ``same`` ("no measurable change"), with ``note`` saying
why when samples were short. ``lower_is_better`` says which way is better. ``run_change`` does the
same for a metric that exists per run only (a throughput), resampling the paired runs (repeats): one
run gives no interval. ``verdict(changes)``: ``faster`` (some better, none worse), ``slower`` (some
worse, none better), ``mixed``, or ``no measurable change``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

Stat = Callable[[np.ndarray], float]


def min_samples(q: float) -> int:
  return int(np.ceil(5 / (1 - q) - 1e-9))


def quantile(q: float) -> Stat:
  """Nearest-rank quantile (the load generator's)."""
  def f(xs: np.ndarray) -> float:
    s = np.sort(xs)
    return float(s[max(0, int(np.ceil(q * len(s))) - 1)])
  return f


def total(xs: np.ndarray) -> float:
  return float(np.sum(xs))


@dataclasses.dataclass(frozen=True)
class Change:
  metric: str
  a: float
  b: float
  rel: float         # (b - a) / a
  lo: float          # the interval of rel
  hi: float
  lower_is_better: bool
  call: str          # better | worse | same
  n: int = 0         # paired samples
  note: str = ""

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def _call(rel: float, lo: float, hi: float, lower_is_better: bool, min_effect: float) -> str:
  up = lo > 0 and rel >= min_effect
  down = hi < 0 and rel <= -min_effect
  if not (up or down):
    return "same"
  return "better" if down == lower_is_better else "worse"


def paired_change(metric: str, xs_a: np.ndarray, xs_b: np.ndarray, groups: np.ndarray,
                  stat: Stat, rng: np.random.Generator, *, n_boot: int = 1000,
                  min_effect: float = 0.05, lower_is_better: bool = True, need: int = 1,
                  scale_a: float = 1.0, scale_b: float = 1.0) -> Change:
  """``stat(xs) * scale`` per config (``scale``: e.g. 1 / wall time for a rate); ``need``: the
  samples the stat needs before a change may be called."""
  xs_a, xs_b = np.asarray(xs_a, np.float64), np.asarray(xs_b, np.float64)
  groups = np.asarray(groups)
  if not (len(xs_a) == len(xs_b) == len(groups)) or not len(xs_a):
    raise ValueError(f"{metric}: paired arrays must be non-empty and aligned")
  a, b = stat(xs_a) * scale_a, stat(xs_b) * scale_b
  rel = (b - a) / a if a else 0.0
  members = [np.flatnonzero(groups == g) for g in np.unique(groups)]
  rels = np.empty(n_boot)
  for i in range(n_boot):
    picked = rng.integers(0, len(members), len(members))
    idx = np.concatenate([m[rng.integers(0, len(m), len(m))] for m in
                          (members[j] for j in picked)])
    sa = stat(xs_a[idx]) * scale_a
    rels[i] = (stat(xs_b[idx]) * scale_b - sa) / sa if sa else 0.0
  lo, hi = (float(x) for x in np.percentile(rels, [2.5, 97.5]))
  if len(xs_a) < need:
    return Change(metric, a, b, rel, lo, hi, lower_is_better, "same", len(xs_a),
                  f"{len(xs_a)} samples, {need} needed to call it")
  return Change(metric, a, b, rel, lo, hi, lower_is_better,
                _call(rel, lo, hi, lower_is_better, min_effect), len(xs_a))


def run_change(metric: str, a_runs: np.ndarray, b_runs: np.ndarray, rng: np.random.Generator,
               *, n_boot: int = 1000, min_effect: float = 0.05,
               lower_is_better: bool = False) -> Change:
  """A metric that exists per run only (a throughput: tokens over the run's wall time): the
  change of the runs' means, its interval from resampling the paired runs; one run gives no
  interval and is never called."""
  a_runs, b_runs = np.asarray(a_runs, np.float64), np.asarray(b_runs, np.float64)
  a, b = float(a_runs.mean()), float(b_runs.mean())
  rel = (b - a) / a if a else 0.0
  if len(a_runs) < 2:
    return Change(metric, a, b, rel, rel, rel, lower_is_better, "same", 1,
                  "one run: no interval")
  idx = rng.integers(0, len(a_runs), (n_boot, len(a_runs)))
  rels = b_runs[idx].mean(axis=1) / a_runs[idx].mean(axis=1) - 1
  lo, hi = (float(x) for x in np.percentile(rels, [2.5, 97.5]))
  return Change(metric, a, b, rel, lo, hi, lower_is_better,
                _call(rel, lo, hi, lower_is_better, min_effect), len(a_runs))


def verdict(changes: list[Change]) -> str:
  calls = {c.call for c in changes}
  if "better" in calls and "worse" in calls:
    return "mixed"
  if "better" in calls:
    return "faster"
  if "worse" in calls:
    return "slower"
  return "no measurable change"
