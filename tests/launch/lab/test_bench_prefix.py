"""launch.lab.bench_prefix at tiny size: cache on and off give the same greedy ids, the cache reuses
the shared prefix's whole pages, and the JSON has every figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.refenv import REPO
from tests.cli_env import CLI_XLA_FLAGS


def test_bench_prefix_smoke():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  r = subprocess.run([sys.executable, "-m", "launch.lab.bench_prefix", "--model", "tiny",
                      "--prefix_len", "40", "--suffix_len", "4", "--requests", "4",
                      "--max_tokens", "4", "--max_slots", "4", "--page_size", "16",
                      "--max_chunk", "32", "--max_prefill_chunks", "2"],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["same_greedy_ids"] is True
  assert out["cache_off"]["cached_tokens"] == 0
  assert out["cache_on"]["cached_tokens"] == 4 * 32  # 2 whole pages of 16 of the 40 shared
  assert out["cache_on"]["prefill_tokens_computed"] == 4 * 44 - 128
  assert out["off_over_on"]["seconds"] > 0 and out["machine"]["cpu"]
  # 4 x (44 + 4) positions, 16 per page: 12 pages without sharing; 2 shared + 4 own with it.
  assert out["cache_off"]["peak_kv_pages"] == 12 and out["cache_on"]["peak_kv_pages"] == 6
  host = out["cache_host"]  # the prefix came back from the host tier
  assert host["cached_tokens"] == 4 * 32 and host["loaded"] == 2 and host["spilled"] >= 2


@pytest.mark.slow  # suite time: the script's default smoke run stays in the suite
def test_bench_prefix_multiturn_smoke():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  r = subprocess.run([sys.executable, "-m", "launch.lab.bench_prefix", "--model", "tiny",
                      "--multiturn", "--prefix_len", "40", "--suffix_len", "4", "--max_tokens",
                      "8", "--max_slots", "1", "--page_size", "16", "--max_chunk", "32",
                      "--max_prefill_chunks", "1"],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["same_greedy_ids"] is True and out["recomputed"]["cached_tokens"] == 0
  # Turn 1 wrote 44 + 8 - 1 = 51 positions: 3 whole pages of 16 come back for turn 2.
  assert out["resumed"]["cached_tokens"] == 48 and out["resumed"]["turn2_prompt"] == 56
