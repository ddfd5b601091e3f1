"""Frozen model configuration and named presets.

Contract: ``ModelConfig`` is immutable and hashable (safe as a jit static argument). Presets are
looked up by name with ``get_preset``; ``from_hf_config`` builds a config from a Hugging Face
``config.json`` dict for the Llama family (MHA / GQA / MQA) and Gemma (v1).

Einsum letters used throughout ``models/`` (documented once, here):
  B batch, T query time, S key/value time, D embed, N query heads, K kv heads,
  G query heads per kv head (N = K * G), H head dim, F mlp hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Mapping

Activation = Literal["swiglu", "geglu"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and flavour of a decoder-only transformer."""

  name: str
  vocab_size: int
  embed_dim: int  # D
  num_layers: int
  num_heads: int  # N
  num_kv_heads: int  # K; 1 = multiquery
  head_dim: int  # H
  mlp_dim: int  # F
  activation: Activation = "swiglu"
  norm_eps: float = 1e-5
  rope_theta: float = 10_000.0
  tie_embeddings: bool = False
  parallel_block: bool = False  # PaLM: attention and MLP read one norm, outputs summed
  max_seq_len: int = 2048
  embed_scale: bool = False  # Gemma: embeddings multiplied by sqrt(D)
  norm_plus_one: bool = False  # Gemma: RMSNorm weight applied as (1 + w)

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.activation not in ("swiglu", "geglu"):
      raise ValueError(f"unknown activation {self.activation!r}")

  @property
  def q_per_kv(self) -> int:  # G
    return self.num_heads // self.num_kv_heads

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def param_count(self, include_embedding: bool = True) -> int:
    d, f, h = self.embed_dim, self.mlp_dim, self.head_dim
    attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
    mlp = 3 * d * f
    norms = d if self.parallel_block else 2 * d
    per_layer = attn + mlp + norms
    total = self.num_layers * per_layer + d
    if include_embedding:
      total += self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return total

  def flops_per_token(self, context_len: int = 0) -> float:
    """Matmul FLOPs of one token's forward pass (2 * non-embedding-lookup params + attention)."""
    d, h = self.embed_dim, self.head_dim
    matmul_params = self.num_layers * (
        d * h * (2 * self.num_heads + 2 * self.num_kv_heads) + 3 * d * self.mlp_dim)
    matmul_params += self.vocab_size * d  # unembedding
    attn = self.num_layers * 2 * 2 * self.num_heads * h * context_len  # QK^T and PV
    return 2.0 * matmul_params + attn


_PRESETS: dict[str, ModelConfig] = {
    # Tests: tiny enough to compile in seconds, but with GQA-capable head counts.
    "tiny": ModelConfig(
        name="tiny", vocab_size=256 + 3, embed_dim=64, num_layers=2, num_heads=4,
        num_kv_heads=1, head_dim=16, mlp_dim=128, max_seq_len=256),
    # Benchmarks: exactly the Llama shape other engines are compared on (~121M params).
    "small": ModelConfig(
        name="small", vocab_size=32000, embed_dim=768, num_layers=12, num_heads=12,
        num_kv_heads=1, head_dim=64, mlp_dim=2048, norm_eps=1e-5, rope_theta=10_000.0,
        tie_embeddings=False, max_seq_len=2048),
    # PaLM shapes (Chowdhery et al. 2022, Table 1): multiquery, parallel block, SwiGLU, shared
    # embeddings, head dim 256. Used by the cost model; never instantiated.
    "palm-8b": ModelConfig(
        name="palm-8b", vocab_size=256_000, embed_dim=4096, num_layers=32, num_heads=16,
        num_kv_heads=1, head_dim=256, mlp_dim=4 * 4096, tie_embeddings=True,
        parallel_block=True, max_seq_len=2048),
    "palm-62b": ModelConfig(
        name="palm-62b", vocab_size=256_000, embed_dim=8192, num_layers=64, num_heads=32,
        num_kv_heads=1, head_dim=256, mlp_dim=4 * 8192, tie_embeddings=True,
        parallel_block=True, max_seq_len=2048),
    "palm-540b": ModelConfig(
        name="palm-540b", vocab_size=256_000, embed_dim=18432, num_layers=118, num_heads=48,
        num_kv_heads=1, head_dim=256, mlp_dim=4 * 18432, tie_embeddings=True,
        parallel_block=True, max_seq_len=2048),
}

PRESET_NAMES = tuple(_PRESETS)


def get_preset(name: str) -> ModelConfig:
  try:
    return _PRESETS[name]
  except KeyError:
    raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESET_NAMES)}") from None


def from_hf_config(hf: Mapping[str, object], name: str = "hf") -> ModelConfig:
  """Builds a ModelConfig from a Hugging Face ``config.json`` (Llama family or Gemma v1)."""
  model_type = str(hf.get("model_type", ""))
  arch = " ".join(hf.get("architectures", []) or [])  # type: ignore[arg-type]
  if model_type not in ("llama", "mistral", "gemma") and "Llama" not in arch:
    raise ValueError(f"unsupported model_type {model_type!r} (supported: llama, mistral, gemma)")
  if hf.get("rope_scaling"):
    raise ValueError(f"rope_scaling {hf['rope_scaling']!r} is not supported")
  for flag in ("attention_bias", "mlp_bias"):
    if hf.get(flag):
      raise ValueError(f"{flag}=True is not supported")
  d = int(hf["hidden_size"])  # type: ignore[arg-type]
  n = int(hf["num_attention_heads"])  # type: ignore[arg-type]
  k = int(hf.get("num_key_value_heads") or n)  # type: ignore[arg-type]
  head_dim = int(hf.get("head_dim") or d // n)  # type: ignore[arg-type]
  gemma = model_type == "gemma"
  act_name = str(hf.get("hidden_activation") or hf.get("hidden_act") or "silu")
  if act_name in ("silu", "swish"):
    activation: Activation = "swiglu"
  elif act_name.startswith("gelu"):
    activation = "geglu"
  else:
    raise ValueError(f"unsupported hidden activation {act_name!r}")
  return ModelConfig(
      name=name,
      vocab_size=int(hf["vocab_size"]),  # type: ignore[arg-type]
      embed_dim=d,
      num_layers=int(hf["num_hidden_layers"]),  # type: ignore[arg-type]
      num_heads=n,
      num_kv_heads=k,
      head_dim=head_dim,
      mlp_dim=int(hf["intermediate_size"]),  # type: ignore[arg-type]
      activation=activation,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6 if gemma else 1e-5)),  # type: ignore[arg-type]
      rope_theta=float(hf.get("rope_theta", 10_000.0)),  # type: ignore[arg-type]
      tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
      parallel_block=False,
      max_seq_len=int(hf.get("max_position_embeddings", 2048)),  # type: ignore[arg-type]
      embed_scale=gemma,
      norm_plus_one=gemma,
  )
