"""PEFT LoRA adapters (``adapter_config.json`` + ``adapter_model.safetensors``) as host arrays.

Contract: ``load_peft_adapter(path, cfg)`` reads an adapter saved by ``peft``'s
``save_pretrained`` for a Llama-family model of config ``cfg`` and returns an ``Adapter``: per
target (``models.lora.TARGETS``) ``a`` [L, I, E] and ``b`` [L, E, O] in float32, ``b`` scaled
by ``lora_alpha / r`` (``use_rslora``: ``/ sqrt(r)``); layers or targets the adapter leaves out
are zeros. Anything it cannot honour exactly (DoRA, biases, ``modules_to_save``, per-module
rank or alpha patterns, adapted embeddings, a shape that does not fit ``cfg``) is a
``ValueError`` naming it. Reads no base weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from models.config import ModelConfig
from models.lora import HF_MODULES, TARGETS, target_dims

_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclasses.dataclass(frozen=True, eq=False)
class Adapter:
  path: str
  rank: int
  a: dict[str, np.ndarray]  # target -> [L, I, E] float32
  b: dict[str, np.ndarray]  # target -> [L, E, O] float32, scaled

  @property
  def targets(self) -> tuple[str, ...]:
    return tuple(t for t in TARGETS if np.any(self.b[t]))

  def padded(self, rank: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``a`` and ``b`` zero-padded to ``rank`` (the device slots' rank)."""
    if rank < self.rank:
      raise ValueError(f"adapter {self.path} has rank {self.rank} > the slots' {rank}")
    pad = rank - self.rank
    return ({t: np.pad(x, ((0, 0), (0, 0), (0, pad))) for t, x in self.a.items()},
            {t: np.pad(x, ((0, 0), (0, pad), (0, 0))) for t, x in self.b.items()})


def _config(root: Path) -> dict:
  try:
    conf = json.loads((root / "adapter_config.json").read_text())
  except FileNotFoundError:
    raise FileNotFoundError(f"{root}: no adapter_config.json (not a PEFT adapter)") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{root}/adapter_config.json: {e}") from None
  kind = conf.get("peft_type", "LORA")
  if kind != "LORA":
    raise ValueError(f"{root}: peft_type {kind!r}; only LORA adapters are served")
  unsupported = {"use_dora": bool(conf.get("use_dora")),
                 "bias": conf.get("bias", "none") not in (None, "none"),
                 "modules_to_save": bool(conf.get("modules_to_save")),
                 "rank_pattern": bool(conf.get("rank_pattern")),
                 "alpha_pattern": bool(conf.get("alpha_pattern")),
                 "fan_in_fan_out": bool(conf.get("fan_in_fan_out")),
                 "lora_bias": bool(conf.get("lora_bias")),
                 "layer_replication": bool(conf.get("layer_replication")),
                 "trainable_token_indices": bool(conf.get("trainable_token_indices")),
                 "target_parameters": bool(conf.get("target_parameters"))}
  bad = [k for k, v in unsupported.items() if v]
  if bad:
    raise ValueError(f"{root}: adapter_config.json sets {', '.join(bad)}, not supported")
  return conf


def adapter_rank(path: str | os.PathLike) -> int:
  """The rank ``r`` an adapter's ``adapter_config.json`` declares (reads no weights)."""
  return int(_config(Path(path))["r"])


def load_peft_adapter(path: str | os.PathLike, cfg: ModelConfig) -> Adapter:
  root = Path(path)
  conf = _config(root)
  file = root / "adapter_model.safetensors"
  if not file.is_file():
    raise FileNotFoundError(f"{root}: no adapter_model.safetensors")
  r = int(conf["r"])
  alpha = float(conf.get("lora_alpha", r))
  scale = alpha / (math.sqrt(r) if conf.get("use_rslora") else r)
  dims, n = target_dims(cfg), cfg.num_layers
  a = {t: np.zeros((n, i, r), np.float32) for t, (i, _) in dims.items()}
  b = {t: np.zeros((n, r, o), np.float32) for t, (_, o) in dims.items()}
  seen = 0
  with safe_open(file, framework="numpy") as f:
    for name in f.keys():
      m = _NAME.search(name)
      if m is None or m.group(2) not in HF_MODULES:
        raise ValueError(f"{file}: tensor {name!r} is not a LoRA weight of {sorted(HF_MODULES)}")
      l, t, half = int(m.group(1)), HF_MODULES[m.group(2)], m.group(3)
      x = np.asarray(f.get_tensor(name), np.float32)
      i, o = dims[t]
      want = (r, i) if half == "A" else (o, r)
      if l >= n or x.shape != want:
        raise ValueError(f"{file}: {name!r} has shape {x.shape} (layer {l}); the model "
                         f"{cfg.name} wants {want} in layers 0..{n - 1}")
      if half == "A":
        a[t][l] = x.T
      else:
        b[t][l] = x.T * scale
      seen += 1
  if not seen:
    raise ValueError(f"{file}: no LoRA weights")
  return Adapter(str(root), r, a, b)


__all__ = ["Adapter", "adapter_rank", "load_peft_adapter"]
