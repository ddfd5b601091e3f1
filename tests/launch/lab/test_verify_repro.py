"""launch.lab.verify_repro smoke test: on the tiny preset a few pairs of verify calls agree with
the reference run bit for bit (the program is deterministic; the fault it hunts is rare) and the
CLI prints one JSON object; a bad flag exits 2 with a one-line error."""

import json

import pytest

from models.cpu import paged_attention
from tests.cli_env import run_module


def _run(*args, timeout=120):
  return run_module("launch.lab.verify_repro", *args, timeout=timeout)


@pytest.mark.skipif(not paged_attention.available(), reason="the native kernel needs AVX-512 F")
def test_tiny_repro_json():
  r = _run("--model", "tiny", "--iters", "2", "--mode", "serial", "--position", "10", "--json")
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert (out["model"], out["mode"], out["iters"], out["calls"]) == ("tiny", "serial", 2, 4)
  assert out["events"] == [] and out["wall_s"] > 0 and out["machine"]["cpu"]


@pytest.mark.skipif(not paged_attention.available(), reason="the native kernel needs AVX-512 F")
def test_attention_alone_json():
  """``--target attention`` (the kernel alone, every layer's call in one program) with the AMX
  tile state never requested (``PHASESERVE_AMX=0``, recorded in the output)."""
  r = run_module("launch.lab.verify_repro", "--target", "attention", "--model", "tiny",
                 "--iters", "3", "--json", timeout=120, env={"PHASESERVE_AMX": "0"})
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert (out["target"], out["iters"], out["calls"], out["rows"]) == ("attention", 3, 6, 40)
  assert out["kernel_calls"] == 6 * 2 and out["amx_allowed"] is False and out["events"] == []


def test_bad_position_is_a_one_line_error():
  r = _run("--model", "tiny", "--iters", "1", "--position", "900")
  assert r.returncode == 2 and "position" in r.stderr and len(r.stderr.strip().splitlines()) == 1
