"""Checkpoint imports straight into their shards: peak host memory and bytes read, measured.

Each import runs in a fresh worker process (``tests/workers/load_shards.py``, 8 fake CPU devices,
the ``ws_2d`` layout's resident shardings, bf16), so its peak is the import's own. The measure
(``tests.peak_memory.ExcessWatch``) is the worst, over samples every 0.5 ms and at every buffer
made, of anonymous memory minus the bytes of the param buffers placed so far; the bound is
``1.3 x the largest single tensor + MARGIN`` (the runtime's own growth while loading: thread
pools, allocator arenas; measured 13-26 MB). A whole extra copy of the checkpoint cannot fit
under it: the naive control (load on one device, then ``device_put`` into the shards) is
checked to exceed it. orbax keeps a 100 MB tensorstore cache of what it reads
(``cache_pool#ocdbt``, fixed by orbax), so its bound adds ``ORBAX_CACHE``.

The default suite uses a 133 MB checkpoint; the 1 GB one (the issue's size) is ``slow``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from models.config import ModelConfig
from launch.lab.hf_export import save_hf_checkpoint
from models.weights import ArrayInfo, param_infos
from tests.multiproc import run_workers, worker_env
from tests.refenv import REPO

MiB = 1 << 20
MARGIN = 32 * MiB
ORBAX_CACHE = 100_000_000
WORKER = "tests.workers.load_shards"
TIMEOUT_S = 240


def _cfg(layers: int, d: int) -> ModelConfig:
  return ModelConfig(name="mem", vocab_size=32000, embed_dim=d, num_layers=layers, num_heads=8,
                     num_kv_heads=8, head_dim=d // 8, mlp_dim=4 * d, max_seq_len=256)


SMALL = _cfg(8, 512)  # 133 MB of bf16; largest tensor (embed) 32.8 MB
LARGE = _cfg(26, 1024)  # 1.00 GB of bf16; largest 65.5 MB


def _write_hf(cfg: ModelConfig, out) -> None:
  rng = np.random.default_rng(0)

  def one(info: ArrayInfo) -> np.ndarray:
    if info.init != "normal":
      return np.ones(info.shape, ml_dtypes.bfloat16)
    return (rng.standard_normal(info.shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)

  params = jax.tree.map(one, param_infos(cfg), is_leaf=lambda x: isinstance(x, ArrayInfo))
  save_hf_checkpoint(cfg, params, out)


@pytest.fixture(scope="module")
def small_hf(tmp_path_factory):
  out = tmp_path_factory.mktemp("mem") / "small_hf"
  _write_hf(SMALL, out)
  return out


@pytest.fixture(scope="module")
def large_hf(tmp_path_factory):
  out = tmp_path_factory.mktemp("mem") / "large_hf"
  _write_hf(LARGE, out)
  return out


def _orbax_from(hf_dir, out) -> None:
  """An orbax checkpoint saved from the sharded params (as a serving process would save)."""
  code = (
      "import sys, jax.numpy as jnp\n"
      "from models.io import loader, hf_import, checkpoint\n"
      "from partitioning.layouts import param_shardings\n"
      "from partitioning.mesh import make_mesh\n"
      "cfg = loader.load_config(sys.argv[1])\n"
      "_, p = hf_import.load_hf_checkpoint(sys.argv[1], jnp.bfloat16, "
      "shardings=param_shardings(cfg, make_mesh(), 'ws_2d'))\n"
      "checkpoint.save_params(sys.argv[2], p, cfg)\n")
  subprocess.run([sys.executable, "-c", code, str(hf_dir), str(out)], cwd=REPO,
                 env=worker_env(8), check=True, timeout=TIMEOUT_S, capture_output=True)


def _result(output: str) -> dict:
  lines = [l for l in output.splitlines() if l.startswith("RESULT ")]
  assert lines, output[-3000:]
  return json.loads(lines[-1][len("RESULT "):])


def _one_process(checkpoint, *flags: str) -> dict:
  proc = subprocess.run(
      [sys.executable, "-m", WORKER, "--coordinator_address", "127.0.0.1:1", "--num_processes",
       "1", "--process_id", "0", "--checkpoint", str(checkpoint), *flags],
      cwd=REPO, env=worker_env(8), capture_output=True, text=True, timeout=TIMEOUT_S)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return _result(proc.stdout)


def _bound(r: dict, extra: int = 0) -> int:
  return int(1.3 * r["largest"]) + MARGIN + extra


def _check_direct(r: dict, extra: int = 0) -> None:
  assert r["shards_ok"], r
  assert r["excess"] <= _bound(r, extra), (
      f"import held {r['excess'] / MiB:.1f} MiB beyond its placed shards; bound "
      f"{_bound(r, extra) / MiB:.1f} MiB (largest tensor {r['largest'] / MiB:.1f} MiB)")


def _half_of_the_shards(cfg: ModelConfig) -> int:
  """Bytes of bf16 params on 4 of the 8 devices of the ws_2d layout (every shard the same size)."""
  from models.weights import abstract_params
  from partitioning.layouts import param_shardings
  from partitioning.mesh import make_mesh
  shardings = param_shardings(cfg, make_mesh(), "ws_2d")  # this process has 8 fake devices
  return sum(math.prod(s.shard_shape(a.shape)) * 2 * 4 for a, s in zip(
      jax.tree.leaves(abstract_params(cfg, jnp.bfloat16)), jax.tree.leaves(shardings)))


def _expected_sums(hf_dir) -> dict[str, float]:
  from models.io.hf_import import load_hf_checkpoint
  _, params = load_hf_checkpoint(hf_dir, jnp.bfloat16)
  return {jax.tree_util.keystr(k): float(jnp.sum(a.astype(jnp.float32)))
          for k, a in jax.tree_util.tree_flatten_with_path(params)[0]}


def _check_sums(got: dict[str, float], want: dict[str, float]) -> None:
  assert set(got) == set(want)
  for k in want:  # f32 sums of the same bf16 values in another order
    assert abs(got[k] - want[k]) <= 1e-3 * max(1.0, abs(want[k])), (k, got[k], want[k])


def test_hf_import_into_shards_memory(small_hf):
  r = _one_process(small_hf)
  _check_direct(r)
  assert r["read"] == r["held"]  # one read per distinct shard, nothing more


def test_naive_whole_copy_exceeds_the_bound(small_hf):
  """The control: the old path (whole on one device, then device_put) cannot pass."""
  r = _one_process(small_hf, "--mode", "naive")
  assert r["shards_ok"]
  assert r["excess"] > _bound(r) + 64 * MiB, r


def test_hf_import_int8_memory(small_hf):
  r = _one_process(small_hf, "--quantize")
  _check_direct(r)
  # Scales need whole rows: a shard whose contracted axis is split reads its rows once more.
  assert r["held"] <= r["read"] <= 2 * r["held"]


@pytest.mark.slow  # 12 s: both processes compile the per-weight init programs on 2 vCPUs
def test_two_processes_random_init_into_their_shards(tmp_path):
  """Each process generates only its devices' shards; the values are the unsharded init's."""
  from models.config import get_preset
  from models.weights import init_params
  cfg = get_preset("tiny")
  workers = run_workers(tmp_path, [WORKER, "--checkpoint", "tiny", "--kind", "init", "--sums"],
                        n=2, devices=4, timeout=TIMEOUT_S)
  params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
  want = {jax.tree_util.keystr(k): float(jnp.sum(a.astype(jnp.float32)))
          for k, a in jax.tree_util.tree_flatten_with_path(params)[0]}
  for w in workers:
    assert w.returncode == 0, w.output[-3000:]
    r = _result(w.output)
    assert r["shards_ok"] and r["placed"] == _half_of_the_shards(cfg), r
    _check_sums(r["sums"], want)


@pytest.fixture(scope="module")
def small_orbax(small_hf, tmp_path_factory):
  out = tmp_path_factory.mktemp("mem") / "small_orbax"
  _orbax_from(small_hf, out)
  return out


def test_orbax_restore_into_shards_memory(small_orbax):
  _check_direct(_one_process(small_orbax, "--kind", "orbax"), extra=ORBAX_CACHE)


def test_two_processes_restore_orbax_into_their_shards(small_hf, small_orbax, tmp_path):
  workers = run_workers(tmp_path, [WORKER, "--checkpoint", str(small_orbax), "--kind", "orbax",
                                   "--sums"], n=2, devices=4, timeout=TIMEOUT_S)
  want = _expected_sums(small_hf)
  for w in workers:
    assert w.returncode == 0, w.output[-3000:]
    r = _result(w.output)
    _check_direct(r, extra=ORBAX_CACHE)
    assert r["placed"] == _half_of_the_shards(SMALL), r  # its own 4 devices' shards only
    _check_sums(r["sums"], want)


def test_two_processes_read_and_hold_only_their_shards(small_hf, tmp_path):
  workers = run_workers(tmp_path, [WORKER, "--checkpoint", str(small_hf), "--sums"], n=2,
                        devices=4, timeout=TIMEOUT_S)
  results = []
  for w in workers:
    assert w.returncode == 0, w.output[-3000:]
    results.append(_result(w.output))
  file_bytes = (small_hf / "model.safetensors").stat().st_size
  want = _expected_sums(small_hf)
  for r in results:
    _check_direct(r)
    assert r["read"] == r["held"] < 0.75 * file_bytes, r  # about half: its 4 of 8 devices
    assert r["placed"] == _half_of_the_shards(SMALL), r
    _check_sums(r["sums"], want)


def _report(label: str, r: dict, extra: int = 0) -> None:
  """One line per measurement (``pytest -s -m slow`` shows them; BUILD_NOTES quotes them)."""
  print(f"MEASURED {label}: excess {r['excess'] / MiB:.1f} MiB, bound "
        f"{_bound(r, extra) / MiB:.1f} MiB, placed {r['placed'] / MiB:.1f} MiB, read "
        f"{r['read'] / MiB:.1f} MiB, peak {r['peak'] / MiB:.1f} MiB")


@pytest.mark.slow
def test_1gb_hf_import_memory(large_hf, tmp_path):
  r = _one_process(large_hf)
  _report("hf 1 process", r)
  _check_direct(r)
  assert r["read"] == r["held"]
  naive = _one_process(large_hf, "--mode", "naive")
  _report("hf naive control", naive)
  assert naive["excess"] > _bound(naive) + 256 * MiB, naive
  q = _one_process(large_hf, "--quantize")
  _report("hf int8 1 process", q)
  _check_direct(q)
  for w in run_workers(tmp_path, [WORKER, "--checkpoint", str(large_hf)], n=2, devices=4,
                       timeout=TIMEOUT_S):
    assert w.returncode == 0, w.output[-3000:]
    r2 = _result(w.output)
    _report(f"hf 2 processes, process {r2['process']}", r2)
    _check_direct(r2)
    assert r2["read"] == r2["held"]
    assert r2["placed"] == _half_of_the_shards(LARGE), r2


@pytest.mark.slow
def test_1gb_orbax_restore_memory(large_hf, tmp_path):
  _orbax_from(large_hf, tmp_path / "orbax")
  r = _one_process(tmp_path / "orbax", "--kind", "orbax")
  _report("orbax 1 process", r, ORBAX_CACHE)
  _check_direct(r, extra=ORBAX_CACHE)
  naive = _one_process(tmp_path / "orbax", "--kind", "orbax", "--mode", "naive")
  _report("orbax naive control", naive, ORBAX_CACHE)
  assert naive["excess"] > _bound(naive, ORBAX_CACHE), naive
  for w in run_workers(tmp_path, [WORKER, "--checkpoint", str(tmp_path / "orbax"), "--kind",
                                  "orbax"], n=2, devices=4, timeout=TIMEOUT_S):
    assert w.returncode == 0, w.output[-3000:]
    r2 = _result(w.output)
    _report(f"orbax 2 processes, process {r2['process']}", r2, ORBAX_CACHE)
    _check_direct(r2, extra=ORBAX_CACHE)
    assert r2["placed"] == _half_of_the_shards(LARGE), r2
