"""Writes a tiny Llama checkpoint, PEFT LoRA adapters for it and their torch logits (.venv-ref).

Contract: ``python make_peft_reference.py OUT_DIR`` (Python 3.11 with torch + transformers +
peft, CPU, float32) writes:

  OUT_DIR/base/config.json, model.safetensors   the base model (random, O(1) activations)
  OUT_DIR/<adapter>/adapter_config.json, adapter_model.safetensors   (peft ``save_pretrained``)
  OUT_DIR/tokens.npy          int32 [B, T]      the fixed token batch
  OUT_DIR/logits_base.npy     f32 [B, T, V]     the base model's uncached forward
  OUT_DIR/logits_<adapter>.npy f32 [B, T, V]    the same forward with the adapter active
  OUT_DIR/manifest.json       {"adapters": [...], "peft": version} (written last)

Adapters (every LoRA weight random, so each term moves the logits by O(1)): ``all_r8`` (every
target, r 8, alpha 16), ``qv_rslora`` (q / v of layer 1 only, r 4, alpha 8, rsLoRA scaling)
and ``mlp_r16`` (gate / up / down, r 16, alpha 8). Imports nothing from phaseserve.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import numpy as np
import peft
import torch
import transformers

BATCH, SEQ, VOCAB = 2, 10, 320
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "all_r8": dict(r=8, lora_alpha=16, target_modules=ALL),
    "qv_rslora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      layers_to_transform=[1], use_rslora=True),
    "mlp_r16": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


def _base(seed: int) -> torch.nn.Module:
  cfg = transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
      bos_token_id=1, eos_token_id=2, attn_implementation="eager",
      rope_parameters=dict(rope_type="default", rope_theta=10_000.0))
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
      if "norm" in name:
        p.copy_(1.0 + 0.3 * noise)
      elif "embed_tokens" in name:
        p.copy_(noise)
      else:
        p.copy_(noise / math.sqrt(p.shape[1]))
  return model


def _logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def main(out_dir: Path) -> None:
  out_dir.mkdir(parents=True)
  base = _base(seed=7)
  base.save_pretrained(out_dir / "base", safe_serialization=True)
  tokens = np.random.default_rng(7).integers(4, VOCAB, size=(BATCH, SEQ)).astype(np.int32)
  np.save(out_dir / "tokens.npy", tokens)
  np.save(out_dir / "logits_base.npy", _logits(base, tokens))
  gen = torch.Generator().manual_seed(11)
  for name, kw in ADAPTERS.items():
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**kw, lora_dropout=0.0))
    with torch.no_grad():
      for pname, p in model.named_parameters():
        if "lora_" in pname:  # peft starts B at zero: make every term count
          p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(max(p.shape)))
    model.eval()
    model.save_pretrained(out_dir / name)
    np.save(out_dir / f"logits_{name}.npy", _logits(model, tokens))
  (out_dir / "manifest.json").write_text(json.dumps(
      {"adapters": list(ADAPTERS), "peft": peft.__version__, "torch": torch.__version__}))


if __name__ == "__main__":
  main(Path(sys.argv[1]))
