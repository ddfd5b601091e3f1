"""Quality of a model's precision variants on real text: perplexity, KL and top-1 against f32.

  python -m launch.lab.eval_quality --model smollm2-135m --json
  python -m launch.lab.eval_quality --model path/to/model.gguf --variants f32,int8 --max_docs 2
  python -m launch.lab.eval_quality --variants f32,f32+kv8,int8,int8+kv8   # the int8 KV cache

Scores every next token of each passage of ``--text`` (passages split at lines holding only
``===``; default: the project's own English passages, ``tests/data/english_passages.txt``) with
each variant of ``launch.lab.quality.make_variants`` and compares its distributions with the first
variant's. ``--json`` prints one object: {"model", "date", "machine", "text", "docs", "tokens",
"variants": {name: {"perplexity", "kl", "top1", "tokens"}}, "seconds"}. Bad flags exit 2.
"""

from __future__ import annotations

import json
import time

from absl import flags, logging

from launch import cli
from launch import machine
from launch.cli import CliError
from launch.lab.passages import DEFAULT_PASSAGES

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "a trained model, .gguf file or checkpoint")
_TEXT = flags.DEFINE_string("text", str(DEFAULT_PASSAGES), "UTF-8 text; passages split at '==='")
_VARIANTS = flags.DEFINE_list("variants", ["f32", "bf16", "int8", "w8a8", "w8a8_raw"],
                              "precision variants; the first is the reference")
_MAX_DOCS = flags.DEFINE_integer("max_docs", 0, "score only the first N passages (0 = all)",
                                 lower_bound=0)
_JSON = flags.DEFINE_bool("json", False, "print one JSON object instead of a table")


def run() -> dict:
  import jax.numpy as jnp
  from models import precision
  from models.io.loader import load_model
  from launch.lab.passages import read_passages
  from launch.lab.quality import KV8, VARIANTS, compare, make_variants

  unknown = [v for v in _VARIANTS.value if v.removesuffix(KV8) not in VARIANTS]
  if unknown or not _VARIANTS.value:
    raise CliError(f"--variants must be a non-empty list of {', '.join(VARIANTS)} (each "
                   f"optionally with {KV8}: over an int8 KV cache); got "
                   f"{','.join(_VARIANTS.value)!r}")
  try:
    docs_text = read_passages(_TEXT.value)
  except (OSError, UnicodeDecodeError) as e:
    raise CliError(f"--text {_TEXT.value!r}: {e}")
  if _MAX_DOCS.value:
    docs_text = docs_text[:_MAX_DOCS.value]
  try:
    cfg, params, tok = load_model(_MODEL.value, jnp.float32)
  except (ValueError, FileNotFoundError) as e:
    raise CliError(str(e))
  docs = [tok.encode(d) for d in docs_text]
  start = time.perf_counter()
  try:
    calibration = tok.encode(precision.calibration_text())
    scores = compare(make_variants(params, cfg, _VARIANTS.value, calibration), docs, cfg)
  except ValueError as e:
    raise CliError(str(e))
  return {"model": _MODEL.value, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
          "machine": machine.describe(), "text": _TEXT.value, "docs": len(docs),
          "tokens": sum(len(d) for d in docs),
          "variants": {k: v.to_json() for k, v in scores.items()},
          "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  result = run()
  if _JSON.value:
    print(json.dumps(result))
    return
  print(f"{result['model']} on {result['machine']['cpu']}: {result['docs']} passages, "
        f"{result['tokens']} tokens ({result['seconds']} s)")
  print(f"{'variant':<8} {'perplexity':>10} {'KL vs ref':>10} {'top-1':>7}")
  for name, v in result["variants"].items():
    print(f"{name:<8} {v['perplexity']:>10.3f} {v['kl']:>10.5f} {v['top1']:>7.4f}")


if __name__ == "__main__":
  cli.run(main)
