"""Tests for partitioning.planner and the launch.lab.plan CLI, incl. the paper's PaLM 540B choices."""

from tests import paths
import json
import os
import subprocess
import sys

import pytest

from models.config import get_preset
from partitioning import cost_model
from partitioning.hardware import get_hardware
from partitioning.planner import NoFeasiblePlan, mesh_shapes, plan

PALM = get_preset("palm-540b")
V4 = get_hardware("tpu-v4")
REPO = str(paths.REPO)


# Pope et al. 2023, Table 2 (PaLM 540B, 64 TPU v4 chips, context 2048): decode uses 2D
# weight-stationary FFN with batch-sharded multiquery attention (batch 64 int8 and batch 512);
# prefill at batch 512 uses a weight-gathered FFN; prefill at batch 1 uses 2D weight-stationary.
@pytest.mark.parametrize("batch", [64, 128, 256, 512])
@pytest.mark.parametrize("weights", ["int8", "bf16"])
def test_paper_decode_is_2d_weight_stationary_batch_attention(batch, weights):
  best = plan(PALM, V4, 64, "decode", batch, 2048, weights=weights).best
  assert best.layout == "ws_2d"
  assert best.attention.startswith("batch_")
  assert best.mesh[0] in (2, 4, 8)  # X near sqrt(n*E/F) = 4


def test_paper_large_batch_prefill_is_weight_gathered():
  result = plan(PALM, V4, 64, "prefill", 512, 2048)
  best = result.best
  assert best.layout.startswith("wg_")
  # Batch-sharded attention. A weight-gathered layout keeps its batch axes in attention (as the
  # sharding code does), so even its `heads` variant is batch-sharded over the gathered axes:
  # the attention batch is split over more than one chip and the KV cache is not replicated.
  assert cost_model.attention_batch_chips(best.layout, best.attention, best.mesh) > 1
  total_kv = cost_model.kv_cache_bytes(PALM, 512, 2048)
  assert best.cost.kv_bytes_per_chip <= total_kv / 16
  # The model is an optimistic bound: it must not predict less than the paper's measured 76%.
  assert result.best.mfu >= 0.76


@pytest.mark.parametrize("weights", ["int8", "bf16"])
def test_paper_batch_one_prefill_is_2d_weight_stationary(weights):
  best = plan(PALM, V4, 64, "prefill", 1, 2048, weights=weights).best
  assert best.layout == "ws_2d"
  assert best.attention == "heads"  # batch 1 cannot be batch-sharded


def test_decode_latency_is_a_lower_bound_on_the_paper():
  best = plan(PALM, V4, 64, "decode", 64, 2048, weights="int8").best
  assert 0.005 < best.latency_s <= 0.029  # paper: 28.5 ms/token measured


def test_more_chips_lower_decode_latency_2d():
  latencies = []
  for chips in (64, 128, 256):
    result = plan(PALM, V4, chips, "decode", 512, 2048)
    latencies.append(min(c.latency_s for c in result.candidates if c.layout == "ws_2d"))
  assert latencies[0] > latencies[1] > latencies[2]


def test_hbm_rejection_drops_replicated_kv():
  result = plan(PALM, V4, 64, "decode", 512, 2048)
  assert all(c.fits for c in result.candidates)
  # No candidate keeps the multiquery cache whole on every chip (ws_* + heads); wg_* + heads
  # shards it over the gathered axes and may stay.
  total_kv = cost_model.kv_cache_bytes(PALM, 512, 2048)
  assert all(c.cost.kv_bytes_per_chip < total_kv for c in result.candidates)
  assert all(c.attention != "heads" for c in result.candidates if c.layout.startswith("ws_"))
  assert any(d.layout == "ws_2d" and d.attention == "heads" and "HBM" in d.reason
             for d in result.dropped)
  with pytest.raises(NoFeasiblePlan, match="HBM"):
    plan(PALM, V4, 8, "decode", 64, 2048)


def test_candidates_sorted_valid_and_deduplicated():
  result = plan(PALM, V4, 64, "decode", 64, 2048)
  lat = [c.latency_s for c in result.candidates]
  assert lat == sorted(lat) and result.best is result.candidates[0]
  assert all(c.mesh[0] * c.mesh[1] * c.mesh[2] == 64 for c in result.candidates)
  keys = [(c.layout, c.attention, c.cost) for c in result.candidates]
  assert len(keys) == len(set(keys))
  # ws_1d runs on any mesh and costs the same on each: reported once, on the most cubic mesh.
  assert [c.mesh for c in result.candidates
          if (c.layout, c.attention) == ("ws_1d", "heads")] in ([], [(4, 4, 4)])
  # Attention names running the same program are reported once (wg_xyz: as batch_xyz).
  assert all(cost_model.canonical_attention(c.layout, c.attention, c.mesh) == c.attention
             for c in result.candidates)
  assert len(mesh_shapes(8)) == 10 and (2, 2, 2) in mesh_shapes(8)


def test_cost_objective_and_latency_bound():
  fast = plan(PALM, V4, 64, "decode", 64, 2048, weights="int8")
  cheap = plan(PALM, V4, 64, "decode", 64, 2048, weights="int8", objective="cost")
  assert cheap.best.cost_chip_s_per_token <= fast.best.cost_chip_s_per_token
  assert 64 % cheap.best.cost.n_chips == 0
  bound = fast.best.latency_s * 1.05
  bounded = plan(PALM, V4, 64, "decode", 64, 2048, weights="int8", latency_bound_s=bound)
  assert all(c.latency_s <= bound for c in bounded.candidates)
  with pytest.raises(NoFeasiblePlan, match="latency"):
    plan(PALM, V4, 64, "decode", 64, 2048, latency_bound_s=1e-4)


def test_meshes_restrict_the_choice_to_the_mesh_that_runs_it():
  """On 6 H100s the unrestricted best decode layout (ws_1d+batch_z) is on (1, 3, 2); the
  balanced (1, 2, 3) that make_mesh builds cannot split batch 64 over z = 3. Restricted to that
  mesh, every candidate is on it and valid there."""
  cfg, hw = get_preset("small"), get_hardware("h100")
  free = plan(cfg, hw, 6, "decode", 64, 2048).best
  assert (free.layout, free.attention, free.mesh) == ("ws_1d", "batch_z", (1, 3, 2))
  assert cost_model.check_layout("ws_1d", "batch_z", (1, 2, 3), 64) is not None
  fixed = plan(cfg, hw, 6, "decode", 64, 2048, meshes=[(1, 2, 3)])
  assert {c.mesh for c in fixed.candidates} == {(1, 2, 3)}
  assert all(cost_model.check_layout(c.layout, c.attention, c.mesh, 64) is None
             for c in fixed.candidates)


def test_bad_arguments():
  with pytest.raises(ValueError):
    plan(PALM, V4, 0, "decode", 64, 2048)
  with pytest.raises(ValueError):
    plan(PALM, get_hardware("h100"), 16, "decode", 64, 2048)  # beyond one NVLink domain
  with pytest.raises(ValueError):
    plan(PALM, V4, 64, "decode", 64, 2048, objective="speed")  # type: ignore[arg-type]


def _cli(*args):
  env = dict(os.environ, PYTHONPATH=REPO)
  return subprocess.run([sys.executable, "-m", "launch.lab.plan", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=120)


def test_cli_json():
  proc = _cli("--model", "palm-540b", "--hardware", "tpu-v4", "--chips", "64", "--phase",
              "prefill", "--batch", "512", "--context", "2048", "--json")
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout)
  assert out["layout"].startswith("wg_") and len(out["mesh"]) == 3
  assert {"attention", "latency_s", "mfu", "cost_chip_s_per_token"} <= set(out)
  assert 1 <= len(out["candidates"]) <= 10
  assert out["candidates"][0]["layout"] == out["layout"]


@pytest.mark.parametrize("args", [["--model", "nope"], ["--hardware", "tpu-v9"],
                                  ["--chips", "0"], ["--chips", "abc"], ["--bogus_flag"],
                                  ["--chips", "8", "--phase", "decode"]])
def test_cli_bad_flags_exit_2(args):
  proc = _cli(*args)
  assert proc.returncode == 2
  assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
  assert "Traceback" not in proc.stderr
