"""Smoke test of launch.sweep_frontier: PaLM 62B on 8 and 16 TPU v4 chips at three batches (the
cost model only: a second), plus the measured points of a tiny sweep written by the test; the
CSV has the documented columns, the Pareto flags mark a non-dominated set, the JSON has each
frontier's two ends, the PNG exists; a bad flag exits 2."""

import csv
import dataclasses
import json
import os
import subprocess
import sys

from launch import frontier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=120):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  return subprocess.run([sys.executable, "-m", "launch.sweep_frontier", *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout)


def test_frontier_files(tmp_path):
  sweep = {"mesh": [2, 2, 2], "rows": [
      {"phase": "decode", "batch": 8, "seq": 32, "weights": "bf16", "ffn": f, "attn": "heads",
       "measured_s": t, "mfu": m, "same_as": ""} for f, t, m in
      (("ws_2d", 0.002, 0.01), ("ws_1d", 0.003, 0.02), ("wg_xyz", 0.004, 0.005))]}
  (tmp_path / "sw").mkdir()
  (tmp_path / "sw" / "sweep.json").write_text(json.dumps(sweep))
  out = str(tmp_path / "fr")
  r = _run("--model", "palm-62b", "--chips", "8,16", "--batches", "1,16,256", "--out", out,
           "--measured", str(tmp_path / "sw"))
  assert r.returncode == 0, r.stderr
  ends = json.loads(r.stdout.strip().splitlines()[-1])["ends"]
  assert set(ends) == {"predicted/decode", "predicted/prefill", "measured/decode"}
  low = ends["predicted/decode"]["lowest_latency"]
  assert low["batch"] == 1 and low["latency_s"] > 0
  with open(os.path.join(out, "frontier.csv")) as f:
    rows = list(csv.DictReader(f))
  assert tuple(rows[0]) == frontier.COLUMNS and len(rows) > 10
  measured = [r for r in rows if r["source"] == "measured"]
  # ws_2d (fastest) and ws_1d (more MFU) are on the MFU frontier, wg_xyz (dominated) is not.
  assert {r["layout"].split("+")[0]: r["pareto_mfu"] for r in measured} == {
      "ws_2d": "True", "ws_1d": "True", "wg_xyz": "False"}
  assert os.path.getsize(os.path.join(out, "frontier.png")) > 1000


def test_pareto_is_non_dominated():
  pts = [frontier.Point("predicted", "decode", "bf16", 8, b, 128, "x", lat, mfu, c)
         for b, lat, mfu, c in ((1, 1.0, 0.1, 9), (2, 2.0, 0.3, 5), (4, 2.5, 0.2, 4),
                                (8, 3.0, 0.5, 6))]
  assert [p.batch for p in frontier.pareto(pts, "mfu")] == [1, 2, 8]
  assert [p.batch for p in frontier.pareto(pts, "cost")] == [1, 2, 4]
  # Exact twins (another mesh, the same figures) dominate neither each other nor are dominated:
  # both stay; a point equal in MFU but slower is dominated.
  twin = dataclasses.replace(pts[1], batch=3)
  slower = dataclasses.replace(pts[1], batch=5, latency_s=2.2)
  assert [p.batch for p in frontier.pareto(pts + [twin, slower], "mfu")] == [1, 2, 3, 8]


def test_bad_flags_exit_2(tmp_path):
  r = _run("--chips", "x", "--out", str(tmp_path))
  assert r.returncode == 2 and r.stderr.strip().startswith("error:")
