"""Writes random LoRA adapters in PEFT's format for a model phaseserve loads (for tests, the LoRA
benchmark, and trying ``--lora_modules`` without a trained adapter at hand).

Usage: ``python -m launch.lab.make_adapters --model smollm2-135m --out DIR --count 4 --rank 16``
writes ``DIR/lora0 ... DIR/lora3`` (``adapter_config.json`` + ``adapter_model.safetensors``, the
tensor names ``peft`` saves for a Llama model) and prints JSON ``{"adapters": {name: path}}``.
Weights: ``A`` ~ N(0, 1 / in), ``B`` ~ N(0, strength^2 / r), ``lora_alpha = r``: each term
moves a projection's output by about ``strength`` times its input's scale.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
from absl import app, flags
from safetensors.numpy import save_file

from models.config import ModelConfig
from models.lora import HF_MODULES, target_dims

_MODULE = {t: m for m, t in HF_MODULES.items()}
_ATTN = ("q", "k", "v", "o")


def write_peft_adapter(out: str | Path, cfg: ModelConfig, *, rank: int, seed: int,
                       targets: Sequence[str] = tuple(_MODULE), strength: float = 0.5,
                       dtype=np.float32) -> Path:
  """One adapter for ``cfg`` in ``out`` (created); returns the directory."""
  root = Path(out)
  root.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  dims = target_dims(cfg)
  tensors = {}
  for l in range(cfg.num_layers):
    for t in targets:
      i, o = dims[t]
      prefix = (f"base_model.model.model.layers.{l}."
                f"{'self_attn' if t in _ATTN else 'mlp'}.{_MODULE[t]}")
      tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, i)) / np.sqrt(i)
                                            ).astype(dtype)
      tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((o, rank)) * strength
                                            / np.sqrt(rank)).astype(dtype)
  save_file(tensors, str(root / "adapter_model.safetensors"))
  config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
            "bias": "none", "target_modules": [_MODULE[t] for t in targets],
            "task_type": "CAUSAL_LM", "base_model_name_or_path": cfg.name}
  (root / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
  return root


def _define_flags() -> None:
  """The CLI's flags, defined only when run as a program (the module is imported by the LoRA
  benchmark and tests, whose own flags share names)."""
  flags.DEFINE_string("model", "smollm2-135m", "the model the adapters are for")
  flags.DEFINE_string("out", None, "the directory to write lora0, lora1, ... into")
  flags.DEFINE_integer("count", 4, "adapters to write", lower_bound=1)
  flags.DEFINE_integer("rank", 16, "their rank", lower_bound=1)
  flags.DEFINE_float("strength", 0.5, "each term's scale relative to its input")


def main(argv: Sequence[str]) -> None:
  del argv
  from models.io.loader import load_config
  f = flags.FLAGS
  if not f.out:
    raise app.UsageError("--out is required")
  cfg = load_config(f.model)
  paths = {f"lora{i}": str(write_peft_adapter(Path(f.out) / f"lora{i}", cfg, rank=f.rank,
                                              seed=i, strength=f.strength))
           for i in range(f.count)}
  print(json.dumps({"model": f.model, "rank": f.rank, "adapters": paths}))


if __name__ == "__main__":
  _define_flags()
  app.run(main)
