"""Autotune smoke test on tiny sizes: measures, predicts, caches, and hits the cache."""

from tests import paths
import json
import os
import subprocess
import sys


from models.config import get_preset
from launch.lab import tune_layouts as at
from partitioning import collectives
from partitioning.hardware import get_hardware
from partitioning.mesh import make_mesh
from tests.cli_env import CLI_XLA_FLAGS

CFG = get_preset("tiny").replace(num_heads=8, vocab_size=256)
PAIRS = [("ws_2d", "heads"), ("wg_xyz", "batch_xyz"), ("wg_xyz", "heads")]


def test_autotune_measures_predicts_and_hits_the_cache(tmp_path, monkeypatch):
  mesh = make_mesh()
  hw = get_hardware("h100")
  first = at.autotune(CFG, mesh, "decode", 8, 8, candidates=PAIRS, cache_dir=str(tmp_path),
                      hardware=hw, reps=1)
  assert not first.cache_hit
  assert (first.best_ffn, first.best_attn) in PAIRS[:2]
  by_pair = {(m.ffn, m.attn): m for m in first.measurements}
  assert by_pair["wg_xyz", "heads"].same_as == "wg_xyz+batch_xyz"  # same program, timed once
  for m in first.measurements:
    assert m.measured_s > 0 and m.predicted_s > 0, m
  assert json.load(open(tmp_path / at.CACHE_FILE))[first.key]["best_ffn"] == first.best_ffn

  def no_compiling(*args, **kwargs):
    raise AssertionError("a cache hit must not build steps")

  monkeypatch.setattr(collectives, "make_sharded_step", no_compiling)
  second = at.autotune(CFG, mesh, "decode", 8, 8, candidates=PAIRS, cache_dir=str(tmp_path),
                       hardware=hw, reps=1)
  assert second.cache_hit
  assert second.measurements == first.measurements and second.key == first.key
  other = at.cache_key(CFG, mesh, "prefill", 8, 8, False, PAIRS, hw, 1)
  assert other != first.key  # phase (and shape, model, devices) are part of the key
  assert at.cache_key(CFG, mesh, "decode", 8, 8, False, PAIRS, hw, 1) == first.key
  # The hardware priced the stored predictions, and reps made the timings: both in the key.
  assert at.cache_key(CFG, mesh, "decode", 8, 8, False, PAIRS, get_hardware("tpu-v4"), 1) \
      != first.key
  assert at.cache_key(CFG, mesh, "decode", 8, 8, False, PAIRS, hw, 3) != first.key


def test_predicted_is_none_without_hardware_or_for_rejected_combinations():
  mesh = make_mesh()
  assert at.predict(CFG, None, "ws_2d", "heads", mesh, "decode", 8, 8, False) == (None, "")
  one = make_mesh(shape=(1, 1, 8))
  predicted, note = at.predict(CFG, get_hardware("h100"), "ws_2d", "heads", one, "decode", 8, 8,
                               False)
  assert predicted is None and "cost model" in note


def test_cli_json_then_cache_hit(tmp_path):
  env = {**os.environ, "XLA_FLAGS": CLI_XLA_FLAGS}
  cmd = [sys.executable, "-m", "launch.lab.tune_layouts", "--fake_devices", "4", "--model", "tiny",
         "--phase", "prefill", "--batch", "4", "--seq", "8", "--candidates", "wg_xyz:heads",
         "--hardware", "none", "--reps", "1", "--cache_dir", str(tmp_path), "--json"]
  root = str(paths.REPO)
  out = [json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=root,
                                   env=env, timeout=120).stdout) for _ in range(2)]
  assert [o["cache_hit"] for o in out] == [False, True]
  assert out[0]["best_ffn"] == "wg_xyz" and "x4:" in out[0]["key"]
  assert out[0]["measurements"][0]["predicted_s"] is None
  bad = subprocess.run(cmd[:-1] + ["--model", "palm-540b"], capture_output=True, text=True,
                       cwd=root, env=env, timeout=60)
  assert bad.returncode == 2 and bad.stderr.startswith("error:")
