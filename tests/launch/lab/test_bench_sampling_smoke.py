"""Tiny smoke runs of the sampling-side lab scripts: bench_penalties, bench_structured (the tiny
preset), bench_grammar and grammar_libs (llguidance on SmolLM2's tokenizer); each prints its
JSON and that JSON holds its figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import refenv

pytestmark = pytest.mark.timeout(300)


def _run(*args: str) -> str:
  r = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                     timeout=280, cwd=refenv.REPO)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout


def _last_json(out: str) -> dict:
  start = out.rfind("\n{") + 1 if not out.startswith("{") else 0
  return json.loads(out[start:])


def test_bench_penalties_smoke():
  out = _last_json(_run("launch.lab.bench_penalties", "--model", "tiny", "--rows", "2",
                        "--slots", "2", "--repeats", "1", "--generated", "4", "--prompt", "4"))
  case = out["cases"]["rows2_greedy"]
  assert case["off"]["best_ms"] > 0 and case["all_rows"]["best_ms"] > 0


def test_bench_structured_smoke():
  out = _last_json(_run("launch.lab.bench_structured", "--model", "tiny", "--rows", "2",
                        "--tokens", "4", "--rounds", "1", "--json"))
  assert len(out["plain_ms_per_step"]) == len(out["constrained_ms_per_step"]) == 1
  assert out["mask_fill_ms_per_step"][0] > 0  # the constrained run did fill masks


def test_bench_grammar_and_grammar_libs_smoke(tmp_path):
  out = _last_json(_run("launch.lab.bench_grammar", "--rows", "2", "--steps", "3", "--json"))
  assert out
  pkl = tmp_path / "vocab.pkl"
  _run("launch.lab.grammar_libs", "--dump", str(pkl))
  libs = _last_json(_run("launch.lab.grammar_libs", "--lib", "llguidance", "--vocab", str(pkl)))
  assert libs["lib"] == "llguidance" and libs["rows"]
