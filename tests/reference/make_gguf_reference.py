"""Writes transformers' own logits and greedy continuations for a GGUF model (run under .venv-ref).

Contract: ``python make_gguf_reference.py OUT_DIR GGUF_FILE`` (Python 3.11 with torch, transformers,
gguf and accelerate; CPU, float32) loads the file with
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`` (transformers dequantizes every
tensor to float and undoes llama.cpp's Q/K permutation itself, independently of phaseserve) and,
for each text of ``TEXTS`` tokenized by transformers' GGUF tokenizer, writes to OUT_DIR:

  case<i>.npz  tokens       int32 [T]         the prompt ids (add_special_tokens=False)
               logits_full  f32 [T, V]        one uncached causal forward over the prompt
               logits_decode f32 [T - P + 1, V] cached prefill of tokens[:P], then one cached
                                              step per remaining prompt token
               greedy       int32 [NEW]       greedy continuation, EOS ignored (NEW tokens)
               greedy_margin f32 [NEW]        top-1 minus top-2 logit at each greedy step
  meta.json    {"cases": n, "prefix_len": P, "new_tokens": NEW, "generator_sha256": ...,
                "gguf_size": bytes, "transformers": ..., "torch": ...}   (written last)

The texts avoid digit runs: transformers' GGUF converter does not know the ``smollm``
pre-tokenizer (which splits digits one by one) and would tokenize them differently from the file's
own tokenizer. Imports nothing from phaseserve; writes nothing outside OUT_DIR.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from make_hf_reference import _cache_kw, _out_cache  # the sibling script (same directory)

PREFIX = 6
NEW_TOKENS = 32
TEXTS = [
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "The two phases of inference are different: the prompt is read all at once, while the answer"
    " is written one token at a time.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


def main(argv: list[str]) -> int:
  if len(argv) != 3:
    print(f"usage: {argv[0]} OUT_DIR GGUF_FILE", file=sys.stderr)
    return 2
  start = time.time()
  # One thread: the suite runs beside another worker on two cores, where a second OpenMP
  # thread spends its time waiting for a busy core at every op's barrier.
  torch.set_num_threads(1)
  out_dir, gguf_file = Path(argv[1]), Path(argv[2])
  out_dir.mkdir(parents=True, exist_ok=True)
  tok = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32,
      attn_implementation="eager").eval()
  kw = _cache_kw(model)
  for i, text in enumerate(TEXTS):
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
      full = model(ids, use_cache=False).logits[0].float().numpy()
      out = model(ids[:, :PREFIX], use_cache=True)
      steps = [out.logits[0, -1]]
      cache = _out_cache(out)
      for t in range(PREFIX, ids.shape[1]):
        out = model(ids[:, t:t + 1], use_cache=True, **{kw: cache})
        cache = _out_cache(out)
        steps.append(out.logits[0, -1])
      decode = torch.stack(steps).float().numpy()
      # Greedy continuation, EOS ignored: one cached step per token, recording the top-2 margin.
      out = model(ids, use_cache=True)
      cache = _out_cache(out)
      greedy, margin = [], []
      logits = out.logits[0, -1]
      for _ in range(NEW_TOKENS):
        top2 = torch.topk(logits, 2)
        nxt = int(top2.indices[0])
        greedy.append(nxt)
        margin.append(float(top2.values[0] - top2.values[1]))
        out = model(torch.tensor([[nxt]]), use_cache=True, **{kw: cache})
        cache = _out_cache(out)
        logits = out.logits[0, -1]
    np.savez(out_dir / f"case{i}.npz", tokens=ids[0].numpy().astype(np.int32),
             logits_full=full.astype(np.float32), logits_decode=decode.astype(np.float32),
             greedy=np.asarray(greedy, np.int32), greedy_margin=np.asarray(margin, np.float32))
  sha = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
  (out_dir / "meta.json").write_text(json.dumps(
      {"cases": len(TEXTS), "prefix_len": PREFIX, "new_tokens": NEW_TOKENS,
       "generator_sha256": sha, "gguf_size": gguf_file.stat().st_size,
       "transformers": transformers.__version__, "torch": torch.__version__}, indent=2) + "\n")
  print(f"wrote {len(TEXTS)} reference cases to {out_dir} in {time.time() - start:.1f}s")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
