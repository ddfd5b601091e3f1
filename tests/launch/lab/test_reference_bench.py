"""Smoke run of the Hugging Face comparison benchmark (tests/reference/bench_hf.py) at tiny size,
in the Python 3.11 reference env (a missing env fails, as in test_hf_import)."""

from tests import paths
import json
import subprocess
from pathlib import Path

from tests.refenv import ref_env, ref_python


def test_bench_hf_smoke():
  # Decode ms is a difference of two timings (16 tokens less 1): bench_hf interleaves the two
  # lengths and keeps each one's best of --repeats, so only stalls in every short call could
  # make it non-positive.
  script = paths.TESTS / "reference" / "bench_hf.py"
  r = subprocess.run([str(ref_python()), str(script), "--hidden", "64", "--layers", "2",
                      "--heads", "4", "--ffn", "128", "--vocab", "300", "--prompt", "16",
                      "--new_tokens", "16", "--batches", "1,2", "--repeats", "3", "--json"],
                     env=ref_env(), capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert [p["batch"] for p in out["prefill"]] == [1, 2]
  assert all(p["tok_per_s"] > 0 for p in out["prefill"])
  assert all(d["ms_per_token"] > 0 for d in out["decode"])
