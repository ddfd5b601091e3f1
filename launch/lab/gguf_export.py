"""Write phaseserve params as a Llama GGUF file (llama.cpp's layout), the inverse of gguf_import.

Contract: ``write_gguf(cfg, params, path, qtype="BF16", tokenizer_from=None) -> Path`` writes
``general.architecture = llama`` with the ``llama.*`` hyperparameters of ``cfg`` and every tensor
under llama.cpp's names (``token_embd``, ``blk.N.attn_q`` ..., ``output_norm``, ``output`` when
untied). Q and K rows are permuted as llama.cpp's converter does (``llama_permute``, the inverse
of ``gguf_import.undo_llama_permute``). ``qtype``: ``F32``, ``F16``, ``BF16`` or ``Q8_0`` for
every 2-D weight (the embedding included, as ``llama-quantize`` does); norm vectors stay F32.
Q8_0 needs every row length to be a multiple of 32 (a ``ValueError`` otherwise). The tokenizer:
every ``tokenizer.*`` key copied from the GGUF file ``tokenizer_from`` (so llama.cpp tokenizes as
the source model does), else ``tokenizer.ggml.model = none`` (llama.cpp's no-vocab models; ids
only). ``models.io.gguf_import.load_gguf`` of a F32 / F16 / BF16 result gives ``params`` back (cast).
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

from models.config import ModelConfig
from models.weights import Params

QTYPES = ("F32", "F16", "BF16", "Q8_0")
_FILE_TYPES = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
               "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}


def llama_permute(w_RC: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp ``convert_hf_to_gguf.LlamaModel.permute`` on a ``[n_heads * H, ...]`` Q or K."""
  rows = w_RC.shape[0]
  if n_heads <= 0 or rows % (2 * n_heads):
    raise ValueError(f"cannot permute {rows} rows over {n_heads} heads of even size")
  return (w_RC.reshape(n_heads, 2, rows // n_heads // 2, *w_RC.shape[1:])
          .swapaxes(1, 2).reshape(w_RC.shape))


def _tensors(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
  """f32 numpy tensors by GGUF name, each shaped as llama.cpp's numpy view ([rows, cols])."""
  def f32(a) -> np.ndarray:
    return np.asarray(a).astype(np.float32)

  d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  out = {"token_embd.weight": f32(params["embed"]), "output_norm.weight": f32(params["final_norm"])}
  for i, lw in enumerate(params["layers"]):
    p = f"blk.{i}."
    out[p + "attn_norm.weight"] = f32(lw["attn_norm"])
    out[p + "ffn_norm.weight"] = f32(lw["mlp_norm"])
    out[p + "attn_q.weight"] = llama_permute(f32(lw["q"]).reshape(d, n * h).T, n)
    out[p + "attn_k.weight"] = llama_permute(f32(lw["k"]).reshape(d, k * h).T, k)
    out[p + "attn_v.weight"] = f32(lw["v"]).reshape(d, k * h).T
    out[p + "attn_output.weight"] = f32(lw["o"]).reshape(n * h, d).T
    out[p + "ffn_gate.weight"] = f32(lw["gate"]).reshape(d, f).T
    out[p + "ffn_up.weight"] = f32(lw["up"]).reshape(d, f).T
    out[p + "ffn_down.weight"] = f32(lw["down"]).reshape(f, d).T
  if not cfg.tie_embeddings:
    out["output.weight"] = f32(params["unembed"]).T
  return {name: np.ascontiguousarray(a) for name, a in out.items()}


def _copy_tokenizer(writer: gguf.GGUFWriter, source: str | os.PathLike[str]) -> None:
  reader = gguf.GGUFReader(source)
  for key, field in reader.fields.items():
    if not key.startswith("tokenizer."):
      continue
    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
      writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
    else:
      writer.add_key_value(key, field.contents(), vtype)


def write_gguf(cfg: ModelConfig, params: Params, path: str | os.PathLike[str],
               qtype: str = "BF16", tokenizer_from: str | os.PathLike[str] | None = None) -> Path:
  """Writes ``path``; returns it."""
  if qtype not in QTYPES:
    raise ValueError(f"qtype must be one of {', '.join(QTYPES)}, got {qtype!r}")
  if cfg.activation != "swiglu" or cfg.parallel_block or cfg.embed_scale or cfg.norm_plus_one:
    raise ValueError(f"{cfg.name}: only Llama-family models can be written as a llama GGUF")
  if "layers" not in params or not isinstance(params["layers"], list):
    raise ValueError("params must hold per-layer weights (not stacked by --scan_layers)")
  gtype = getattr(gguf.GGMLQuantizationType, qtype)
  tensors = _tensors(cfg, params)
  if qtype == "Q8_0":
    bad = [n for n, a in tensors.items() if a.ndim == 2 and a.shape[1] % 32]
    if bad:
      raise ValueError(f"Q8_0 needs rows of a multiple of 32 values: {', '.join(bad[:4])}")
  out = Path(path)
  out.parent.mkdir(parents=True, exist_ok=True)
  w = gguf.GGUFWriter(str(out), "llama")
  w.add_name(cfg.name)
  w.add_file_type(int(_FILE_TYPES[qtype]))
  w.add_context_length(cfg.max_seq_len)
  w.add_embedding_length(cfg.embed_dim)
  w.add_block_count(cfg.num_layers)
  w.add_feed_forward_length(cfg.mlp_dim)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_key_length(cfg.head_dim)
  w.add_value_length(cfg.head_dim)
  w.add_rope_dimension_count(cfg.head_dim)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.norm_eps)
  w.add_vocab_size(cfg.vocab_size)
  if tokenizer_from is not None:
    _copy_tokenizer(w, tokenizer_from)
  else:
    w.add_tokenizer_model("none")
  for name, a in tensors.items():
    if a.ndim == 1 or qtype == "F32":
      w.add_tensor(name, a)
    else:
      w.add_tensor(name, gguf.quants.quantize(a, gtype), raw_dtype=gtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return out


__all__ = ["QTYPES", "llama_permute", "write_gguf"]
