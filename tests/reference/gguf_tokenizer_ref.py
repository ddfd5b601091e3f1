"""transformers' own tokenizer for a GGUF file: ids and chat renderings (run under .venv-ref).

Contract: ``python gguf_tokenizer_ref.py GGUF_FILE TEXTS_JSON [CHATS_JSON]`` (Python 3.11 with
transformers + gguf; no torch needed) loads ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``
and prints one JSON object to stdout:

  {"ids":     [[int]]  encode(text, add_special_tokens=False) for each text of TEXTS_JSON,
   "decoded": [str]    decode(ids, skip_special_tokens=True) for each,
   "chats":   [{"prompt": str, "prompt_ids": [int], "no_prompt": str}]
                       apply_chat_template(conversation, tokenize=False) with
                       add_generation_prompt True ("prompt", and its ids without special tokens
                       added) and False ("no_prompt"), for each conversation of CHATS_JSON,
   "vocab_size": int, "bos_token": str | null, "eos_token": str | null,
   "transformers": version, "load_s": seconds}

TEXTS_JSON is a file holding a JSON list of strings, CHATS_JSON one holding a JSON list of
conversations (lists of {"role", "content"}). transformers' GGUF converter does not know the
``smollm`` pre-tokenizer (it splits digits only where GPT-2's regex does), so callers compare ids
only on texts without digits. Imports nothing from phaseserve; writes nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time

import transformers
from transformers import AutoTokenizer


def main(argv: list[str]) -> None:
  if len(argv) not in (3, 4):
    raise SystemExit(f"usage: {argv[0]} GGUF_FILE TEXTS_JSON [CHATS_JSON]")
  path = os.path.abspath(argv[1])
  with open(argv[2], encoding="utf-8") as f:
    texts = json.load(f)
  chats = []
  if len(argv) == 4:
    with open(argv[3], encoding="utf-8") as f:
      chats = json.load(f)
  t0 = time.perf_counter()
  tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
  load_s = time.perf_counter() - t0
  ids = [tok.encode(text, add_special_tokens=False) for text in texts]
  out = {
      "ids": ids,
      "decoded": [tok.decode(i, skip_special_tokens=True) for i in ids],
      "chats": [],
      "vocab_size": len(tok),
      "bos_token": tok.bos_token,
      "eos_token": tok.eos_token,
      "transformers": transformers.__version__,
      "load_s": load_s,
  }
  for chat in chats:
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    out["chats"].append({
        "prompt": prompt,
        "prompt_ids": tok.encode(prompt, add_special_tokens=False),
        "no_prompt": tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=False),
    })
  json.dump(out, sys.stdout, ensure_ascii=True)
  sys.stdout.write("\n")


if __name__ == "__main__":
  main(sys.argv)
