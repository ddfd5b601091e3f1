"""Hugging Face import, checked against transformers' own logits from a Python 3.11 torch env.

Contract: ``tests/reference/make_hf_reference.py`` runs under the reference interpreter
(``$PHASESERVE_REF_PYTHON``, else ``<repo>/.venv-ref/bin/python``; torch + transformers, CPU, f32)
and writes tiny random Llama / Mistral / Gemma checkpoints with expected logits into
``tests/_ref_artifacts/hf/``, cached until the generator script's sha256 changes. A missing
reference interpreter FAILS these tests (it does not skip): ``make test`` builds ``.venv-ref``.

What is compared (per checkpoint, all float32 on CPU):
  * ``forward`` logits at every position vs torch's uncached forward;
  * ``jit_prefill`` of a 4-token prefix, then ``jit_decode_step`` per token vs torch's
    ``use_cache=True`` prefill + cached single-token steps;
  * ragged chunked ``jit_prefill`` (rows split at different points, padded chunks) vs torch's
    uncached forward.
Tolerance: ``atol = rtol = 1e-4`` on logits of O(1) (up to ~40 for the tied Llama). Both sides
compute in float32 and differ only in summation order and exp / tanh / sin / rsqrt kernels:
observed max |diff| is ~2e-6 (~1.2e-5 on the tied case), and torch's own cached-vs-uncached
logits differ by the same amount, so the bound has >= 10x headroom. Real mapping bugs are far
above it: a wrong RoPE base gives ~0.8, a missing Gemma sqrt(D) embedding scale ~5, exact instead
of tanh GELU ~9e-4, RMSNorm eps 1e-6 instead of the file's 1e-3 ~4e-3.
"""

from __future__ import annotations

from tests import paths

import json
import os
import shutil
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from models.config import from_hf_config
from models.io.hf_import import load_hf_checkpoint
from models.kv_cache import init_cache
from models.transformer import forward, jit_decode_step, jit_prefill
from tests import refenv
from tests.cli_env import CLI_XLA_FLAGS

REPO = refenv.REPO
GENERATOR = REPO / "tests" / "reference" / "make_hf_reference.py"
CASES = ("llama_mqa", "llama_gqa", "llama_mha_tied", "mistral_gqa", "gemma_mqa")
ATOL = RTOL = 1e-4
GEN_TIMEOUT_S = 300

EXPECTED_CFG = {  # field -> value read from each generated config.json
    "llama_mqa": dict(num_kv_heads=1, head_dim=8, rope_theta=500.0, norm_eps=1e-3,
                      tie_embeddings=False, activation="swiglu", embed_scale=False),
    "llama_gqa": dict(num_kv_heads=2, head_dim=8, rope_theta=10_000.0, norm_eps=1e-5,
                      tie_embeddings=False, activation="swiglu"),
    "llama_mha_tied": dict(num_kv_heads=4, head_dim=8, rope_theta=1000.0, tie_embeddings=True),
    "mistral_gqa": dict(num_kv_heads=2, rope_theta=2000.0, max_seq_len=32),
    "gemma_mqa": dict(num_kv_heads=1, head_dim=16, rope_theta=10_000.0, norm_eps=1e-3,
                      tie_embeddings=True, activation="geglu", embed_scale=True,
                      norm_plus_one=True),
}


def _complete(d: Path) -> bool:
  try:
    manifest = json.loads((d / "manifest.json").read_text())
  except (OSError, json.JSONDecodeError):
    return False
  return (tuple(manifest.get("cases", ())) == CASES
          and all((d / c / "logits_decode.npy").is_file() for c in CASES))


@pytest.fixture(scope="session")
def ref_dir() -> Path:
  """The reference artifacts, (re)generated when missing or when the generator changed."""
  return refenv.cached_artifacts("hf", GENERATOR, [], _complete, timeout_s=GEN_TIMEOUT_S)


@pytest.fixture(scope="session")
def loaded(ref_dir):
  """case -> (cfg, params, reference arrays); each checkpoint imported once per session."""
  out = {}
  for case in CASES:
    d = ref_dir / case
    cfg, params = load_hf_checkpoint(d)
    ref = {name: np.load(d / f"{name}.npy") for name in ("tokens", "logits_full", "logits_decode")}
    ref["prefix_len"] = json.loads((d / "meta.json").read_text())["prefix_len"]
    out[case] = (cfg, params, ref)
  return out


def _close(got, want, what: str) -> None:
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  err = float(np.max(np.abs(got - want)))
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL,
                             err_msg=f"{what}: max |diff| {err:.3g}")


@pytest.mark.parametrize("case", CASES)
def test_config_read_from_hf(loaded, case):
  cfg, params, ref = loaded[case]
  assert cfg.name == case and cfg.num_heads == 4 and cfg.embed_dim == 32 and cfg.num_layers == 2
  assert cfg.vocab_size == ref["logits_full"].shape[-1]
  for field, want in EXPECTED_CFG[case].items():
    assert getattr(cfg, field) == pytest.approx(want), field
  assert ("unembed" in params) == (not cfg.tie_embeddings)
  assert params["layers"][0]["q"].shape == (32, 4, cfg.head_dim)
  assert params["layers"][0]["k"].dtype == jnp.float32


@pytest.mark.parametrize("case", CASES)
def test_full_forward_matches_torch(loaded, case):
  cfg, params, ref = loaded[case]
  logits = forward(params, jnp.asarray(ref["tokens"]), cfg=cfg)
  _close(logits, ref["logits_full"], f"{case} full forward")


@pytest.mark.parametrize("case", CASES)
def test_prefill_then_decode_matches_torch_cache(loaded, case):
  cfg, params, ref = loaded[case]
  tokens, want = ref["tokens"], ref["logits_decode"]  # want[:, j]: position prefix_len - 1 + j
  b, t = tokens.shape
  p = ref["prefix_len"]
  cache = init_cache(cfg, b, 16)
  logits, cache = jit_prefill(params, jnp.asarray(tokens[:, :p]), cache, jnp.zeros((b,), jnp.int32),
                              jnp.full((b,), p, jnp.int32), cfg=cfg)
  _close(logits, want[:, 0], f"{case} prefill({p})")
  for j, pos in enumerate(range(p, t), start=1):
    logits, cache = jit_decode_step(params, jnp.asarray(tokens[:, pos]), cache, cfg=cfg)
    _close(logits, want[:, j], f"{case} decode step at position {pos}")
  np.testing.assert_array_equal(np.asarray(cache.lengths), [t] * b)


@pytest.mark.parametrize("case", ["llama_gqa", "gemma_mqa"])
def test_ragged_chunked_prefill_matches_torch(loaded, case):
  cfg, params, ref = loaded[case]
  tokens, want = ref["tokens"], ref["logits_full"]
  b, t = tokens.shape
  split = np.array([4, 7])  # row r: chunk 1 = tokens[r, :split[r]], chunk 2 = the rest
  cache = init_cache(cfg, b, 16)
  got = np.zeros_like(want)
  w1, w2 = int(split.max()), int(t - split.min())
  chunk1 = np.zeros((b, w1), np.int32)
  chunk2 = np.zeros((b, w2), np.int32)
  for r in range(b):
    chunk1[r, :split[r]] = tokens[r, :split[r]]
    chunk2[r, :t - split[r]] = tokens[r, split[r]:]
  logits1, cache = jit_prefill(params, jnp.asarray(chunk1), cache, jnp.zeros((b,), jnp.int32),
                               jnp.asarray(split, jnp.int32), cfg=cfg, all_logits=True)
  logits2, cache = jit_prefill(params, jnp.asarray(chunk2), cache, None,
                               jnp.asarray(t - split, jnp.int32), cfg=cfg, all_logits=True)
  for r in range(b):
    got[r, :split[r]] = np.asarray(logits1[r, :split[r]])
    got[r, split[r]:] = np.asarray(logits2[r, :t - split[r]])
  _close(got, want, f"{case} ragged chunked prefill")
  np.testing.assert_array_equal(np.asarray(cache.lengths), [t] * b)


def test_bfloat16_import(ref_dir):
  """Smoke test of the dtype argument: bf16 weights (8-bit mantissa) stay near the f32 logits."""
  cfg, params = load_hf_checkpoint(ref_dir / "gemma_mqa", dtype=jnp.bfloat16)
  assert params["embed"].dtype == jnp.bfloat16 and params["final_norm"].dtype == jnp.bfloat16
  ref = np.load(ref_dir / "gemma_mqa" / "logits_full.npy")
  logits = np.asarray(forward(params, jnp.asarray(np.load(ref_dir / "gemma_mqa" / "tokens.npy")),
                              cfg=cfg))
  assert np.max(np.abs(logits - ref)) < 0.15  # observed ~0.04 on logits of std ~1


# ---- tokenizer.json ----

TEXT = "The quick brown fox jumps over the lazy dog."


def test_tokenizer_json_loads(ref_dir):
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(str(ref_dir / "gemma_mqa" / "tokenizer.json"))
  ids = tok.encode(TEXT).ids
  assert ids and max(ids) < 320
  assert tok.decode(ids) == TEXT
  assert tok.token_to_id("</s>") == 2


def test_tokenizer_roundtrip_via_models_tokenizer(ref_dir, loaded):
  from models.text.tokenizer import load_tokenizer
  from tokenizers import Tokenizer
  for case in ("llama_gqa", "gemma_mqa"):
    d = ref_dir / case
    tok = load_tokenizer(str(d))
    raw = Tokenizer.from_file(str(d / "tokenizer.json")).encode(TEXT).ids
    ids = list(tok.encode(TEXT))
    assert ids == raw  # models.text.tokenizer: encode never adds special tokens
    assert tok.vocab_size <= loaded[case][0].vocab_size
    assert tok.decode(ids) == TEXT
    assert tok.decode([1] + ids + [2]) == TEXT  # special ids (<s>, </s>) are dropped
    assert tok.eos_id == 2  # </s>, as in config.json / generation_config.json


# ---- bad paths ----

def _copy(ref_dir: Path, case: str, tmp_path: Path) -> Path:
  dst = tmp_path / case
  shutil.copytree(ref_dir / case, dst)
  return dst


def _edit_config(d: Path, **changes) -> None:
  hf = json.loads((d / "config.json").read_text())
  hf.update(changes)
  (d / "config.json").write_text(json.dumps(hf))


def test_missing_directory(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    load_hf_checkpoint(tmp_path / "nope")


def test_missing_config(tmp_path):
  with pytest.raises(ValueError, match="no config.json"):
    load_hf_checkpoint(tmp_path)


def test_missing_safetensors(ref_dir, tmp_path):
  shutil.copy(ref_dir / "llama_mqa" / "config.json", tmp_path / "config.json")
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(ValueError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
    load_hf_checkpoint(tmp_path)


def test_missing_shard(ref_dir, tmp_path):
  d = _copy(ref_dir, "llama_gqa", tmp_path)
  shard = sorted(d.glob("model-*.safetensors"))[-1]
  shard.unlink()
  with pytest.raises(ValueError, match=f"missing.*{shard.name}"):
    load_hf_checkpoint(d)


@pytest.mark.parametrize("model_type,archs,match", [
    ("gpt2", ["GPT2LMHeadModel"], "unsupported architecture"),
    ("gemma2", None, "unsupported model_type 'gemma2'"),
])
def test_unsupported_architecture(ref_dir, tmp_path, model_type, archs, match):
  d = _copy(ref_dir, "llama_mqa", tmp_path)
  _edit_config(d, model_type=model_type, architectures=archs)
  with pytest.raises(ValueError, match=match):
    load_hf_checkpoint(d)


def test_missing_tensor(ref_dir, tmp_path):
  from safetensors.numpy import load_file, save_file
  d = _copy(ref_dir, "gemma_mqa", tmp_path)
  tensors = load_file(d / "model.safetensors")
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, d / "model.safetensors")
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
    load_hf_checkpoint(d)


def test_missing_lm_head_when_untied(ref_dir, tmp_path):
  d = _copy(ref_dir, "llama_mha_tied", tmp_path)  # tied: the file has no lm_head.weight
  _edit_config(d, tie_word_embeddings=False)
  with pytest.raises(ValueError, match="missing tensor 'lm_head.weight'"):
    load_hf_checkpoint(d)


def test_shape_mismatch(ref_dir, tmp_path):
  d = _copy(ref_dir, "llama_mqa", tmp_path)
  _edit_config(d, num_key_value_heads=2)
  with pytest.raises(ValueError, match=r"k_proj\.weight.*shape \(8, 32\).*implies \(16, 32\)"):
    load_hf_checkpoint(d)


def test_unexpected_tensors(ref_dir, tmp_path):
  d = _copy(ref_dir, "llama_mqa", tmp_path)
  _edit_config(d, num_hidden_layers=1)
  with pytest.raises(ValueError, match=r"unexpected tensors.*model\.layers\.1\."):
    load_hf_checkpoint(d)


@pytest.mark.parametrize("change,match", [
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
     "RoPE type 'llama3'"),
    (dict(hidden_act="gelu"), "unsupported hidden activation 'gelu'"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_unsupported_config(ref_dir, tmp_path, change, match):
  d = _copy(ref_dir, "llama_mqa", tmp_path)
  _edit_config(d, **change)
  with pytest.raises(ValueError, match=match):
    load_hf_checkpoint(d)


# ---- from_hf_config on transformers 4.x-style files ----

_LLAMA4X = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
                num_attention_heads=4, num_hidden_layers=2, intermediate_size=128, vocab_size=100,
                rope_theta=500_000.0, rope_scaling=None, rms_norm_eps=1e-5, hidden_act="silu")


def test_from_hf_config_transformers_4x_layout():
  cfg = from_hf_config(_LLAMA4X)
  assert (cfg.rope_theta, cfg.num_kv_heads, cfg.head_dim, cfg.tie_embeddings) == (5e5, 4, 16, False)
  with pytest.raises(ValueError, match="RoPE type 'linear'"):
    from_hf_config({**_LLAMA4X, "rope_scaling": {"type": "linear", "factor": 2.0}})
  gemma = from_hf_config(dict(  # gemma-7b style: legacy hidden_act "gelu" means tanh GELU
      architectures=["GemmaForCausalLM"], model_type="gemma", hidden_size=3072,
      num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=28,
      intermediate_size=24576, vocab_size=256000, hidden_act="gelu", hidden_activation=None))
  assert (gemma.activation, gemma.head_dim, gemma.tie_embeddings) == ("geglu", 256, True)
  assert (gemma.norm_eps, gemma.max_seq_len, gemma.embed_scale) == (1e-6, 8192, True)


def test_generate_cli_on_hf_checkpoint(ref_dir):
  """launch.generate --model <HF dir>: its tokenizer and weights, greedy tokens as a reference."""
  import sys
  from models import transformer as T
  from models.io.hf_import import load_hf_checkpoint
  from models.text.tokenizer import load_tokenizer
  path = ref_dir / "llama_mqa"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  r = subprocess.run([sys.executable, "-m", "launch.generate", "--model", str(path), "--prompt",
                      "hello world", "--max_tokens", "5", "--ignore_eos", "--json"],
                     cwd=paths.REPO, env=env, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  cfg, params = load_hf_checkpoint(path)
  tok = load_tokenizer(str(path))
  ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode("hello world")
  for _ in range(5):
    ids.append(int(jnp.argmax(T.forward(params, jnp.asarray([ids]), cfg=cfg)[0, -1])))
  assert out["token_ids"] == ids[-5:]


def test_config_missing_required_field_is_value_error():
  from models.config import from_hf_config
  with pytest.raises(ValueError, match="hidden_size"):
    from_hf_config({"model_type": "llama"})
