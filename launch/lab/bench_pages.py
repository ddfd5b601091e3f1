"""Paged against contiguous KV decode: the measurement behind the page size.

  python -m launch.lab.bench_pages --json          # small preset, bf16, batch 8, context 2048
  python -m launch.lab.bench_pages --model smollm2-135m --page_sizes 64 --kv_int8 --json

Every row of a batch of ``--batch`` holds ``--context - --steps`` positions; one timed call runs
``--steps`` greedy decode steps (``models.transformer.decode_step`` in a jitted ``fori_loop``, the
store donated) with ``attend_len = --context``, over the contiguous ``KVCache`` and over a
``models.paged_kv.PagedKV`` per ``--page_sizes`` entry whose pages are scattered over the pool (a
random permutation, as a long-running pool's free list would give). The configurations are timed
interleaved (one call of each per round, ``--repeats`` rounds after a warm-up call each), so load
from other processes hits them alike; the figures are the median and the best (least disturbed
on a shared machine) call. ``--json`` prints one JSON object {"model", "dtype", "batch",
"context", "steps", "repeats", "date", "cpu", "load_avg_1m", "contiguous_ms_per_step",
"contiguous_best_ms_per_step", "paged": [{"page_size", "ms_per_step", "x_contiguous",
"best_ms_per_step", "x_contiguous_best", "kv_bytes"}], "wall_s"}; ``--kv_int8`` also times an
int8 pool (per-token, per-head scales) with the same table and adds "int8_ms_per_step",
"int8_x_paged" (int8 over the float pool), "int8_best_ms_per_step", "int8_x_paged_best",
"int8_kv_bytes" to each page size's entry. ``--model`` may be a preset or ``smollm2-135m``
(its shapes, random weights: the timing does not depend on them).
Bad flags exit 2 with a one-line error.
"""

from __future__ import annotations

import json

from absl import flags, logging

from launch import cli
from launch.lab import paged_timing
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "small", "a preset (tiny, small) or a trained model (smollm2-135m)")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "param / KV dtype")
_BATCH = flags.DEFINE_integer("batch", 8, "decode batch", lower_bound=1)
_CONTEXT = flags.DEFINE_integer("context", 2048, "attended positions (attend_len)",
                                lower_bound=2)
_PAGE_SIZES = flags.DEFINE_list("page_sizes", ["16", "32", "64", "128"], "page sizes to time")
_STEPS = flags.DEFINE_integer("steps", 8, "decode steps per timed call", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed rounds", lower_bound=1)
_JSON = flags.DEFINE_bool("json", False, "print one JSON object instead of a table")
_KV_INT8 = flags.DEFINE_bool("kv_int8", False, "also time an int8 KV pool per page size")


def _page_sizes() -> tuple[int, ...]:
  try:
    out = tuple(int(v) for v in _PAGE_SIZES.value if v.strip())
  except ValueError:
    raise CliError(f"--page_sizes must be integers, got {','.join(_PAGE_SIZES.value)!r}")
  if not out:
    raise CliError("--page_sizes is empty")
  return out


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  from models.config import PRESET_NAMES
  if _MODEL.value not in PRESET_NAMES or _MODEL.value.startswith("palm"):
    raise CliError(f"--model must be an instantiable preset, got {_MODEL.value!r}")
  try:
    r = paged_timing.run(_MODEL.value, _DTYPE.value, _BATCH.value, _CONTEXT.value, _page_sizes(),
                         _STEPS.value, _REPEATS.value, _KV_INT8.value)
  except ValueError as e:
    raise CliError(str(e))
  if _JSON.value:
    print(json.dumps(r))
    return
  print(f"{r['model']} {r['dtype']} batch {r['batch']} context {r['context']} on {r['cpu']}: "
        f"contiguous {r['contiguous_ms_per_step']:.2f} ms/step (median)")
  for p in r["paged"]:
    print(f"  page {p['page_size']:4d}: {p['ms_per_step']:.2f} ms/step "
          f"({p['x_contiguous']:.3f}x contiguous; best {p['x_contiguous_best']:.3f}x)")
    if "int8_ms_per_step" in p:
      print(f"       int8 KV: {p['int8_ms_per_step']:.2f} ms/step ({p['int8_x_paged']:.3f}x the "
            f"float pool), {p['int8_kv_bytes'] / p['kv_bytes']:.3f}x its bytes")


if __name__ == "__main__":
  cli.run(main)
