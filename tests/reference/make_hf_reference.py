"""Writes tiny Hugging Face reference checkpoints plus their torch logits (run under .venv-ref).

Contract: ``python make_hf_reference.py OUT_DIR`` (Python 3.11 with torch + transformers +
tokenizers, CPU only, float32) writes one directory per case under OUT_DIR:

  OUT_DIR/<case>/config.json, model.safetensors (or shards + model.safetensors.index.json),
                 tokenizer.json, tokenizer_config.json, generation_config.json,
                 tokens.npy          int32 [B, T]   the fixed token batch
                 logits_full.npy     f32 [B, T, V]  one uncached causal forward over ``tokens``
                 logits_decode.npy   f32 [B, T - P + 1, V]  prefill of tokens[:, :P] with the cache
                                     on (entry 0 = logits at position P - 1), then one cached step
                                     per remaining token (entry j = logits at position P - 1 + j)
                 meta.json           {"prefix_len": P, "case": ..., "torch": ..., ...}
  OUT_DIR/manifest.json              {"cases": [...], "generator_sha256": ...} (written last)

Models are randomly initialised with fixed seeds and O(1)-scaled weights (every norm weight
random too) so that a wrong transpose, head split, norm convention or RoPE base shows up as an
O(1) logit error. Imports nothing from phaseserve; writes nothing outside OUT_DIR.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BATCH, SEQ, PREFIX = 2, 10, 4
VOCAB = 320  # model vocab; the tokenizer's own vocab is at most this (padded, as real models are)
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3: pad, bos, eos, unk
TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill is compute bound; decode is memory bandwidth bound.",
    "Multiquery attention shares one key and value head across all query heads.",
    "Grouped query attention sits between multihead and multiquery attention.",
    "Hello, world! Serving large language models efficiently is hard.",
]

# (case name, architecture, config overrides, save kwargs)
CASES: list[tuple[str, str, dict, dict]] = [
    # Non-default RoPE base and a large eps, so a config field read wrongly changes the logits.
    ("llama_mqa", "llama", dict(num_key_value_heads=1, rope_theta=500.0, rms_norm_eps=1e-3), {}),
    # Sharded save: exercises model.safetensors.index.json.
    ("llama_gqa", "llama", dict(num_key_value_heads=2, rope_theta=10_000.0),
     dict(max_shard_size="24KB")),
    ("llama_mha_tied", "llama",
     dict(num_key_value_heads=4, rope_theta=1000.0, tie_word_embeddings=True), {}),
    # Same tensor names as Llama; the sliding window (> SEQ) only caps our max_seq_len.
    ("mistral_gqa", "mistral", dict(num_key_value_heads=2, rope_theta=2000.0, sliding_window=32),
     {}),
    # head_dim 16 != hidden 32 / heads 4, as in gemma-7b (3072 / 16 != 256).
    ("gemma_mqa", "gemma",
     dict(num_key_value_heads=1, head_dim=16, rope_theta=10_000.0, rms_norm_eps=1e-3), {}),
]


def _tokenizer() -> Tokenizer:
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(TOKENIZER_TEXT, trainer=trainer)
  assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2, 3]
  assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
  return tok


def _config(arch: str, overrides: dict) -> transformers.PreTrainedConfig:
  common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64, pad_token_id=0,
                bos_token_id=1, eos_token_id=2,
                attn_implementation="eager")  # plain softmax(QK^T)V reference math
  overrides = dict(overrides)
  theta = overrides.pop("rope_theta")
  eps = overrides.pop("rms_norm_eps", 1e-6 if arch == "gemma" else 1e-5)
  # transformers 5.x: RoPE base lives in rope_parameters (config.json no longer has rope_theta).
  rope = dict(rope_type="default", rope_theta=theta)
  if arch in ("llama", "mistral"):
    cls = transformers.LlamaConfig if arch == "llama" else transformers.MistralConfig
    return cls(**common, rms_norm_eps=eps, rope_parameters=rope, **overrides)
  return transformers.GemmaConfig(**common, rms_norm_eps=eps, rope_parameters=rope,
                                  hidden_act="gelu_pytorch_tanh", **overrides)


def _randomize(model: torch.nn.Module, gemma: bool, seed: int) -> None:
  """O(1) activations: Linear ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights random."""
  gen = torch.Generator().manual_seed(seed)
  d = model.config.hidden_size
  with torch.no_grad():
    for name, p in model.named_parameters():  # a tied lm_head is listed once, as embed_tokens
      noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
      if "norm" in name:
        p.copy_(0.3 * noise if gemma else 1.0 + 0.3 * noise)  # Gemma applies (1 + w)
      elif "embed_tokens" in name:
        p.copy_(noise / math.sqrt(d) if gemma else noise)  # Gemma multiplies by sqrt(D)
      else:
        p.copy_(noise / math.sqrt(p.shape[1]))


def _cache_kw(model: torch.nn.Module) -> str:
  # transformers 5.x renames forward(past_key_values=) to forward(cache=); accept either.
  params = inspect.signature(model.forward).parameters
  return "cache" if "cache" in params else "past_key_values"


def _out_cache(out):
  cache = getattr(out, "cache", None)
  return cache if cache is not None else out.past_key_values


def _run_case(out_dir: Path, case: str, arch: str, overrides: dict, save_kw: dict,
              tok: Tokenizer, seed: int) -> None:
  torch.manual_seed(seed)
  cfg = _config(arch, overrides)
  cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
         "gemma": transformers.GemmaForCausalLM}[arch]
  model = cls(cfg).to(torch.float32).eval()
  assert model.config._attn_implementation == "eager", model.config._attn_implementation
  _randomize(model, gemma=arch == "gemma", seed=seed)
  d = out_dir / case
  d.mkdir(parents=True)
  model.save_pretrained(d, safe_serialization=True, **save_kw)
  tok.save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
       "pad_token": "<pad>", "unk_token": "<unk>"}, indent=2) + "\n")

  gen = np.random.default_rng(seed)
  tokens = gen.integers(0, VOCAB, size=(BATCH, SEQ), dtype=np.int64)
  ids = torch.from_numpy(tokens)
  kw = _cache_kw(model)
  with torch.no_grad():
    full = model(ids, use_cache=False).logits.float().numpy()
    out = model(ids[:, :PREFIX], use_cache=True)
    steps = [out.logits[:, -1]]
    cache = _out_cache(out)
    for t in range(PREFIX, SEQ):
      out = model(ids[:, t:t + 1], use_cache=True, **{kw: cache})
      cache = _out_cache(out)
      steps.append(out.logits[:, -1])
    decode = torch.stack(steps, dim=1).float().numpy()
  np.save(d / "tokens.npy", tokens.astype(np.int32))
  np.save(d / "logits_full.npy", full.astype(np.float32))
  np.save(d / "logits_decode.npy", decode.astype(np.float32))
  (d / "meta.json").write_text(json.dumps(
      {"case": case, "architecture": cls.__name__, "prefix_len": PREFIX, "seed": seed,
       "torch": torch.__version__, "transformers": transformers.__version__}, indent=2) + "\n")


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    print(f"usage: {argv[0]} OUT_DIR", file=sys.stderr)
    return 2
  start = time.time()
  torch.set_num_threads(1)
  out_dir = Path(argv[1])
  if out_dir.exists():
    shutil.rmtree(out_dir)
  out_dir.mkdir(parents=True)
  tok = _tokenizer()
  for seed, (case, arch, overrides, save_kw) in enumerate(CASES):
    _run_case(out_dir, case, arch, overrides, save_kw, tok, seed=1234 + seed)
  sha = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
  (out_dir / "manifest.json").write_text(json.dumps(
      {"cases": [c[0] for c in CASES], "generator_sha256": sha}, indent=2) + "\n")
  print(f"wrote {len(CASES)} reference checkpoints to {out_dir} in {time.time() - start:.1f}s")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
