"""A tiny-size smoke run of launch.lab.bench_engine: every section runs and reports its fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.refenv import REPO
from tests.cli_env import CLI_XLA_FLAGS


def test_bench_engine_smoke():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  r = subprocess.run(
      [sys.executable, "-m", "launch.lab.bench_engine", "--model", "tiny", "--dtype", "float32",
       "--decode_batches", "1,2", "--trace_requests", "6", "--prompt_range", "8,24",
       "--output_mean", "4", "--output_cap", "8", "--slots", "2", "--long_prompt", "48",
       "--long_count", "1", "--chunk", "16", "--paged_context", "128", "--steps", "2",
       "--rounds", "1", "--tpot_target_ms", "50", "--prefill_mixes", "20,5+30", "--json"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert [row["batch"] for row in out["decode"]["rows"]] == [1, 2]
  assert all(row["x_direct"] > 0 for row in out["decode"]["rows"])
  assert out["paged"]["paged"][0]["page_size"] == 64
  c = out["continuous"]
  assert c["generated_tokens"] > 0 and c["x_static"] > 0
  assert set(out["chunked"]) >= {"quiet", "chunked", "unchunked", "chunked_x_quiet",
                                 "tpot_budget", "tpot_budget_x_quiet"}
  assert out["chunked"]["tpot_budget"]["long_ttft_ms_max"] > 0
  assert out["chunked"]["quiet"]["long_ttft_ms_max"] is None
  p = out["prefill"]
  assert [row["chunks"] for row in p["rows"]] == [[20], [5, 30]]
  assert all(row["packed_ms"] > 0 and row["padded_ms"] > 0 for row in p["rows"])
  if p["packed"]:  # the padded engine ran [R, T] programs, the packed one N tokens
    assert [2, 32] in p["programs"]["padded"] and [2, 48] in p["programs"]["packed"]
  assert out["machine"]["cpu"]


def test_bench_engine_bad_flag():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  r = subprocess.run([sys.executable, "-m", "launch.lab.bench_engine", "--sections", "nope"],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and "sections" in r.stderr
