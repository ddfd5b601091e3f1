"""launch.lab.bench_service at tiny size: the service and the offline run both complete, produce the
same greedy ids, and the JSON has every figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.refenv import REPO
from tests.cli_env import CLI_XLA_FLAGS


def test_bench_service_smoke():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  r = subprocess.run([sys.executable, "-m", "launch.lab.bench_service", "--model", "tiny",
                      "--requests", "4", "--prompt_len", "8", "--max_tokens", "8",
                      "--max_slots", "4", "--max_context", "64", "--engine_flag=--kv_pages=32",
                      "--engine_flag=--page_size=16", "--engine_flag=--max_chunk=16",
                      "--engine_flag=--max_prefill_chunks=1"],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["same_greedy_ids"] is True
  for run in ("service", "offline"):
    assert out[run]["tokens"] == 32 and out[run]["throughput_tok_s"] > 0
    assert 0 < out[run]["ttft_p50_ms"] <= out[run]["ttft_p99_ms"]
  assert out["service_over_offline"]["throughput_tok_s"] > 0 and out["machine"]["cpu"]
