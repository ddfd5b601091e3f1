"""Smoke tests of launch.lab.bench_sinks and launch.lab.eval_streaming: tiny sizes, one JSON object with
the documented keys and positive figures; bad flags exit 2 with a one-line error."""

from tests import paths
import json
import os
import subprocess
import sys
from tests.cli_env import CLI_XLA_FLAGS

ROOT = str(paths.REPO)


def _run(module, *args, timeout=240):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_bench_sinks_tiny():
  r = _run("launch.lab.bench_sinks", "--model", "tiny", "--dtype", "float32", "--window", "16",
           "--stream", "40", "--recompute_tokens", "2", "--page_size", "4", "--json")
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert (out["model"], out["window"], out["stream"], out["kv_pages_sinks"]) == ("tiny", 16, 40, 6)
  assert out["sinks_tok_s"] > 0 and out["recompute_tok_s"] > 0 and out["speedup"] > 0


def test_eval_streaming_tiny():
  r = _run("launch.lab.eval_streaming", "--model", "tiny", "--windows", "8", "--max_tokens", "40",
           "--json")
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["tokens"] == 40 and [x["window"] for x in out["results"]] == [8]
  x = out["results"][0]
  assert x["full_ppl"] > 1 and x["sinks_ppl"] > 1 and x["window_ppl"] > 1


def test_bad_flags_exit_2():
  for module, args in (("launch.lab.bench_sinks", ["--stream", "10", "--window", "16"]),
                       ("launch.lab.eval_streaming", ["--windows", "x"])):
    r = _run(module, *args)
    assert r.returncode == 2, (module, r.stderr)
    assert r.stderr.strip().startswith("error:") and "Traceback" not in r.stderr
