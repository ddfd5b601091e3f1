"""Frozen model configuration and named presets.

Contract: ``ModelConfig`` is immutable and hashable (safe as a jit static argument). Presets are
looked up by name with ``get_preset`` (``get_shape`` also knows the cost-model-only shapes,
``SHAPE_NAMES``); ``from_hf_config`` builds a config from a Hugging Face ``config.json`` dict
for the Llama family (MHA / GQA / MQA) and Gemma (v1).

Shape letters (array-name suffixes, documented once, here):
  B batch, T query time, S key/value time, D embed, N query heads, K kv heads,
  G query heads per kv head (N = K * G), H head dim, F mlp hidden, V vocab;
  paged KV: L layers, P pages in a pool, Z positions per page, M pages per sequence (a
  page-table row), C pages moved by one call; the engine (``serving/``): X slots (per-slot
  state), R rows of one engine call (prefill chunks or decode rows, padded to a bucket), W int32
  words of an allowed-token bitmask (W = ceil(V / 32); ``serving/token_mask.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

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
    # Hugging Face's SmolLM2-135M-Instruct (Llama, GQA 9/3, tied embeddings). The name resolves to
    # the trained weights of the installed GGUF file (``models.io.loader``); the shape alone serves
    # benchmarks and the cost model.
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", vocab_size=49152, embed_dim=576, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, mlp_dim=1536, norm_eps=1e-5, rope_theta=100_000.0,
        tie_embeddings=True, max_seq_len=8192),
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

# Shapes for the cost model and the capacity simulator only: never instantiated, so they are not
# presets (the CLIs that build a model from ``PRESET_NAMES`` must not offer them).
_SHAPES: dict[str, ModelConfig] = {
    # Meta's Llama 3 70B (GQA 64/8, head dim 128, SwiGLU 28672, untied 128256 vocab): the
    # 70B-class model of ``launch.lab.simulate``'s comparison (BUILD_NOTES "Capacity simulator").
    "llama-3-70b": ModelConfig(
        name="llama-3-70b", vocab_size=128_256, embed_dim=8192, num_layers=80, num_heads=64,
        num_kv_heads=8, head_dim=128, mlp_dim=28_672, rope_theta=500_000.0, max_seq_len=8192),
}
SHAPE_NAMES = PRESET_NAMES + tuple(_SHAPES)


def get_preset(name: str) -> ModelConfig:
  try:
    return _PRESETS[name]
  except KeyError:
    raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESET_NAMES)}") from None


def get_shape(name: str) -> ModelConfig:
  """A preset or a cost-model-only shape (``SHAPE_NAMES``)."""
  if name in _SHAPES:
    return _SHAPES[name]
  try:
    return _PRESETS[name]
  except KeyError:
    raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPE_NAMES)}") from None


def from_hf_config(hf: Mapping[str, object], name: str = "hf") -> ModelConfig:
  """Builds a ModelConfig from a Hugging Face ``config.json``; a missing or malformed required
  field is a ``ValueError`` naming it."""
  try:
    return _from_hf_config(hf, name)
  except KeyError as e:
    raise ValueError(f"config.json: missing required field {e}") from None
  except (TypeError, AttributeError) as e:
    raise ValueError(f"config.json: malformed field ({e})") from None


def _from_hf_config(hf: Mapping[str, Any], name: str) -> ModelConfig:
  """Builds a ModelConfig from a Hugging Face ``config.json`` (Llama family or Gemma v1).

  Reads both transformers 4.x (``rope_theta``, ``rope_scaling``, Gemma ``hidden_activation``) and
  5.x (``rope_parameters``, Gemma ``hidden_act``) layouts. Keys missing from the file take the
  defaults of the corresponding transformers config class, as ``from_pretrained`` would.
  """
  model_type = str(hf.get("model_type", ""))
  arch = " ".join(hf.get("architectures", []) or [])
  if model_type not in ("llama", "mistral", "gemma") and "Llama" not in arch:
    raise ValueError(f"unsupported model_type {model_type!r} (supported: llama, mistral, gemma)")
  gemma = model_type == "gemma"
  # RoPE: 5.x nests the base in rope_parameters; 4.x has a top-level rope_theta and rope_scaling
  # (null, or a dict whose "type"/"rope_type" names a scaling scheme).
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if not isinstance(rope, Mapping):
    raise ValueError(f"rope_parameters {rope!r} is not a dict")
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type != "default":
    raise ValueError(f"RoPE type {rope_type!r} ({dict(rope)!r}) is not supported (only default)")
  partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor") or 1.0)
  if float(partial) != 1.0:
    raise ValueError("partial_rotary_factor != 1 is not supported")
  theta = rope.get("rope_theta", hf.get("rope_theta") or 10_000.0)
  rope_theta = float(theta)
  for flag in ("attention_bias", "mlp_bias"):
    if hf.get(flag):
      raise ValueError(f"{flag}=True is not supported")
  d = int(hf["hidden_size"])
  n = int(hf["num_attention_heads"])
  k = int(hf.get("num_key_value_heads") or n)
  # GemmaConfig's head_dim defaults to 256 (not D / N: gemma-7b has 3072 / 16 != 256).
  head_dim = int(hf.get("head_dim") or (256 if gemma else d // n))
  if gemma:
    # Gemma v1 is tanh-approximate GELU whatever the file says: 4.x read hidden_activation
    # (None -> gelu_pytorch_tanh), 5.x reads hidden_act and maps the legacy "gelu" to tanh.
    act_name = str(hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh")
    tanh_gelus: tuple[str, ...] = ("gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast")
  else:
    act_name = str(hf.get("hidden_act") or "silu")
    tanh_gelus = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")  # exact "gelu" is not ours
  if act_name in ("silu", "swish"):
    activation: Activation = "swiglu"
  elif act_name in tanh_gelus:
    activation = "geglu"
  else:
    raise ValueError(f"unsupported hidden activation {act_name!r} (supported: silu, "
                     f"{', '.join(tanh_gelus)})")
  max_seq_len = int(
      hf.get("max_position_embeddings") or (8192 if gemma else 2048))
  # Mistral's sliding window (MistralConfig default 4096) is not implemented: attention is exact
  # only while the whole context fits in the window, so cap the context there.
  window = hf.get("sliding_window", 4096 if model_type == "mistral" else None)
  if window:
    max_seq_len = min(max_seq_len, int(window))
  return ModelConfig(
      name=name,
      vocab_size=int(hf["vocab_size"]),
      embed_dim=d,
      num_layers=int(hf["num_hidden_layers"]),
      num_heads=n,
      num_kv_heads=k,
      head_dim=head_dim,
      mlp_dim=int(hf["intermediate_size"]),
      activation=activation,
      norm_eps=float(hf.get("rms_norm_eps") or 1e-6),
      rope_theta=rope_theta,
      tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
      parallel_block=False,
      max_seq_len=max_seq_len,
      embed_scale=gemma,
      norm_plus_one=gemma,
  )
