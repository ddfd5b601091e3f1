"""Import a local Hugging Face checkpoint (Llama family, Gemma v1) into our params layout.

Contract: ``load_hf_checkpoint(path, dtype=jnp.float32) -> (ModelConfig, params)`` reads a local
directory holding ``config.json`` and safetensors weights, either one ``model.safetensors`` (or any
``*.safetensors`` files) or shards listed by ``model.safetensors.index.json``. Supported
architectures: ``LlamaForCausalLM`` (MHA / GQA / MQA, tied or untied), ``MistralForCausalLM`` (same
tensor names; context capped at its sliding window) and ``GemmaForCausalLM`` (v1, tied). The
config goes through ``models.config.from_hf_config``; ``params`` follows ``models.weights``
exactly (same pytree, shapes as ``param_infos(cfg)``), every leaf a ``jax.Array`` of ``dtype``.

Torch ``nn.Linear`` stores ``[out, in]`` and computes ``x @ W.T``; HF splits projection outputs
head-major (``out = n * H + h``). Hence:
  q_proj [N*H, D] -> q [D, N, H];    k_proj / v_proj [K*H, D] -> [D, K, H];
  o_proj [D, N*H] -> o [N, H, D];    gate_proj / up_proj [F, D] -> [D, F];
  down_proj [D, F] -> [F, D];
  embed_tokens [V, D] -> embed;    lm_head [V, D] -> unembed [D, V] (untied only);
  input_layernorm -> attn_norm;    post_attention_layernorm -> mlp_norm;  model.norm -> final_norm.
Norm weights are copied as stored (Gemma's stored ``w`` is applied as ``1 + w``, as ours).

Tensors are read one at a time through ``safetensors`` with the numpy framework (bf16 via
ml_dtypes; no torch). Every problem is a ``ValueError`` naming the file or tensor: missing
directory / config / weights, unsupported architecture, missing or unexpected tensors, shape
mismatches against ``config.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from models.config import ModelConfig, from_hf_config
from models.weights import Params, abstract_params

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "GemmaForCausalLM")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Stored by some exporters but recomputed by us (and by transformers); safe to skip.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_config(root: Path) -> dict:
  cfg_path = root / "config.json"
  if not cfg_path.is_file():
    raise ValueError(f"{root}: no config.json (not a Hugging Face checkpoint directory?)")
  try:
    hf = json.loads(cfg_path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{cfg_path}: invalid JSON: {e}") from None
  if not isinstance(hf, dict):
    raise ValueError(f"{cfg_path}: expected a JSON object")
  archs = hf.get("architectures") or []
  known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
  if archs and not known:
    raise ValueError(f"{cfg_path}: unsupported architecture(s) {archs} "
                     f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
  if not archs and hf.get("model_type") not in ("llama", "mistral", "gemma"):
    raise ValueError(f"{cfg_path}: no 'architectures' and unsupported model_type "
                     f"{hf.get('model_type')!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
  if known == ["GemmaForCausalLM"] and hf.get("model_type") not in (None, "gemma"):
    raise ValueError(f"{cfg_path}: GemmaForCausalLM with model_type {hf.get('model_type')!r}")
  return hf


def _tensor_files(root: Path) -> dict[str, Path]:
  """Tensor name -> safetensors file holding it."""
  index = root / _INDEX
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise ValueError(f"{index}: not a safetensors index ({e!r})") from None
    files = {name: root / fname for name, fname in weight_map.items()}
    missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
    if missing:
      raise ValueError(f"{index} lists shard(s) missing from {root}: {', '.join(missing)}")
    return files
  paths = [root / _SINGLE] if (root / _SINGLE).is_file() else sorted(root.glob("*.safetensors"))
  if not paths:
    present = ", ".join(sorted(p.name for p in root.iterdir())) or "nothing"
    raise ValueError(
        f"{root}: no *.safetensors weights and no {_INDEX} (found: {present}); "
        "re-save .bin / .pth checkpoints with save_pretrained(safe_serialization=True)")
  files: dict[str, Path] = {}
  for p in paths:
    with safe_open(p, framework="numpy") as f:
      for name in f.keys():
        if name in files:
          raise ValueError(f"tensor {name!r} is in both {files[name].name} and {p.name}")
        files[name] = p
  return files


class _Reader:
  """Reads tensors on demand, one open handle per file; remembers what was consumed."""

  def __init__(self, files: dict[str, Path]):
    self.files = files
    self.used: set[str] = set()
    self._handles: dict[Path, object] = {}

  def has(self, name: str) -> bool:
    return name in self.files

  def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in self.files:
      raise ValueError(f"missing tensor {name!r} (expected shape {shape}); "
                       f"checkpoint holds {len(self.files)} tensors")
    path = self.files[name]
    if path not in self._handles:
      self._handles[path] = safe_open(path, framework="numpy")
    try:
      arr = self._handles[path].get_tensor(name)  # type: ignore[attr-defined]
    except Exception as e:  # safetensors raises its own error types
      raise ValueError(f"{path.name}: cannot read tensor {name!r}: {e}") from None
    if tuple(arr.shape) != shape:
      raise ValueError(f"tensor {name!r} in {path.name} has shape {tuple(arr.shape)}, but "
                       f"config.json implies {shape}")
    self.used.add(name)
    return arr

  def close(self) -> None:
    for h in self._handles.values():
      exit_ = getattr(h, "__exit__", None)
      if exit_ is not None:
        exit_(None, None, None)
    self._handles.clear()


def _linear_in_out(w_OI: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(w_OI.T)


def _layer(read: Callable[[str, tuple[int, ...]], np.ndarray], i: int, cfg: ModelConfig
           ) -> dict[str, np.ndarray]:
  d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  p = f"model.layers.{i}."
  return {
      "attn_norm": read(p + "input_layernorm.weight", (d,)),
      "mlp_norm": read(p + "post_attention_layernorm.weight", (d,)),
      "q": _linear_in_out(read(p + "self_attn.q_proj.weight", (n * h, d))).reshape(d, n, h),
      "k": _linear_in_out(read(p + "self_attn.k_proj.weight", (k * h, d))).reshape(d, k, h),
      "v": _linear_in_out(read(p + "self_attn.v_proj.weight", (k * h, d))).reshape(d, k, h),
      "o": _linear_in_out(read(p + "self_attn.o_proj.weight", (d, n * h))).reshape(n, h, d),
      "gate": _linear_in_out(read(p + "mlp.gate_proj.weight", (f, d))),
      "up": _linear_in_out(read(p + "mlp.up_proj.weight", (f, d))),
      "down": _linear_in_out(read(p + "mlp.down_proj.weight", (d, f))),
  }


def _unexpected(names: Iterable[str], used: set[str], tied: bool) -> list[str]:
  out = []
  for name in names:
    if name in used or name.endswith(_IGNORED_SUFFIXES):
      continue
    if tied and name == "lm_head.weight":  # some exporters store the tied copy too
      continue
    out.append(name)
  return sorted(out)


def load_hf_checkpoint(path: str | os.PathLike, dtype=jnp.float32, *, name: str | None = None
                       ) -> tuple[ModelConfig, Params]:
  """Loads ``path`` (a local HF checkpoint directory) as ``(ModelConfig, params)`` in ``dtype``."""
  root = Path(path)
  if not root.is_dir():
    raise ValueError(f"Hugging Face checkpoint directory {str(root)!r} does not exist "
                     "(pass a local directory with config.json and *.safetensors)")
  hf = _read_config(root)
  cfg = from_hf_config(hf, name=name or root.name)
  if cfg.parallel_block:  # from_hf_config never sets it; the layer mapping assumes serial blocks
    raise ValueError("parallel-block checkpoints are not supported")
  reader = _Reader(_tensor_files(root))
  v, d = cfg.vocab_size, cfg.embed_dim

  def to_jax(a: np.ndarray) -> jax.Array:
    return jnp.asarray(a, dtype=dtype)  # bf16 / f16 / f32 files into any float dtype

  try:
    host: Params = {
        "embed": reader.get("model.embed_tokens.weight", (v, d)),
        "final_norm": reader.get("model.norm.weight", (d,)),
        "layers": [_layer(reader.get, i, cfg) for i in range(cfg.num_layers)],
    }
    if not cfg.tie_embeddings:
      host["unembed"] = _linear_in_out(reader.get("lm_head.weight", (v, d)))
    extra = _unexpected(reader.files, reader.used, cfg.tie_embeddings)
    if extra:
      shown = ", ".join(extra[:8]) + (f", ... ({len(extra)} in all)" if len(extra) > 8 else "")
      raise ValueError(f"{root}: unexpected tensors not used by {cfg.name} "
                       f"({cfg.num_layers} layers per config.json): {shown}")
    params = jax.tree.map(to_jax, host)
  finally:
    reader.close()
  want = abstract_params(cfg, dtype)
  if jax.tree.structure(want) != jax.tree.structure(params) or any(
      a.shape != b.shape for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(params))):
    raise AssertionError("hf_import produced params that do not match models.weights")
  return cfg, params


__all__ = ["SUPPORTED_ARCHITECTURES", "load_hf_checkpoint"]
