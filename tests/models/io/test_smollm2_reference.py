"""SmolLM2-135M-Instruct from its GGUF file, checked against transformers loading the same file.

Contract: ``tests/reference/make_gguf_reference.py`` runs under the Python 3.11 reference env
(torch + transformers + gguf, f32; FAILS, never skips, without it) and writes transformers' logits
for three prompts (a rendered chat, two plain texts) and its greedy 32-token continuations
(EOS ignored), cached in ``tests/_ref_artifacts/smollm2`` until the script or the GGUF file
changes. transformers dequantizes the file and undoes llama.cpp's Q/K permutation with its own
code, so this checks ``models.io.gguf_import`` end to end on real trained weights.

Compared, phaseserve in f32 on CPU:
  * the full causal forward, every position's logits (prompts as one ragged batch);
  * a 6-token prefill, then one ``decode_step`` per prompt token, against transformers' cached
    prefill + cached single-token steps;
  * the greedy continuation of 32 tokens through ``serving.generator.Generator``: identical
    (the reference's smallest top-2 logit margin on these continuations is about 0.05, far
    above the f32 differences).
Tolerance: ``max |ours - ref| <= 1e-4 * max|ref|`` (logits of this model reach 20-40). Both
sides compute in f32 from the same dequantized values and differ only in summation order and
transcendental kernels over 30 layers; a wrong Q/K un-permutation, RoPE base or norm eps moves
logits by O(1).
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from models.io.gguf_import import installed_smollm2_path, load_gguf
from models.kv_cache import init_cache
from models.transformer import jit_decode_step, jit_prefill
from serving.generator import Generator
from serving.sampling import SamplingParams
from tests import refenv

SCRIPT = refenv.REPO / "tests" / "reference" / "make_gguf_reference.py"
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def gguf_path():
  return installed_smollm2_path()


@pytest.fixture(scope="module")
def ref(gguf_path):
  def complete(d):
    meta = refenv.read_json(d / "meta.json")
    return all((d / f"case{i}.npz").is_file() for i in range(meta["cases"]))

  key = refenv.script_key(SCRIPT, str(gguf_path.stat().st_size))
  d = refenv.cached_artifacts("smollm2", SCRIPT, [str(gguf_path)], complete, key=key,
                              timeout_s=600)
  meta = refenv.read_json(d / "meta.json")
  return meta, [dict(np.load(d / f"case{i}.npz")) for i in range(meta["cases"])]


@pytest.fixture(scope="module")
def model(gguf_path):
  return load_gguf(gguf_path, jnp.float32)


def _close(got, want, what):
  err = float(np.max(np.abs(np.asarray(got, np.float32) - want)))
  scale = float(np.max(np.abs(want)))
  assert err <= REL_TOL * scale, f"{what}: max |diff| {err:.3g} > {REL_TOL} x {scale:.3g}"
  return err / scale


def test_full_forward_matches_transformers(model, ref):
  """All prompts as one ragged, padded batch (one compiled program): every position's logits."""
  cfg, params = model
  _, cases = ref
  lens = [len(c["tokens"]) for c in cases]
  toks = np.zeros((len(cases), 64), np.int32)
  for i, c in enumerate(cases):
    toks[i, :lens[i]] = c["tokens"]
  cache = init_cache(cfg, len(cases), 64, jnp.float32)
  logits, _ = jit_prefill(params, jnp.asarray(toks), cache, jnp.zeros((len(cases),), jnp.int32),
                          jnp.asarray(lens, jnp.int32), cfg=cfg, all_logits=True)
  for i, case in enumerate(cases):
    _close(logits[i, :lens[i]], case["logits_full"], f"case {i} full forward")


def test_prefill_then_decode_matches_transformers_cache(model, ref):
  cfg, params = model
  meta, cases = ref
  p = meta["prefix_len"]
  for i, case in enumerate(cases):
    toks = case["tokens"]
    cache = init_cache(cfg, 1, 64, jnp.float32)
    logits, cache = jit_prefill(params, jnp.asarray(toks[None, :p]), cache,
                                jnp.zeros((1,), jnp.int32), jnp.asarray([p], jnp.int32), cfg=cfg)
    steps = [logits[0]]
    for t in range(p, len(toks)):
      logits, cache = jit_decode_step(params, jnp.asarray(toks[t:t + 1]), cache, cfg=cfg)
      steps.append(logits[0])
    _close(np.stack(steps), case["logits_decode"], f"case {i} prefill + decode")


def test_greedy_continuation_identical(model, ref):
  """The three prompts as one ragged batch through the generator (rows never see each other)."""
  cfg, params = model
  meta, cases = ref
  gen = Generator(cfg, params, max_len=128, steps_per_call=8)
  steps = list(gen.stream([c["tokens"].tolist() for c in cases], meta["new_tokens"],
                          SamplingParams(), stop_ids=()))
  for i, case in enumerate(cases):
    out = [int(s[i]) for s in steps]
    want = case["greedy"].tolist()
    if out != want:
      j = next(j for j, (a, b) in enumerate(zip(out, want)) if a != b)
      pytest.fail(f"case {i}: greedy tokens differ from position {j} (reference top-2 margin "
                  f"there {case['greedy_margin'][j]:.3f}): {out} != {want}")
