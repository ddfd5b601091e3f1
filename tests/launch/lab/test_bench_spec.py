"""A tiny-size smoke run of launch.lab.bench_spec: a batch of 2 runs, the ids agree (f32) and the
acceptance fields add up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.refenv import REPO
from tests.cli_env import CLI_XLA_FLAGS


def test_bench_spec_smoke():
  """With a self-draft (tiny, the same seed: the target's own weights); n-gram lookup through
  the same code is tests/launch/test_serve_offline.py's."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  draft = ["--draft_model", "tiny"]
  r = subprocess.run(
      [sys.executable, "-m", "launch.lab.bench_spec", "--model", "tiny", "--dtype", "float32",
       "--batches", "2", "--max_tokens", "8", "--rounds", "1", "--tasks", "spelling,rename",
       "--json", *draft], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert sorted(out["batches"]) == ["2"] and out["machine"]["cpu"]
  assert out["proposer"] == "draft_model tiny (none)"
  for b in out["batches"].values():
    assert b["plain_tok_s"] > 0 and b["spec_tok_s"] > 0 and b["same_ids"] is True
    assert sum(b["accepted_per_pos"]) == b["accepted_tokens"] <= b["draft_tokens"]
    assert b["programs_after_ready"] == 0
    # greedy rows, the target's own weights: every draft accepted but after a near-tie
    assert b["drafts"] > 0 and b["acceptance"] > 0.9, b


def test_bench_spec_bad_task_exits_2():
  r = subprocess.run([sys.executable, "-m", "launch.lab.bench_spec", "--model", "tiny",
                      "--tasks", "poetry"], cwd=REPO, capture_output=True, text=True,
                     timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 2 and "--tasks" in r.stderr
