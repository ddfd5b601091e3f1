"""launch.lab.sweep_noise on two hand-made sweep outputs: run-to-run change, and which band's
resolved pairs keep their order in the second run; bad input exits 2."""

from tests import paths
import json
import os
import subprocess
import sys

ROOT = str(paths.REPO)


def _sweep(path, programs):
  os.makedirs(path)
  rows = [{"phase": "decode", "batch": 8, "seq": 32, "weights": "bf16", "ffn": f, "attn": "heads",
           "same_as": "", "measured_s": min(calls), "reps_s": calls} for f, calls in programs]
  with open(os.path.join(path, "sweep.json"), "w") as f:
    json.dump({"rows": rows}, f)


def _run(*args):
  return subprocess.run([sys.executable, "-m", "launch.lab.sweep_noise", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=60,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_compares_two_runs(tmp_path):
  # Full ranges a [1.0, 1.2], b [1.15, 1.5], c [2.0, 2.1] resolve (a, c) and (b, c); the
  # [fastest, median] bands a [1.0, 1.1], b [1.15, 1.2] also (a, b), which the second run
  # orders the other way.
  _sweep(str(tmp_path / "one"), [("ws_1d", [1.0, 1.2, 1.1]), ("ws_2d", [1.15, 1.5, 1.2]),
                                 ("wg_xyz", [2.0, 2.1, 2.05])])
  _sweep(str(tmp_path / "two"), [("ws_1d", [1.2, 1.3]), ("ws_2d", [1.15, 1.2]),
                                 ("wg_xyz", [2.0, 2.2])])
  r = _run("--first", str(tmp_path / "one"), "--second", str(tmp_path / "two"))
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  assert out["programs"] == 3 and out["cells"] == 1
  assert out["bands"]["full_range"] == {"resolved_pairs": 2, "same_order_in_second": 2,
                                        "reproduced": 1.0}
  narrow = out["bands"]["fastest_to_median"]
  assert narrow["resolved_pairs"] == 3 and narrow["same_order_in_second"] == 2
  assert abs(out["run_to_run_change"]["median"] - 0.0) < 1e-12  # ws_2d and wg_xyz unchanged


def test_bad_input_exits_2(tmp_path):
  r = _run("--first", str(tmp_path), "--second", str(tmp_path))
  assert r.returncode == 2 and "not a sweep output" in r.stderr
  _sweep(str(tmp_path / "one"), [("ws_1d", [1.0])])
  r = _run("--first", str(tmp_path / "one"), "--second", str(tmp_path / "one"))
  assert r.returncode == 2 and "two timed calls" in r.stderr
  assert _run("--first", str(tmp_path)).returncode == 2
