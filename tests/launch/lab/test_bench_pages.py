"""launch.lab.bench_pages smoke test: the CLI runs on the tiny preset at minimal sizes (with the int8
pool) and prints one JSON object with positive timings; a bad flag exits 2 with a one-line
error."""

from tests import paths
import json
import os
import subprocess
import sys
from tests.cli_env import CLI_XLA_FLAGS

ROOT = str(paths.REPO)


def _run(*args, timeout=60):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  return subprocess.run([sys.executable, "-m", "launch.lab.bench_pages", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_tiny_bench_json():
  r = _run("--model", "tiny", "--dtype", "float32", "--batch", "2", "--context", "32",
           "--page_sizes", "16", "--steps", "1", "--repeats", "1", "--kv_int8", "--json")
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert (out["model"], out["batch"], out["context"]) == ("tiny", 2, 32)
  assert out["contiguous_ms_per_step"] > 0
  assert [p["page_size"] for p in out["paged"]] == [16]
  p = out["paged"][0]
  assert p["ms_per_step"] > 0 and p["x_contiguous"] > 0 and p["x_contiguous_best"] > 0
  assert p["int8_ms_per_step"] > 0 and p["int8_x_paged"] > 0
  assert p["int8_kv_bytes"] / p["kv_bytes"] == (16 + 4) / (16 * 4)  # tiny: H = 16, f32 pages


def test_page_size_must_divide_context():
  r = _run("--model", "tiny", "--context", "32", "--page_sizes", "5")
  assert r.returncode == 2
  assert r.stderr.strip().startswith("error:") and "Traceback" not in r.stderr
