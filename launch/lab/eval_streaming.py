"""Perplexity of an endless stream under KV cache policies: StreamingLLM's result, reproduced.

  python -m launch.lab.eval_streaming --json                          # SmolLM2, window 256
  python -m launch.lab.eval_streaming --windows 64,256 --sinks 4 --max_tokens 1024

The project's English passages (``--text``, passages joined) are one stream, fed one token at a
time (``launch.lab.streaming.stream_nll``: a sink paged pool, RoPE at in-cache positions,
the window's pages a ring) under, for each ``--windows`` entry W, ``sinks + window W`` and
``window W`` alone; full attention (one causal forward of the same tokens) is the reference.
Perplexities are over the tokens past the first W (where the policies differ from full
attention). ``--json`` prints {"model", "quantize", "date", "machine", "tokens", "sinks",
"results": [{"window", "full_ppl", "sinks_ppl", "window_ppl", "sinks_x_full",
"window_x_full"}], "seconds"}. Bad flags exit 2.
"""

from __future__ import annotations

import json
import time

from absl import flags

from launch import cli
from launch import machine
from launch.cli import CliError
from launch.lab.passages import DEFAULT_PASSAGES

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "a trained model, .gguf file or checkpoint")
_QUANTIZE = flags.DEFINE_enum("quantize", None, ["int8"], "weights (default: float)")
_TEXT = flags.DEFINE_string("text", str(DEFAULT_PASSAGES), "UTF-8 text; passages joined")
_WINDOWS = flags.DEFINE_list("windows", ["256"], "window sizes (tokens)")
_SINKS = flags.DEFINE_integer("sinks", 4, "sink tokens kept beside the window", lower_bound=1)
_PAGE = flags.DEFINE_integer("page_size", 16, "KV page size", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 0, "score only the first N tokens (0: all)",
                                   lower_bound=0)
_JSON = flags.DEFINE_bool("json", False, "print one JSON object instead of a table")


def run() -> dict:
  import jax.numpy as jnp
  import numpy as np
  from models.io.loader import load_model
  from launch.lab.passages import read_passages
  from launch.lab.streaming import Policy, dense_nll, stream_nll

  windows = cli.positive_ints("windows", _WINDOWS.value)
  try:
    text = "\n\n".join(read_passages(_TEXT.value))
    cfg, params, tok = load_model(_MODEL.value, jnp.float32, quantize=_QUANTIZE.value or "none")
  except (OSError, UnicodeDecodeError, ValueError) as e:
    raise CliError(str(e))
  ids = tok.encode(text)
  if _MAX_TOKENS.value:
    ids = ids[:_MAX_TOKENS.value]
  if len(ids) <= max(windows) + 1:
    raise CliError(f"the text has {len(ids)} tokens: not longer than the window")
  start = time.perf_counter()
  try:
    full = dense_nll(params, ids, cfg=cfg)
    results = []
    for w in windows:
      nll = stream_nll(params, ids, cfg=cfg, policies=[Policy(_SINKS.value, w), Policy(0, w)],
                       page_size=_PAGE.value)
      ppl = [float(np.exp(np.mean(x[w:]))) for x in (full, nll[0], nll[1])]
      results.append({"window": w, "full_ppl": ppl[0], "sinks_ppl": ppl[1],
                      "window_ppl": ppl[2], "sinks_x_full": ppl[1] / ppl[0],
                      "window_x_full": ppl[2] / ppl[0]})
  except ValueError as e:
    raise CliError(str(e))
  return {"model": _MODEL.value, "quantize": _QUANTIZE.value or "none",
          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
          "machine": machine.describe(), "tokens": len(ids), "sinks": _SINKS.value,
          "results": results, "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str]) -> None:
  cli.start(argv)
  r = run()
  if _JSON.value:
    print(json.dumps(r))
    return
  print(f"{r['model']} ({r['quantize']}) on {r['machine']['cpu']}: {r['tokens']} tokens, "
        f"{r['seconds']} s; perplexity past the window")
  for x in r["results"]:
    print(f"  window {x['window']}: full {x['full_ppl']:.2f}, sinks {r['sinks']} + window "
          f"{x['sinks_ppl']:.2f} ({x['sinks_x_full']:.2f}x), window alone {x['window_ppl']:.2f} "
          f"({x['window_x_full']:.2f}x)")


if __name__ == "__main__":
  cli.run(main)
