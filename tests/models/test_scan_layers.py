"""Layers in one ``lax.scan`` (``models.weights.stack_layers``, ``UnshardedStep(scan_layers=True)``,
``--scan_layers``): the same logits as the Python loop over layers (f32: 1e-6 relative; int8
weights: 1e-5, the native kernels sum in another order), the compiled program does not grow with
depth (a control: the unrolled one does; its lowered module does not, the block being traced once), the serving engine gives the same greedy ids, and the
benchmark's smoke run."""

from tests import paths
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import paged_kv as PK, transformer as T
from models.config import get_preset
from models.step import UnshardedStep
from tests.cpu_policies import NATIVE
from models.text.tokenizer import ByteTokenizer
from models.weights import init_params, is_stacked, quantize, stack_layers
from serving import stack
from partitioning.deployment import Deployment
from serving.request import Request
from serving.stop import StopCriteria
from tests.cli_env import CLI_XLA_FLAGS

ROOT = str(paths.REPO)
CFG = get_preset("tiny").replace(num_layers=5, num_heads=4, num_kv_heads=2, head_dim=32)


def _close(got, ref, c, what):
  err = float(jnp.max(jnp.abs(got - ref)))
  assert err <= c * max(1.0, float(jnp.max(jnp.abs(ref)))), (what, err)


@pytest.mark.parametrize("int8", [False, True])
def test_scan_equals_the_loop(int8):
  params = init_params(CFG, jax.random.key(0), jnp.float32)
  if int8:
    params = quantize(params, CFG)
  stacked = stack_layers(params)
  assert is_stacked(stacked) and not is_stacked(params)
  assert jax.tree.leaves(stacked["layers"])[0].shape[0] == CFG.num_layers
  rng = np.random.default_rng(0)
  toks = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 24)), jnp.int32)
  lens = jnp.asarray([24, 9, 3], jnp.int32)
  out = []
  for p in (params, stacked):
    kv = PK.init_paged(CFG, 3, 24, 16, 8, jnp.float32, backend=NATIVE).replace(
        page_table=jnp.arange(24, dtype=jnp.int32).reshape(3, 8))
    l1, kv = T.jit_prefill(p, toks, kv, None, lens, cfg=CFG, attend_len=32, backend=NATIVE)
    l2, _ = T.jit_decode_step(p, toks[:, 0], kv, cfg=CFG, attend_len=32, backend=NATIVE)
    out.append((l1, l2))
  for g, r in zip(out[1], out[0]):
    _close(g, r, 1e-5 if int8 else 1e-6, "scan vs loop")


def _hlo_len(layers: int, scan: bool, compiled: bool = False) -> int:
  cfg = CFG.replace(num_layers=layers)
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), jnp.float32))
  if scan:
    params = jax.eval_shape(stack_layers, params)
  kv = jax.eval_shape(lambda: PK.init_paged(cfg, 2, 8, 16, 4, jnp.float32))
  tok = jax.ShapeDtypeStruct((2,), jnp.int32)
  fn = jax.jit(lambda p, t, c: T.decode_step(p, t, c, cfg=cfg, attend_len=64))
  lowered = fn.lower(params, tok, kv)
  return len(lowered.compile().as_text() if compiled else lowered.as_text())


def test_the_scanned_program_does_not_grow_with_depth():
  assert _hlo_len(16, True, compiled=True) < 1.1 * _hlo_len(4, True, compiled=True)
  # control: the unrolled program does (XLA inlines the per-layer calls)
  assert _hlo_len(16, False, compiled=True) > 2.5 * _hlo_len(4, False, compiled=True)


def test_the_unrolled_loop_traces_and_lowers_its_block_once():
  """``models.transformer`` calls one jitted block per layer: the lowered module holds the block
  once and a call per layer, so tracing and lowering do not grow with depth either."""
  assert _hlo_len(16, False) < 1.3 * _hlo_len(4, False)


def test_the_engine_gives_the_same_ids():
  params = init_params(CFG, jax.random.key(1), jnp.float32)
  got = {}
  for scan in (False, True):
    loop = stack.build(UnshardedStep(CFG, scan, NATIVE), params, ByteTokenizer(), stack.ServingConfig(
        max_slots=2, page_size=16, kv_pages=16, max_chunk=16, max_context=64))
    ids: dict[str, list[int]] = {}
    for i, prompt in enumerate(((5, 6, 7, 8), tuple(range(20, 50)))):
      loop.submit(Request(f"r{i}", prompt, stop=StopCriteria(8, ignore_eos=True)),
                  lambda o: ids.setdefault(o.request_id, []).extend(o.token_ids))
    loop.run_until_idle()
    got[scan] = ids
  assert got[True] == got[False] and len(got[True]["r1"]) == 8


def test_scan_layers_needs_mode_single():
  with pytest.raises(ValueError, match="mode single"):
    Deployment("interleaved", scan_layers=True)


def test_bench_compile_smoke():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  r = subprocess.run([sys.executable, "-m", "launch.lab.bench_compile", "--layers", "2",
                      "--max_slots", "1", "--max_context", "32", "--max_chunk", "16",
                      "--speed_model", "tiny", "--batch", "1", "--context", "32", "--steps", "1",
                      "--prefill", "16",
                      "--repeats", "1", "--json"], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=240)
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert [(x["layers"], x["mode"]) for x in out["compile"]] == [(2, "unrolled"), (2, "scan")]
  assert all(x["warmup_s"] > 0 and x["programs"] > 0 for x in out["compile"])
  assert [r["case"] for r in out["steps"]["steps"]] == ["decode_1", "prefill_1x16"]
  assert all(r["unrolled_ms"] > 0 and r["scan_ms"] > 0 for r in out["steps"]["steps"])
