"""Write phaseserve params as a local Hugging Face checkpoint (Llama), the inverse of hf_import.

Contract: ``save_hf_checkpoint(cfg, params, out_dir, dtype="bfloat16", tokenizer=None) -> Path``
writes ``out_dir/config.json`` (``LlamaForCausalLM``, transformers 4.x and 5.x RoPE keys) and
``out_dir/model.safetensors`` (every tensor in ``dtype``: ``bfloat16``, ``float16`` or
``float32``), plus ``tokenizer.json`` when a ``tokenizers.Tokenizer`` is given. Only the Llama
family is written (SwiGLU, serial blocks, no Gemma embedding scale or ``1 + w`` norms, float
weights): anything else is a ``ValueError``. ``models.io.hf_import.load_hf_checkpoint`` of the result
gives back ``params`` exactly (after the cast to ``dtype``); transformers and vLLM load the
directory as a Llama checkpoint. ``byte_tokenizer()`` is the byte-level BPE of the presets'
``ByteTokenizer`` ids (bytes 0..255, no merges, then ``<s>``, ``</s>``, ``<pad>``) for models
without a tokenizer of their own (random presets), so every engine can load the directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import tokenizers
from safetensors.numpy import save_file

from models.config import ModelConfig
from models.weights import Params

_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def hf_config(cfg: ModelConfig, dtype: str = "bfloat16", bos_id: int | None = None,
              eos_id: int | None = None) -> dict[str, object]:
  """The ``config.json`` of ``cfg`` as a Llama checkpoint."""
  if cfg.activation != "swiglu" or cfg.parallel_block or cfg.embed_scale or cfg.norm_plus_one:
    raise ValueError(f"{cfg.name}: only Llama-family models (SwiGLU, serial blocks) can be "
                     "written as a Hugging Face checkpoint")
  out: dict[str, object] = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed_dim,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
      "torch_dtype": dtype, "dtype": dtype, "use_cache": True,
  }
  if bos_id is not None:
    out["bos_token_id"] = bos_id
  if eos_id is not None:
    out["eos_token_id"] = eos_id
  return out


def hf_tensors(cfg: ModelConfig, params: Params, dtype: str = "bfloat16"
               ) -> dict[str, np.ndarray]:
  """Every tensor of the checkpoint by its HF name, torch ``[out, in]`` layout, in ``dtype``."""
  if dtype not in _DTYPES:
    raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
  np_dtype = _DTYPES[dtype]

  def host(a: jax.Array | np.ndarray) -> np.ndarray:
    arr = np.asarray(a)
    if not np.issubdtype(arr.dtype, np.floating) and arr.dtype != ml_dtypes.bfloat16:
      raise ValueError(f"{cfg.name}: quantized ({arr.dtype}) weights cannot be written; "
                       "pass float params")
    return np.ascontiguousarray(arr.astype(np.float32).astype(np_dtype))

  d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  out = {"model.embed_tokens.weight": host(params["embed"]),
         "model.norm.weight": host(params["final_norm"])}
  for i, lw in enumerate(params["layers"]):
    p = f"model.layers.{i}."
    out[p + "input_layernorm.weight"] = host(lw["attn_norm"])
    out[p + "post_attention_layernorm.weight"] = host(lw["mlp_norm"])
    out[p + "self_attn.q_proj.weight"] = host(np.asarray(lw["q"]).reshape(d, n * h).T)
    out[p + "self_attn.k_proj.weight"] = host(np.asarray(lw["k"]).reshape(d, k * h).T)
    out[p + "self_attn.v_proj.weight"] = host(np.asarray(lw["v"]).reshape(d, k * h).T)
    out[p + "self_attn.o_proj.weight"] = host(np.asarray(lw["o"]).reshape(n * h, d).T)
    out[p + "mlp.gate_proj.weight"] = host(np.asarray(lw["gate"]).reshape(d, f).T)
    out[p + "mlp.up_proj.weight"] = host(np.asarray(lw["up"]).reshape(d, f).T)
    out[p + "mlp.down_proj.weight"] = host(np.asarray(lw["down"]).reshape(f, d).T)
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = host(np.asarray(params["unembed"]).T)
  return out


def byte_tokenizer() -> tokenizers.Tokenizer:
  """Byte-level tokens 0..255 (no merges) then ``<s>`` 256, ``</s>`` 257, ``<pad>`` 258."""
  from tokenizers import decoders, models, pre_tokenizers
  from models.text.tokenizer import bytes_to_unicode
  spelling = bytes_to_unicode()  # byte b -> its byte-level character; id b as ByteTokenizer
  tok = tokenizers.Tokenizer(models.BPE(vocab={spelling[b]: b for b in range(256)}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t in ("<s>", "</s>", "<pad>")])
  return tok


def save_hf_checkpoint(cfg: ModelConfig, params: Params, out_dir: str | os.PathLike[str],
                       dtype: str = "bfloat16", tokenizer: tokenizers.Tokenizer | None = None,
                       bos_id: int | None = None, eos_id: int | None = None) -> Path:
  """Writes the checkpoint directory (created if needed); returns its path."""
  if "layers" not in params or not isinstance(params["layers"], list):
    raise ValueError("params must hold per-layer weights (not stacked by --scan_layers)")
  root = Path(out_dir)
  root.mkdir(parents=True, exist_ok=True)
  config = hf_config(cfg, dtype, bos_id, eos_id)
  save_file(hf_tensors(cfg, params, dtype), str(root / "model.safetensors"),
            metadata={"format": "pt"})
  (root / "config.json").write_text(json.dumps(config, indent=1) + "\n")
  gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
  (root / "generation_config.json").write_text(json.dumps(gen) + "\n")
  if tokenizer is not None:
    tokenizer.save(str(root / "tokenizer.json"))
  return root


__all__ = ["byte_tokenizer", "hf_config", "hf_tensors", "save_hf_checkpoint"]
