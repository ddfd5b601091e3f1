"""transformers' chat rendering for a Hugging Face tokenizer directory (run under .venv-ref).

Contract: ``python chat_template_ref.py OUT_DIR TOKENIZER_DIR CHATS_JSON`` (Python 3.11 with
transformers; no torch needed) loads ``AutoTokenizer.from_pretrained(TOKENIZER_DIR)`` (its
``tokenizer.json`` and ``tokenizer_config.json``, whose ``chat_template`` it applies) and writes
``OUT_DIR/chats.json``: for each conversation of CHATS_JSON (a list of lists of {role, content}),
{"text": apply_chat_template(conversation, tokenize=False, add_generation_prompt=True),
 "ids": the ids apply_chat_template(..., tokenize=True) gives, "error": null}, or {"error": str}
when the template raises. Imports nothing from phaseserve.
"""

from __future__ import annotations

import json
import os
import sys

import transformers
from transformers import AutoTokenizer


def _ids(out) -> list[int]:
  if isinstance(out, dict) or hasattr(out, "keys"):  # a BatchEncoding (return_dict default)
    out = out["input_ids"]
  return [int(i) for i in out]


def main(argv: list[str]) -> None:
  if len(argv) != 4:
    raise SystemExit(f"usage: {argv[0]} OUT_DIR TOKENIZER_DIR CHATS_JSON")
  out_dir, tok_dir, chats_path = argv[1:]
  with open(chats_path, encoding="utf-8") as f:
    chats = json.load(f)
  tok = AutoTokenizer.from_pretrained(tok_dir)
  results = []
  for chat in chats:
    try:
      text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
      ids = _ids(tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True))
      results.append({"text": text, "ids": ids, "error": None})
    except Exception as e:  # the template's raise_exception: its message is kept
      results.append({"error": f"{type(e).__name__}: {e}"})
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "chats.json"), "w", encoding="utf-8") as f:
    json.dump({"chats": results, "transformers": transformers.__version__}, f,
              ensure_ascii=False)


if __name__ == "__main__":
  main(sys.argv)
