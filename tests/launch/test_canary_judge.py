"""``launch.canary_judge`` on made-up usage records, and ``launch.canary.UsageTail``'s reads of a
growing file (no server: tests/e2e/test_canary.py runs a canary)."""

from __future__ import annotations

import json

import pytest

from launch.canary_judge import Thresholds, group_stats, judge

TH = Thresholds(quantile=0.99, max_latency_ratio=1.5, min_latency_delta_s=0.02,
                max_error_rate=0.01, max_refusal_rate=0.02, min_requests=20)


def recs(n: int, ttft: float = 0.1, tpot: float = 0.02, status: str = "ok") -> list[dict]:
  return [{"status": status, "ttft_s": ttft * (1 + i / (10 * n)), "tpot_s": tpot}
          for i in range(n)]


def test_group_stats_counts_by_status():
  s = group_stats(recs(30) + recs(2, status="rejected") + recs(3, status="error")
                  + recs(1, status="cancelled") + recs(4, status="invalid_argument"), 0.5)
  assert (s.requests, s.ok, s.refused, s.errors) == (40, 30, 2, 3)
  assert s.error_rate == 3 / 40 and s.refusal_rate == 2 / 40
  assert 0.1 < s.ttft_s < 0.11 and s.tpot_s == pytest.approx(0.02)
  assert group_stats([], 0.99) == group_stats([], 0.5)
  assert group_stats(recs(3, status="error"), 0.99).ttft_s is None


def test_same_behaviour_holds():
  assert judge(group_stats(recs(40), 0.99), group_stats(recs(40), 0.99), TH).state == "held"


def test_too_few_requests_is_not_judged():
  slow = group_stats(recs(19, ttft=1.0), 0.99)
  assert judge(group_stats(recs(40), 0.99), slow, TH).state == "insufficient"


@pytest.mark.parametrize("cand,why", [
    (recs(40, ttft=0.2), "ttft p99"),
    (recs(40, tpot=0.05), "tpot p99"),
    (recs(38) + recs(2, status="error"), "error rate"),
    (recs(38) + recs(2, status="rejected"), "refusal rate"),
])
def test_a_worse_candidate_breaches(cand, why):
  v = judge(group_stats(recs(40), 0.99), group_stats(cand, 0.99), TH)
  assert v.state == "breach" and any(r.startswith(why) for r in v.reasons), v


def test_small_absolute_differences_do_not_breach():
  # 2x slower, but 5 ms: under min_latency_delta_s
  v = judge(group_stats(recs(40, ttft=0.005), 0.99), group_stats(recs(40, ttft=0.010), 0.99), TH)
  assert v.state == "held"
  # errors as frequent as the baseline's are not the candidate's fault
  both = recs(36) + recs(4, status="error")
  assert judge(group_stats(both, 0.99), group_stats(both, 0.99), TH).state == "held"


def test_usage_tail_reads_only_whole_new_lines(tmp_path):
  from launch.canary import UsageTail
  path = tmp_path / "u.jsonl"
  tail = UsageTail(str(path))
  assert tail.read() == []  # not there yet
  with open(path, "w") as f:
    f.write(json.dumps({"status": "ok"}) + "\n" + '{"status": "rej')
  assert tail.read() == [{"status": "ok"}]
  with open(path, "a") as f:
    f.write('ected"}\n')
  assert tail.read() == [{"status": "rejected"}]
  assert tail.read() == []


def test_a_quantile_needs_its_samples():
  assert Thresholds(quantile=0.9).needed() == 50 and Thresholds(quantile=0.99).needed() == 500
  assert Thresholds(quantile=0.9, min_requests=7).needed() == 7
  few = group_stats(recs(49, ttft=1.0), 0.9)  # 10x slower, but 49 requests cannot show a p90
  assert judge(group_stats(recs(60), 0.9), few, Thresholds(quantile=0.9)).state == "insufficient"
