"""The canary's verdict: a candidate's requests against the baseline's over the same window.

Contract: ``group_stats(records, q) -> GroupStats`` summarizes usage records (the JSON lines of
``launch.server --usage_log``, ``serving.api.usage``): requests, ok, refused (status
``rejected``), errors (the statuses that are the server's fault: ``ERRORS``), and TTFT / TPOT at
quantile ``q`` over the ok ones (None without any). ``judge(base, cand, th) -> Verdict``:
``insufficient`` while either group has fewer than ``th.needed()`` requests (``min_requests``,
or by default ``5 / (1 - quantile)``, the samples a quantile needs to mean anything, as the
intervention check counts them: p90 50, p99 500); else ``breach``
with its reasons when the candidate's TTFT or TPOT at ``th.quantile`` is more than
``th.max_latency_ratio`` times the baseline's and more than ``th.min_latency_delta_s`` above
it, or its error or refusal rate exceeds the baseline's by more than ``th.max_error_rate`` /
``th.max_refusal_rate``; else ``held``. A client's bad request (``invalid_argument``) and a
client that left (``cancelled``) count as requests, not against either group.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping

import numpy as np

ERRORS = frozenset({"error", "unavailable", "deadline_exceeded", "slow_consumer"})


@dataclasses.dataclass(frozen=True)
class Thresholds:
  quantile: float = 0.9
  max_latency_ratio: float = 1.5
  min_latency_delta_s: float = 0.02
  max_error_rate: float = 0.01
  max_refusal_rate: float = 0.02
  min_requests: int = 0  # 0: what the quantile needs, 5 / (1 - quantile)

  def needed(self) -> int:
    return self.min_requests or math.ceil(5 / (1 - self.quantile) - 1e-9)


@dataclasses.dataclass(frozen=True)
class GroupStats:
  requests: int
  ok: int
  refused: int
  errors: int
  ttft_s: float | None
  tpot_s: float | None

  @property
  def error_rate(self) -> float:
    return self.errors / self.requests if self.requests else 0.0

  @property
  def refusal_rate(self) -> float:
    return self.refused / self.requests if self.requests else 0.0


@dataclasses.dataclass(frozen=True)
class Verdict:
  state: str  # "held", "breach" or "insufficient"
  reasons: tuple[str, ...] = ()


def _quantile(xs: list[float], q: float) -> float | None:
  return float(np.quantile(xs, q)) if xs else None


def group_stats(records: Iterable[Mapping], q: float) -> GroupStats:
  recs = list(records)
  ok = [r for r in recs if r.get("status") == "ok"]
  return GroupStats(
      requests=len(recs), ok=len(ok),
      refused=sum(r.get("status") == "rejected" for r in recs),
      errors=sum(r.get("status") in ERRORS for r in recs),
      ttft_s=_quantile([r["ttft_s"] for r in ok if r.get("ttft_s") is not None], q),
      tpot_s=_quantile([r["tpot_s"] for r in ok if r.get("tpot_s") is not None], q))


def judge(base: GroupStats, cand: GroupStats, th: Thresholds) -> Verdict:
  if min(base.requests, cand.requests) < th.needed():
    return Verdict("insufficient")
  reasons = []
  for name in ("ttft_s", "tpot_s"):
    b, c = getattr(base, name), getattr(cand, name)
    if b is not None and c is not None and b > 0 and c > th.max_latency_ratio * b and \
        c - b > th.min_latency_delta_s:
      reasons.append(f"{name[:-2]} p{100 * th.quantile:g} {1e3 * c:.1f} ms > "
                     f"{th.max_latency_ratio:g} x the baseline's {1e3 * b:.1f} ms")
  if cand.error_rate - base.error_rate > th.max_error_rate:
    reasons.append(f"error rate {cand.error_rate:.3f} vs the baseline's {base.error_rate:.3f}")
  if cand.refusal_rate - base.refusal_rate > th.max_refusal_rate:
    reasons.append(f"refusal rate {cand.refusal_rate:.3f} vs the baseline's "
                   f"{base.refusal_rate:.3f}")
  return Verdict("breach" if reasons else "held", tuple(reasons))
