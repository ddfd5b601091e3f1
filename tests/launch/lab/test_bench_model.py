"""launch.lab.bench_model smoke test: the CLI runs on the tiny preset with minimal sizes and prints one
JSON object whose measurements are present and positive."""

from tests import paths
import json
import os
import subprocess
import sys
from tests.cli_env import CLI_XLA_FLAGS

ROOT = str(paths.REPO)


def _run(*args, timeout=120):
  # The lowering policy fixed to its defaults: no start-up measurement in the suite.
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS, PHASESERVE_CPU_AUTOTUNE="0")
  return subprocess.run([sys.executable, "-m", "launch.lab.bench_model", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_tiny_bench_json():
  r = _run("--model", "tiny", "--json", "--dtype", "float32", "--quantize", "all",
           "--prefill_tokens", "16", "--prefill_batches", "2", "--decode_batches", "1",
           "--steps", "2", "--context", "8", "--repeats", "1", "--peak_size", "128",
           "--bandwidth_mb", "8", "--floor_batches", "2", "--floor_tokens", "16")
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["model"] == "tiny"
  hw = out["hardware"]
  assert set(hw["matmul_peak_flops"]) == {"float32", "bfloat16", "int8"}
  assert all(v > 0 for v in hw["matmul_peak_flops"].values()) and hw["read_bandwidth"] > 0
  assert [(p["quantize"], p["batch"], p["tokens"]) for p in out["prefill"]] == [
      ("none", 2, 16), ("weight_only", 2, 16), ("w8a8", 2, 16)]
  for p in out["prefill"]:
    for key in ("seconds", "tokens_per_s", "flops_per_token", "flops_per_s", "mfu", "mfu_causal"):
      assert p[key] > 0, (key, p)
    assert p["mfu_causal"] < p["mfu"]
  assert [(d["quantize"], d["batch"]) for d in out["decode"]] == [
      ("none", 1), ("weight_only", 1), ("w8a8", 1)]
  for d in out["decode"]:
    for key in ("ms_per_step", "tokens_per_s", "weight_bytes", "kv_bytes", "bound_ms",
                "x_of_bound", "bw_util"):
      assert d[key] > 0, (key, d)
    assert d["attend_len"] >= d["context"] + d["steps"]
  assert out["decode"][1]["weight_bytes"] < out["decode"][0]["weight_bytes"]  # int8 < f32
  assert out["summary"]["int8_speedup_batch1"] > 0
  for d in out["decode"]:  # the bound comes from reads interleaved with the timed calls
    assert len(d["read_bandwidths"]) == 1 and d["read_bandwidth"] > 0
  fl = out["floor"]  # phaseserve vs the minimal JAX loops, same run
  assert fl["dtype"] == "float32" and [r["batch"] for r in fl["rows"]] == [2]
  row = fl["rows"][0]
  assert set(row["tokens_per_s"]) == {"phaseserve", "minimal_out_in", "minimal_in_out"}
  assert all(v > 0 for v in row["tokens_per_s"].values()) and row["ratio_vs_best_minimal"] > 0
  if out["machine"]["platform"] == "cpu":  # which lowering the policy picked, and why
    low = out["cpu_lowering"]
    assert low["source"] in ("default", "cache", "measured", "fixed")
    assert {"float_prefill", "int8_native_max_rows", "int8_nk_native_max_rows"} <= set(
        low["policy"])


def test_bad_flag_exits_2():
  r = _run("--model", "tiny", "--dtype", "float16")
  assert r.returncode == 2
  assert r.stderr.strip().startswith("error:") and "Traceback" not in r.stderr
