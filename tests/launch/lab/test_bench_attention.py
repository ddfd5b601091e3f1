"""launch.lab.bench_attention smoke test: the CLI runs on the tiny preset at minimal sizes and
prints one JSON object with positive timings and the K / V bytes it read; a bad flag exits 2 with
a one-line error."""

import json

import pytest

from models.cpu import paged_attention
from tests.cli_env import run_module


def _run(*args, timeout=60):
  return run_module("launch.lab.bench_attention", *args, timeout=timeout)


@pytest.mark.skipif(not paged_attention.available(), reason="the native kernel needs AVX-512 F")
def test_tiny_bench_json():
  r = _run("--model", "tiny", "--rows", "2,3", "--context", "40", "--page_size", "16",
           "--rounds", "1", "--noscatter", "--noprefetch_l2", "--json")
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert (out["model"], out["context"], out["page_size"]) == ("tiny", 40, 16)
  assert (out["scatter"], out["prefetch_l2"]) == (False, False)
  assert [e["rows"] for e in out["rows"]] == [2, 3]
  for e in out["rows"]:
    assert e["ms"] > 0 and 0 < e["best_ms"] <= e["ms"] and e["gb_s"] > 0
  from models.config import get_preset
  c = get_preset("tiny")  # K and V, every layer, bf16
  assert out["rows"][0]["kv_bytes"] == 2 * c.num_layers * 2 * 40 * c.num_kv_heads * c.head_dim * 2


def test_bad_page_size_is_a_one_line_error():
  r = _run("--model", "tiny", "--page_size", "24")
  assert r.returncode == 2
  assert r.stderr.strip().startswith("error:") and "Traceback" not in r.stderr


@pytest.mark.parametrize("kernel", ["pallas_gpu", "gather"])
def test_the_accelerator_kernels_smoke(kernel):
  """The Pallas GPU kernel (interpreted here) and the gather path it replaces, as the device
  check times them, with the fraction of a preset's HBM bandwidth."""
  r = _run("--model", "tiny", "--rows", "2", "--context", "40", "--page_size", "16",
           "--rounds", "1", "--kernel", kernel, "--interpret", "--hardware", "h200", "--json")
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["kernel"] == kernel and out["rows"][0]["best_ms"] > 0
  assert 0 < out["rows"][0]["hbm_fraction"] < 1
