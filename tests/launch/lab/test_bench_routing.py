"""A tiny-size smoke run of launch.lab.bench_routing: a policy setup (two tiny replicas behind
the gateway) and the prefill / decode pair, one repeat each, a few multi-turn sessions; and its
refusals of bad flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.grpc_harness import TINY
from tests.refenv import REPO
from tests.cli_env import CLI_XLA_FLAGS


def test_bench_routing_smoke(tmp_path):
  # --nowarmup: each run starts fresh servers; a smoke needs no closed program set
  server = [f"--server_flag={a}={b}" for a, b in zip(TINY[2::2], TINY[3::2])] + \
      ["--server_flag=--nowarmup"]
  r = subprocess.run(
      [sys.executable, "-m", "launch.lab.bench_routing", "--model", "tiny", "--sessions", "4",
       "--setups", "cache_aware,pd", "--rates", "4", "--repeats", "1", "--max_context", "24",
       "--length_scale", "0.05", "--slo_scale", "100",
       *server, "--out", str(tmp_path), "--json"],
      cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS),
      capture_output=True,
      text=True, timeout=400)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["cpu"] and set(out["setups"]) == {"cache_aware", "pd"}
  assert [run["setup"] for run in out["runs"]] == ["cache_aware", "pd"]
  for run in out["runs"]:
    assert run["failed"] == 0 and run["ok"] == run["sent"] >= 4 and run["meets_slo_p99"]
    assert len(run["servers"]) == 2
    assert 0 < run["ttft_s"]["p50"] <= run["ttft_s"]["p99"]
  # every request the load generator sent (and its 2 warm-up requests) ended on a replica;
  # with prefill / decode each ended on both (the prefill leg, then the rest)
  cache_aware, pd = out["runs"]
  assert sum(s["ok"] for s in cache_aware["servers"]) == cache_aware["sent"] + 2
  assert [s["ok"] for s in pd["servers"]] == [pd["sent"] + 2] * 2
  assert pd["servers"][1]["prefix_hit_tokens"] > 0  # the decode server took prompt pages
  assert out["setups"]["pd"]["capacity_per_s"] == 4.0
  ratios = out["setups"]["pd"]["ttft_p50_over_cache_aware"]
  assert len(ratios) == 1 and ratios[0] > 0
  assert (tmp_path / "cache_aware_r4_0" / "summary.json").exists()


def test_bench_routing_refuses_an_unknown_setup():
  r = subprocess.run([sys.executable, "-m", "launch.lab.bench_routing", "--setups",
                      "cache_aware,fastest"], cwd=REPO, capture_output=True, text=True,
                     timeout=60)
  assert r.returncode == 2 and "fastest" in r.stderr
