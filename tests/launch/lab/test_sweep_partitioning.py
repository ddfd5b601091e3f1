"""Smoke test of launch.lab.sweep_partitioning on 8 fake CPU devices: two cells, two layouts, two
timed calls each; the CSV has the documented columns and a row per (cell, layout), the JSON a
summary whose agreement rates are fractions and every timed call per row (their spread is the
measured noise), the PNG exists; a rerun into the same directory resumes (both cells read back
with their calls, none re-timed) and a bad flag exits 2."""

from tests import paths
import csv
import json
import os
import subprocess
import sys

import pytest
from tests.cli_env import CLI_XLA_FLAGS

ROOT = str(paths.REPO)
ARGS = ["--fake_devices", "8", "--model", "tiny", "--phases", "decode", "--batches", "8",
        "--seqs", "16,32", "--weights", "bf16", "--candidates", "ws_2d:heads,wg_xyz:batch_xyz",
        "--reps", "2"]


def _run(*args, timeout=180):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  return subprocess.run([sys.executable, "-m", "launch.lab.sweep_partitioning", *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout)


def test_sweep_writes_its_files_and_resumes(tmp_path):
  out = str(tmp_path / "sweep")
  r = _run(*ARGS, "--out", out)
  assert r.returncode == 0, r.stderr
  first = json.loads(r.stdout.strip().splitlines()[-1])
  assert first["cells"] == 2 and first["resumed"] == 0
  assert 0.0 <= first["agreement_rate"] <= 1.0
  with open(os.path.join(out, "sweep.csv")) as f:
    rows = list(csv.DictReader(f))
  from launch.lab.sweep_partitioning import COLUMNS
  assert tuple(rows[0]) == COLUMNS and len(rows) == 4
  assert {(r["seq"], r["ffn"]) for r in rows} == {(s, f) for s in ("16", "32")
                                                  for f in ("ws_2d", "wg_xyz")}
  assert all(float(r["measured_s"]) > 0 and float(r["predicted_s"]) > 0 for r in rows)
  assert sum(r["best"] == "True" for r in rows) == 2  # one measured best per cell
  data = json.load(open(os.path.join(out, "sweep.json")))
  assert data["summary"]["cells"] == 2 and len(data["cells"]) == 2
  for r, row in zip(rows, data["rows"]):
    assert len(row["reps_s"]) == 2 and float(r["measured_s"]) == min(row["reps_s"])
    spread = max(row["reps_s"]) / min(row["reps_s"]) - 1
    assert float(r["rep_spread"]) == pytest.approx(spread)
  summary = data["summary"]
  assert 0.0 <= summary["agreement_within_measured_noise"] <= 1.0
  assert summary["pairs_resolved"] == sum(c["pairs_resolved"] for c in data["cells"]) <= 2
  assert summary["median_rep_spread"] >= 0.0
  assert os.path.getsize(os.path.join(out, "measured_vs_predicted.png")) > 1000
  again = _run(*ARGS, "--out", out)
  assert again.returncode == 0, again.stderr
  second = json.loads(again.stdout.strip().splitlines()[-1])
  assert second["resumed"] == 2
  with open(os.path.join(out, "sweep.csv")) as f:
    assert [r["measured_s"] for r in csv.DictReader(f)] == [r["measured_s"] for r in rows]
  resumed = json.load(open(os.path.join(out, "sweep.json")))
  assert [r["reps_s"] for r in resumed["rows"]] == [r["reps_s"] for r in data["rows"]]


def test_bad_flags_exit_2(tmp_path):
  r = _run("--model", "tiny", "--batches", "x", "--out", str(tmp_path))
  assert r.returncode == 2 and r.stderr.strip().startswith("error:")
  r = _run("--model", "tiny")
  assert r.returncode == 2 and "--out" in r.stderr
