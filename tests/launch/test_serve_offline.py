"""launch.serve_offline at tiny size: results in input order, bad lines named, pages back to 0,
greedy tokens equal the generator's, a Chrome trace that parses with phases in order; a line's
"lora" runs it under a LoRA adapter of ``--lora_modules`` (an unknown one is that line's error)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from models.config import get_preset
from models.text.tokenizer import ByteTokenizer
from models.weights import init_params
from serving.generator import Generator
from serving.sampling import SamplingParams
from tests.refenv import REPO
from tests.cli_env import CLI_XLA_FLAGS

LINES = [
    {"prompt": "Hello there", "max_tokens": 12, "ignore_eos": True},
    {"prompt_ids": [72, 105], "max_tokens": 5, "ignore_eos": True},
    {"prompt": "abc", "max_tokens": "x"},
    {"prompt": "Stop here", "max_tokens": 20, "temperature": 0.7, "seed": 3},
    {"prompt": "no", "bogus": 1},
    "not json",
    {"prompt_ids": [1, 2, 999]},
    {"prompt_ids": [72, 105], "max_tokens": 5, "ignore_eos": True, "lora": "ad0"},
    {"prompt": "x", "lora": "nope"},
]


def test_serve_offline_tiny(tmp_path):
  reqs = tmp_path / "reqs.jsonl"
  reqs.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in LINES) + "\n")
  trace = tmp_path / "trace.json"
  from launch.lab.make_adapters import write_peft_adapter
  adapter = write_peft_adapter(tmp_path / "ad0", get_preset("tiny"), rank=8, seed=0,
                               strength=1.0)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  r = subprocess.run([sys.executable, "-m", "launch.serve_offline", "--model", "tiny",
                      "--requests", str(reqs), "--json", "--kv_pages", "64", "--page_size", "16",
                      "--max_slots", "4", "--max_prefill_chunks", "2", "--trace_out", str(trace),
                      "--max_context", "128", "--max_chunk", "32",  # few buckets: suite time
                      "--lora_modules", f"ad0={adapter}"],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [json.loads(l) for l in r.stdout.strip().splitlines()]
  summary = rows[-1]["summary"]
  rows = rows[:-1]
  assert [row["index"] for row in rows] == list(range(len(LINES)))
  errors = {row["index"]: row["error"] for row in rows if "error" in row}
  assert set(errors) == {2, 4, 5, 6, 8}
  assert "max_tokens" in errors[2] and "bogus" in errors[4] and "JSON" in errors[5]
  assert "prompt_ids" in errors[6] and "'nope'" in errors[8] and "ad0" in errors[8]
  assert summary["kv_pages_in_use"] == 0 and summary["ok"] == 4 and summary["errors"] == 5
  assert rows[7]["token_ids"] != rows[1]["token_ids"]  # the adapter changes the ids
  assert summary["stack"]["max_prefill_chunks"] == 2
  assert summary["stack"]["lora"]["adapters"] == ["ad0"]
  assert summary["programs_warmed"] > 0 and summary["mode"] == "single"
  steps = summary["step_breakdown"]  # serving.step_timeline over the run, warmed: no compile
  assert steps["steps"] > 0 and steps["phases_ms"]["dispatch"]["wall"] > 0
  assert sum(v["steps"] for v in steps["decode_only_ms"].values()) > 0
  cfg = get_preset("tiny")
  params = init_params(cfg, jax.random.key(0), jnp.float32)  # --param_seed 0
  gen = Generator(cfg, params, steps_per_call=4)
  tok = ByteTokenizer()
  for i in (0, 1):
    prompt = ([tok.bos_id] + tok.encode(LINES[i]["prompt"]) if "prompt" in LINES[i]
              else LINES[i]["prompt_ids"])
    want = [int(s[0]) for s in gen.stream([prompt], LINES[i]["max_tokens"], SamplingParams(),
                                          stop_ids=())]
    assert rows[i]["token_ids"] == want
    assert rows[i]["finish_reason"] == "length" and rows[i]["ttft_ms"] > 0
  assert rows[3]["finish_reason"] in ("stop", "length")
  events = json.loads(trace.read_text())["traceEvents"]
  spans = sorted((e for e in events if e["ph"] == "X" and e["pid"] == 1), key=lambda e: e["ts"])
  assert [e["name"] for e in spans][0] == "queue" and spans[-1]["name"] == "decode"
  assert "prefill" in [e["name"] for e in spans]


def test_bad_flags_exit_2(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  r = subprocess.run([sys.executable, "-m", "launch.serve_offline", "--model", "tiny"],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and "requests" in r.stderr


@pytest.mark.slow  # suite time: the disaggregated engine's tokens are checked in-process in test_paged_layouts
def test_serve_offline_disaggregated_same_tokens(tmp_path):
  """--mode disaggregated on 8 fake devices (prefill ws_2d+heads on 4, decode wg_xyz+batch_xyz
  on the other 4): the same greedy tokens as the single-device run."""
  reqs = tmp_path / "reqs.jsonl"
  reqs.write_text("\n".join(json.dumps({"prompt_ids": list(range(3 + i, 20 + 3 * i)),
                                         "max_tokens": 6, "ignore_eos": True})
                            for i in range(4)) + "\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  base = [sys.executable, "-m", "launch.serve_offline", "--model", "tiny", "--requests",
          str(reqs), "--json", "--kv_pages", "64", "--page_size", "16", "--max_slots", "8",
          "--max_context", "128", "--nowarmup"]
  runs = {}
  for mode, extra in (("single", []), ("disaggregated", [
      "--mode", "disaggregated", "--fake_devices", "8", "--prefill_layout", "ws_2d:heads",
      "--decode_layout", "wg_xyz:batch_xyz"])):
    r = subprocess.run(base + extra, cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(l) for l in r.stdout.strip().splitlines()]
    assert rows[-1]["summary"]["kv_pages_in_use"] == 0
    runs[mode] = [row["token_ids"] for row in rows[:-1]]
    if mode == "disaggregated":
      dep = rows[-1]["summary"]["deployment"]
      assert dep["mode"] == "disaggregated" and dep["kv_pools"] == 2
  assert runs["single"] == runs["disaggregated"]


def test_serve_offline_speculative_flags_same_tokens(tmp_path):
  """--num_speculative_tokens with n-gram lookup and with --draft_model (tiny: the target's own
  weights, int8): the greedy ids of the plain run (f32), drafts proposed and accepted."""
  reqs = tmp_path / "reqs.jsonl"
  reqs.write_text("\n".join(json.dumps({"prompt_ids": [5 + i, 9, 7, 5 + i, 9, 7, 5 + i, 9],
                                         "max_tokens": 10, "ignore_eos": True})
                            for i in range(3)) + "\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  base = [sys.executable, "-m", "launch.serve_offline", "--model", "tiny", "--requests",
          str(reqs), "--json", "--kv_pages", "32", "--page_size", "16", "--max_slots", "4",
          "--max_context", "64", "--dtype", "float32", "--max_chunk", "32", "--nowarmup"]
  runs, summaries = {}, {}
  spec = ["--num_speculative_tokens", "3", "--speculative_max_rows", "4"]  # all 3 draft
  for name, extra in (("plain", []), ("ngram", spec),
                      ("draft", [*spec, "--draft_model", "tiny", "--draft_quantize", "int8"])):
    r = subprocess.run(base + extra, cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(l) for l in r.stdout.strip().splitlines()]
    runs[name], summaries[name] = [row["token_ids"] for row in rows[:-1]], rows[-1]["summary"]
    assert summaries[name]["kv_pages_in_use"] == 0
  assert runs["plain"] == runs["ngram"] == runs["draft"]
  assert summaries["plain"]["stack"]["speculative"] is None
  spec = summaries["draft"]["stack"]["speculative"]
  assert spec["method"] == "draft_model" and spec["draft_model"] == "tiny (int8)"
  assert summaries["ngram"]["stack"]["speculative"]["method"] == "ngram"
  for name in ("ngram", "draft"):
    c = summaries[name]["spec_decode"]
    assert c["drafts"] > 0 and c["failures"] == 0, (name, c)
  c = summaries["draft"]["spec_decode"]
  assert c["accepted_tokens"] > 0.5 * c["draft_tokens"], c  # int8 of the same weights


def test_draft_model_needs_speculative_tokens_and_the_same_tokenizer(tmp_path):
  reqs = tmp_path / "reqs.jsonl"
  reqs.write_text(json.dumps({"prompt_ids": [1, 2, 3], "max_tokens": 2}) + "\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  r = subprocess.run([sys.executable, "-m", "launch.serve_offline", "--model", "tiny",
                      "--requests", str(reqs), "--draft_model", "tiny", "--nowarmup"],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and "num_speculative_tokens" in r.stderr, r.stderr[-2000:]
  r = subprocess.run([sys.executable, "-m", "launch.serve_offline", "--model", "tiny",
                      "--requests", str(reqs), "--num_speculative_tokens", "2", "--draft_model",
                      "smollm2-135m", "--nowarmup"],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and "share the target's tokenizer" in r.stderr, r.stderr[-2000:]
