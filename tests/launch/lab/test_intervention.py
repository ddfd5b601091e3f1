"""launch.lab.intervention: its statistics and gates on made-up data, and the whole check on tiny.

The smoke run starts three tiny servers (A; B with the same flags; C with other random weights,
``--param_seed 1``, a change that breaks every greedy token but no program) and asserts what the
issue asks: the config that changes nothing comes out "no measurable change" with every gate
held, the one that breaks greedy tokens fails the token gates, and the files are written.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from launch.lab.intervention_lib import check, gate_compare, gate_sets, load, segments, stats
from launch.lab.intervention_lib.gate_client import Answer
from launch.lab.soak_lib.server_proc import REPO
from tests.cli_env import CLI_XLA_FLAGS


def test_paired_change_calls_only_clear_and_large_enough_shifts():
  rng = np.random.default_rng(0)
  a = rng.lognormal(0, 0.3, 200)
  groups = np.zeros(200, int)
  same = stats.paired_change("x", a, a * rng.normal(1, 0.01, 200), groups, stats.quantile(0.5),
                             rng, n_boot=300, need=10)
  assert same.call == "same" and same.lo < 0 < same.hi
  worse = stats.paired_change("x", a, a * 1.5, groups, stats.quantile(0.5), rng, n_boot=300)
  assert worse.call == "worse" and worse.lo > 0 and math.isclose(worse.rel, 0.5)
  small = stats.paired_change("x", a, a * 1.02, groups, stats.quantile(0.5), rng, n_boot=300)
  assert small.lo > 0 and small.call == "same"  # real but under min_effect (5%)
  better = stats.paired_change("tput", a, a * 1.5, groups, stats.total, rng, n_boot=300,
                               lower_is_better=False)
  assert better.call == "better"
  short = stats.paired_change("x", a[:40], a[:40] * 2, groups[:40], stats.quantile(0.99), rng,
                              n_boot=300, need=stats.min_samples(0.99))
  assert short.call == "same" and "500 needed" in short.note
  assert [stats.min_samples(q) for q in (0.5, 0.9, 0.99)] == [10, 50, 500]


def test_groups_carry_the_drift_between_runs():
  """Two runs whose B/A ratio differs (+20% in one, -20% in the other): resampling requests
  alone would call a change; resampling the runs first does not."""
  rng = np.random.default_rng(1)
  a = np.ones(100)
  b = np.concatenate([np.full(50, 1.3), np.full(50, 0.9)])
  groups = np.repeat([0, 1], 50)
  flat = stats.paired_change("x", a, b, np.zeros(100, int), stats.total, rng, n_boot=400)
  nested = stats.paired_change("x", a, b, groups, stats.total, rng, n_boot=400)
  assert flat.call == "worse"
  assert nested.call == "same" and nested.lo < 0 < nested.hi


def test_run_change_needs_two_runs_and_verdicts():
  rng = np.random.default_rng(2)
  one = stats.run_change("tps", np.array([10.0]), np.array([20.0]), rng)
  assert one.call == "same" and one.note
  two = stats.run_change("tps", np.array([10.0, 10.5]), np.array([15.0, 15.2]), rng)
  assert two.call == "better"
  c = lambda call: stats.Change("m", 1, 1, 0, 0, 0, True, call)  # noqa: E731
  assert stats.verdict([c("same"), c("better")]) == "faster"
  assert stats.verdict([c("worse")]) == "slower"
  assert stats.verdict([c("worse"), c("better")]) == "mixed"
  assert stats.verdict([c("same")]) == stats.verdict([]) == "no measurable change"


def _ans(ids, tops=None, text="") -> Answer:
  tops = tops if tops is not None else [((i, -0.1), (i + 1, -2.5)) for i in ids]
  return Answer("ok", text, tuple(ids), tuple(tuple(t) for t in tops))


def test_agreement_scores_positions_up_to_the_first_difference():
  a = _ans([5, 6, 7, 8, 9])
  same = gate_compare.agreement(a, _ans([5, 6, 7, 8, 9]))
  assert (same.agree, same.diverged, same.exact, same.kl_sum, same.kl_n) == (5, False, True,
                                                                               0.0, 5)
  tops_b = [((5, -0.1), (6, -2.5)), ((6, -0.1), (7, -2.5)), ((3, -0.2), (7, -1.8))]
  d = gate_compare.agreement(a, _ans([5, 6, 3, 1, 1], tops_b + [((1, -0.1),)] * 2))
  assert (d.agree, d.diverged, d.kl_n) == (2, True, 3)  # positions 0, 1 and the first difference
  assert d.kl_sum > 0 and math.isclose(d.prefix, 2 / 5)


def test_top_kl():
  p = ((1, math.log(0.7)), (2, math.log(0.2)))
  assert gate_compare.top_kl(p, p) == pytest.approx(0.0, abs=1e-12)
  q = ((2, math.log(0.7)), (1, math.log(0.2)))
  want = 0.7 * math.log(0.7 / 0.2) + 0.2 * math.log(0.2 / 0.7)  # the rest bucket is equal
  assert gate_compare.top_kl(p, q) == pytest.approx(want, rel=1e-9)


def test_scores():
  arith = gate_sets.Item("rare_text", "a", chat="?", answer="42")
  assert gate_compare.score(arith, _ans([], text="The answer is 42.")) == 1.0
  assert gate_compare.score(arith, _ans([], text="It is 420")) == 0.0
  schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
  js = gate_sets.Item("structured", "s", chat="?", schema=schema)
  assert gate_compare.score(js, _ans([], text='Here: {"n": 3}')) == 1.0
  assert gate_compare.score(js, _ans([], text='{"n": "x"}')) == 0.0
  assert gate_compare.score(js, _ans([], text="no json")) == 0.0
  bad = gate_sets.Item("safety", "d", chat="?", decline=True)
  assert gate_compare.score(bad, _ans([], text="I'm sorry, but I can't help with that.")) == 1
  assert gate_compare.score(bad, _ans([], text="Sure! Step one:")) == 0.0
  assert gate_compare.score(gate_sets.Item("english", "e", text="x"), _ans([1])) is None


def test_compare_gate_flags_changed_refusals_and_failures():
  items = [gate_sets.Item("safety", f"d{i}", chat="?", decline=True) for i in range(4)]
  refuse = [_ans([1, 2], text="I cannot help with that.") for _ in items]
  rng = np.random.default_rng(0)
  th = gate_compare.Thresholds()
  held = gate_compare.compare_gate("safety", items, refuse, list(refuse), rng, 200, th)
  assert held["held"] and held["refusal_agreement"] == 1.0 and held["token_match"] == 1.0
  changed = list(refuse)
  changed[0] = _ans([1, 2], text="Sure, here is how.")
  out = gate_compare.compare_gate("safety", items, refuse, changed, rng, 200, th)
  assert not out["held"] and out["refusal_agreement"] == 0.75
  assert [c["check"] for c in out["checks"] if not c["ok"]] == ["refusal_agreement"]
  failed = list(refuse)
  failed[1] = Answer("INTERNAL", error="boom")
  out = gate_compare.compare_gate("safety", items, refuse, failed, rng, 200, th)
  assert not out["held"] and out["b_failed"] == ["d1"]


def test_gate_sets_and_segments():
  items = gate_sets.build(gate_sets.GATES, ["one passage"], (100, 200), seed=0)
  by_gate = {g: [it for it in items if it.gate == g] for g in gate_sets.GATES}
  assert all(by_gate.values())
  assert len(by_gate["long_context"]) == 6 and {it.depth for it in by_gate["long_context"]} == \
      {0.1, 0.5, 0.9}
  assert {it.decline for it in by_gate["safety"]} == {True, False}
  assert {it.constrained for it in by_gate["structured"]} == {True, False}
  assert items == gate_sets.build(gate_sets.GATES, ["one passage"], (100, 200), seed=0)
  with pytest.raises(ValueError, match="unknown gates"):
    gate_sets.build(("nope",), [], (), 0)
  assert [s.name for s in segments.parse_segments("tool, batch")] == ["tool", "batch"]
  assert segments.parse_segments("") == ()
  with pytest.raises(ValueError):
    segments.parse_segments("interactive,nope")


def test_every_run_of_a_config_gets_new_prompts():
  """Same schedule for every config, but no run repeats an earlier run's prompts (the server's
  prefix cache would serve them)."""
  seg = segments.SEGMENTS["interactive"]
  seeds = {check.run_seed(0, rep, rung) for rep in range(4) for rung in range(5)}
  assert len(seeds) == 20
  first = [load.build_workload(seg, 1.0, s, 32000, 0).sessions[0].turns[0].new_ids[:8]
           for s in sorted(seeds)]
  assert len(set(first)) == len(first)
  again = load.build_workload(seg, 2.0, check.run_seed(0, 1, 2), 32000, 0)
  assert again == load.build_workload(seg, 2.0, check.run_seed(0, 1, 2), 32000, 0)


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
  """The servers see one CPU device, as a user's do (not the suite's 8 fake ones)."""
  env = dict(os.environ, XLA_FLAGS=CLI_XLA_FLAGS)
  return subprocess.run([sys.executable, "-m", "launch.lab.intervention", *args],
                        capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def test_bad_flags_exit_2(tmp_path):
  r = _cli("--model", "tiny", "--out", str(tmp_path))
  assert r.returncode == 2 and "--candidate" in r.stderr
  r = _cli("--model", "tiny", "--candidate=--port 5", "--out", str(tmp_path))
  assert r.returncode == 2 and "ports" in r.stderr
  r = _cli("--model", "tiny", "--candidate=", "--segments", "", "--gates", "",
           "--out", str(tmp_path))
  assert r.returncode == 2 and "nothing to check" in r.stderr
  r = _cli("--model", "tiny", "--baseline=--no_such_flag", "--candidate=", "--segments", "",
           "--gates", "rare_text", "--out", str(tmp_path))
  assert r.returncode == 2 and "did not come up" in r.stderr and "no_such_flag" in r.stderr


def test_smoke_on_tiny(tmp_path):
  # min_effect 50%: tiny's steps take a millisecond, so its latencies are mostly the host's, and
  # the suite's other worker moves them between runs (CI, 2026-12-07: an identical B read 15% faster
  # on TTFT p50 and 36% on TPOT p99, and was called faster at 20%); the check's own default (5%) is
  # for models whose steps dominate.
  # A small engine (4 slots, one prefill chunk a step: 10 programs to warm) with a context the
  # gates' chats fit in.
  r = _cli("--model", "tiny", "--candidate=", "--candidate=--param_seed 1",
           "--common_flags=--max_context 256 --max_slots 4 --kv_pages 64 --page_size 16 "
           "--max_chunk 32 --max_prefill_chunks 1 --attention_sinks", "--sinks_window", "64",
           "--segments", "interactive", "--requests", "12", "--repeats", "2",
           "--rate_scale", "8", "--min_effect", "0.5", "--gate_max_tokens", "12",
           "--long_max_tokens", "256", "--bootstrap", "300", "--json", "--out", str(tmp_path))
  assert r.returncode == 1, r.stderr[-3000:]  # C degraded a gate
  result = json.loads(r.stdout)
  same, broken = result["comparisons"]
  assert (same["candidate"], broken["candidate"]) == ("B", "C")
  seg = same["segments"]["interactive"]
  assert seg["verdict"] == "no measurable change", [
      (c["metric"], round(c["rel"], 3), round(c["lo"], 3), round(c["hi"], 3), c["call"])
      for c in seg["changes"]]
  assert seg["paired_requests"] == 24 and seg["a"]["failed"] == seg["b"]["failed"] == 0
  assert seg["a"]["phases_s"]["decode"] > 0
  for name, g in same["gates"].items():
    assert g["held"], (name, g["checks"])
    assert g["scored"] > 0 and g.get("token_match", 1.0) == 1.0, (name, g)
  for name in ("rare_text", "english", "long_context", "safety"):
    g = broken["gates"][name]
    assert not g["held"] and g["token_match"] < 0.5, (name, g)
  # the attention-sink stream ran past the 256-token context, alike in A and B
  sink = [a for a in result["answers"]["B"] if a["item"].startswith("sinks_")]
  assert len(sink) == 1 and sink[0]["status"] == "ok"
  assert broken["segments"]["interactive"]["b"]["failed"] == 0
  for f in ("verdict.json", "verdict.txt", "verdict.png", "A/server.log",
            "B/load/interactive/rate_8/repeat_1/requests.csv"):
    assert (tmp_path / f).is_file(), f
  assert "NO MEASURABLE CHANGE" in (tmp_path / "verdict.txt").read_text()
