"""Resolve ``--model`` into (config, params, tokenizer): a preset name, a phaseserve (orbax)
checkpoint directory, or a Hugging Face directory (``config.json`` + ``*.safetensors``).

Contract: ``load_model(spec, dtype, param_seed)`` raises ``ValueError`` / ``FileNotFoundError``
with a one-line message for anything it cannot load. Presets get random weights from
``param_seed`` (there is no model hub here) and the byte-level tokenizer.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from models.config import ModelConfig, PRESET_NAMES, get_preset
from models.tokenizer import Tokenizer, load_tokenizer
from models.weights import Params, init_params


def load_model(spec: str, dtype=jnp.float32, param_seed: int = 0
               ) -> tuple[ModelConfig, Params, Tokenizer]:
  if spec in PRESET_NAMES:
    cfg = get_preset(spec)
    if cfg.name.startswith("palm"):
      raise ValueError(f"preset {spec!r} is for the cost model only; too large to instantiate")
    params = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.key(param_seed), dtype)
    return cfg, params, load_tokenizer(spec)
  if not os.path.isdir(spec):
    raise FileNotFoundError(
        f"--model {spec!r} is neither a preset ({', '.join(PRESET_NAMES)}) nor a directory")
  if os.path.exists(os.path.join(spec, "config.json")):
    from models.hf_import import load_hf_checkpoint
    cfg, params = load_hf_checkpoint(spec, dtype=dtype)
    return cfg, params, load_tokenizer(spec)
  from models.checkpoint import load_config, restore_params
  cfg = load_config(spec)
  params = restore_params(spec)
  tok_dir = spec if os.path.exists(os.path.join(spec, "tokenizer.json")) else "tiny"
  return cfg, params, load_tokenizer(tok_dir)
