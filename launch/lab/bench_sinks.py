"""Attention sinks against sliding-window recompute: tokens/s of an endless stream.

  python -m launch.lab.bench_sinks --json       # smollm2-135m shapes, bf16, window 256, 2048 tokens

Both keep a window of ``--window`` tokens. Sinks (StreamingLLM): one decode step per token over
a sink paged pool whose window pages are a ring (``launch.lab.streaming.stream_nll``: ``--sinks``
+ ``--window``, the whole ``--stream`` in one ``lax.scan``, timed on a second call after a
compiling one). Window recompute: per token a fresh prefill of the last ``--window`` tokens
(``launch.lab.streaming.recompute_logits``), timed over ``--recompute_tokens`` positions past the
window after one compiling call (it costs the same at every such position). Random weights
(speed does not depend on them) and random token ids. ``--json`` prints {"model", "dtype",
"quantize", "window", "sinks", "stream", "page_size", "sinks_tok_s", "recompute_tok_s",
"speedup", "kv_pages_sinks", "date", "cpu", "load_avg_1m", "wall_s"}. Bad flags exit 2.
"""

from __future__ import annotations

import datetime
import json
import os
import time

from absl import flags

from launch import cli
from launch import machine
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "model preset")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "params / activations")
_QUANTIZE = flags.DEFINE_enum("quantize", None, ["int8"], "weights (default: float)")
_WINDOW = flags.DEFINE_integer("window", 256, "tokens of recent context", lower_bound=1)
_SINKS = flags.DEFINE_integer("sinks", 4, "sink tokens", lower_bound=0)
_STREAM = flags.DEFINE_integer("stream", 2048, "tokens in the stream", lower_bound=2)
_RECOMPUTE = flags.DEFINE_integer("recompute_tokens", 32, "positions timed for the recompute "
                                  "baseline", lower_bound=1)
_PAGE = flags.DEFINE_integer("page_size", 16, "KV page size", lower_bound=1)
_JSON = flags.DEFINE_bool("json", False, "print one JSON object instead of a line")


def run() -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from models.config import get_preset
  from launch.lab.streaming import Policy, recompute_logits, ring_pages, stream_nll
  from models.weights import init_params, quantize

  cli.preset(_MODEL.value)
  if _STREAM.value <= _WINDOW.value + _RECOMPUTE.value:
    raise CliError("--stream must exceed --window + --recompute_tokens")
  t0 = time.perf_counter()
  cfg = get_preset(_MODEL.value)
  dtype = jnp.float32 if _DTYPE.value == "float32" else jnp.bfloat16
  params = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), dtype)
  if _QUANTIZE.value:
    params = quantize(params, cfg)
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, _STREAM.value).tolist()
  policy = Policy(_SINKS.value, _WINDOW.value)
  try:
    pages = ring_pages(policy, _PAGE.value)
    stream_nll(params, ids, cfg=cfg, policies=[policy], page_size=_PAGE.value)  # compiles
    t = time.perf_counter()
    stream_nll(params, ids, cfg=cfg, policies=[policy], page_size=_PAGE.value)
    sinks_s = time.perf_counter() - t
    w = _WINDOW.value
    recompute_logits(params, ids, cfg=cfg, window=w, positions=[w])  # compiles
    pos = list(range(w, w + _RECOMPUTE.value))
    t = time.perf_counter()
    recompute_logits(params, ids, cfg=cfg, window=w, positions=pos)
    rec_s = time.perf_counter() - t
  except ValueError as e:
    raise CliError(str(e))
  sinks_tok_s = (len(ids) - 1) / sinks_s
  rec_tok_s = len(pos) / rec_s
  return {"model": cfg.name, "dtype": _DTYPE.value, "quantize": _QUANTIZE.value or "none",
          "window": w, "sinks": _SINKS.value, "stream": len(ids), "page_size": _PAGE.value,
          "sinks_tok_s": round(sinks_tok_s, 2), "recompute_tok_s": round(rec_tok_s, 2),
          "speedup": round(sinks_tok_s / rec_tok_s, 2), "kv_pages_sinks": pages,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "cpu": machine.cpu_model(),
          "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
          "wall_s": round(time.perf_counter() - t0, 1)}


def main(argv: list[str]) -> None:
  cli.start(argv)
  r = run()
  if _JSON.value:
    print(json.dumps(r))
    return
  print(f"{r['model']} {r['dtype']} on {r['cpu']}: sinks {r['sinks']} + window {r['window']} "
        f"{r['sinks_tok_s']} tok/s ({r['kv_pages_sinks']} pages of {r['page_size']}), window "
        f"recompute {r['recompute_tok_s']} tok/s: {r['speedup']}x")


if __name__ == "__main__":
  cli.run(main)
