"""A tiny-size smoke run of launch.lab.bench_lora: two rows over two adapters on the tiny model;
the base rows' ids on the LoRA engine equal the base model's, the adapters change them, and no
program is compiled after readiness."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.refenv import REPO
from tests.cli_env import CLI_XLA_FLAGS


def test_bench_lora_smoke():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  r = subprocess.run(
      [sys.executable, "-m", "launch.lab.bench_lora", "--model", "tiny", "--dtype", "float32",
       "--batch", "2", "--adapters", "2", "--prompt_tokens", "16", "--max_tokens", "8",
       "--rounds", "1", "--json"], cwd=REPO, env=env, capture_output=True, text=True,
      timeout=400)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert set(out["configs"]) == {"base", "lora", "lora_base_rows"} and out["machine"]["cpu"]
  for c in out["configs"].values():
    assert c["decode_step_ms"] > 0 and c["prefill_tok_s"] > 0 and c["tok_s"] > 0
  assert out["decode_overhead"] > 0 and out["base_rows_same_ids"] is True
  assert out["adapters_change_ids"] is True and out["programs_after_ready"] == 0


def test_bench_lora_context_too_long_exits_2():
  r = subprocess.run([sys.executable, "-m", "launch.lab.bench_lora", "--model", "tiny",
                      "--prompt_tokens", "4000"], cwd=REPO, capture_output=True, text=True,
                     timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 2 and "--prompt_tokens" in r.stderr


def test_make_adapters_writes_peft_files(tmp_path):
  r = subprocess.run([sys.executable, "-m", "launch.lab.make_adapters", "--model", "tiny",
                      "--out", str(tmp_path), "--count", "2", "--rank", "4"], cwd=REPO,
                     capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 0, r.stderr[-2000:]
  paths = json.loads(r.stdout)["adapters"]
  from models.config import get_preset
  from models.io.peft import load_peft_adapter
  ad = load_peft_adapter(paths["lora1"], get_preset("tiny"))
  assert ad.rank == 4 and len(ad.targets) == 7
