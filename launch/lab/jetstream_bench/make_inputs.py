"""Inputs for JetStream's ``benchmarks/benchmark_serving.py`` against ``--model tiny`` (stdlib only).

  python launch/lab/jetstream_bench/make_inputs.py OUT_DIR [--conversations 64] [--seed 0]

Writes into OUT_DIR:
  sharegpt.json      a synthetic ShareGPT-format data set (``--dataset sharegpt --dataset-path``):
                     a list of {"id", "conversations": [{"from": "human"|"gpt", "value"}, ...]};
                     the script keeps the first two turns of those that start with "human".
  byte.tiktoken      a byte-level tiktoken BPE file (``--model llama-3 --tokenizer``): the 256
                     single bytes at ranks 0..255 and no merges, so a string encodes to its UTF-8
                     bytes, which are ids 0..255 of the ``tiny`` model's byte vocabulary. The
                     script's llama3 tokenizer adds its special tokens from id 256 on, so the
                     model's BOS/EOS/PAD (256/257/258) decode too.

Prompts are ASCII and 5..MAX_PROMPT bytes long, spread over the script's warm-up buckets
(0-16, 16-32, 32-64, 64-128, 128-256 tokens); replies are 8..64 bytes (the script drops prompts
or replies under 4 tokens; ``--max-output-length`` then sets every request's max_tokens).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random

_WORDS = ("prefill decode token cache page slot batch layout mesh shard latency throughput "
          "model server request stream sample kernel memory bandwidth compute schedule queue "
          "the a of and to in is for with on that by as are this be at from").split()


def _text(rng: random.Random, n_bytes: int) -> str:
  words: list[str] = []
  size = 0
  while size < n_bytes:
    w = rng.choice(_WORDS)
    words.append(w)
    size += len(w) + 1
  s = " ".join(words)[:n_bytes].strip()
  return (s[:1].upper() + s[1:]) if s else "Hi there"


def sharegpt(conversations: int, seed: int, max_prompt: int) -> list[dict]:
  rng = random.Random(seed)
  buckets = [(5, 16), (17, 32), (33, 64), (65, 128), (129, max_prompt)]
  buckets = [(lo, min(hi, max_prompt)) for lo, hi in buckets if lo <= max_prompt]
  data = []
  for i in range(conversations):
    lo, hi = buckets[i % len(buckets)]
    turns = [{"from": "human", "value": _text(rng, rng.randint(lo, hi))},
             {"from": "gpt", "value": _text(rng, rng.randint(8, 64))}]
    if i % 4 == 3:  # a longer conversation: only its first two turns are used
      turns += [{"from": "human", "value": _text(rng, 20)}, {"from": "gpt", "value": _text(rng, 20)}]
    data.append({"id": f"synthetic-{i}", "conversations": turns})
  # Rows the script filters out: a one-turn conversation and one that the model starts.
  data.append({"id": "synthetic-one-turn", "conversations": [{"from": "human", "value": "Hello"}]})
  data.append({"id": "synthetic-gpt-first", "conversations": [
      {"from": "gpt", "value": "How can I help?"}, {"from": "human", "value": "Tell me more"}]})
  return data


def byte_tiktoken() -> str:
  return "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("out_dir")
  p.add_argument("--conversations", type=int, default=64)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--max_prompt", type=int, default=200,
                 help="longest prompt in bytes (keep BOS + prompt + max_tokens <= max_context)")
  a = p.parse_args()
  if a.conversations < 1 or a.max_prompt < 5:
    p.error("--conversations must be >= 1 and --max_prompt >= 5")
  os.makedirs(a.out_dir, exist_ok=True)
  with open(os.path.join(a.out_dir, "sharegpt.json"), "w", encoding="utf-8") as f:
    json.dump(sharegpt(a.conversations, a.seed, a.max_prompt), f, indent=1)
  with open(os.path.join(a.out_dir, "byte.tiktoken"), "w", encoding="ascii") as f:
    f.write(byte_tiktoken())
  print(os.path.join(a.out_dir, "sharegpt.json"))
  print(os.path.join(a.out_dir, "byte.tiktoken"))


if __name__ == "__main__":
  main()
