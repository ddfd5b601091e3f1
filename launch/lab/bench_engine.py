"""The serving engine measured against itself and the bare model, in one run.

  python -m launch.lab.bench_engine --model small --json
  python -m launch.lab.bench_engine --model tiny --sections decode,continuous --trace_requests 16

Sections (``--sections``, all by default), each a JSON object under its name:
  * ``decode``: steady-state decode ms/step through the engine (scheduler + paged engine + loop,
    every slot decoding) at each ``--decode_batches`` size, against the bare model's jitted
    ``decode_step`` on a contiguous cache at the same batch, context and attended length, one
    step per call, greedy, ids copied to the host each step (equal steps per call); interleaved
    rounds, medians; ``x_direct`` = engine / direct.
  * ``paged``: paged against contiguous decode at batch 8, ``--paged_context`` (``launch.
    bench_pages`` at ``--page_size``).
  * ``continuous``: ``--trace_requests`` requests, prompts uniform in ``--prompt_range``, outputs
    geometric with mean ``--output_mean`` capped at ``--output_cap`` (EOS ignored), ``--slots``
    slots: continuous batching (all submitted at once) against static batching (groups of
    ``--slots`` that start and end together) on the same trace; generated tok/s and the ratio.
    The continuous figure is also the offline throughput of the trace.
  * ``chunked``: p99 TPOT and p99 inter-token gap of ``--slots // 2`` running decodes while
    ``--long_prompt``-token prompts arrive every few steps, with chunked prefill (``--chunk``
    tokens per step) and without (the whole prompt in one step), against the quiet TPOT; with
    ``--tpot_target_ms``, also whole prompts under the TPOT-aware prefill budget
    (``tpot_budget``).
  * ``prefill``: one prefill step per ``--prefill_mixes`` entry (a step's chunk lengths joined by
    ``+``, prompts from position 0) through the engine with its chunks packed end to end and
    padded to the longest (``pack_prefill`` on / off), interleaved rounds, best; ``x_packed`` =
    padded / packed.
``--json`` prints one object {"model", "dtype", "quantize", "machine", "date", <sections>}.
Bad flags exit 2.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import statistics
import time

import numpy as np
from absl import flags, logging

from launch import cli
from launch import machine
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "small", "model (preset, smollm2-135m, .gguf, checkpoint)")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "param dtype")
_QUANTIZE = flags.DEFINE_enum("quantize", "none", ["none", "int8"], "weight quantization")
_INT8_MODE = flags.DEFINE_enum("int8_mode", None, ["weight_only", "w8a8"],
                               "int8 compute (default: models.precision's choice, weight_only)")
_SECTIONS = flags.DEFINE_list("sections", ["decode", "paged", "continuous", "chunked", "prefill"],
                              "sections to run")
_DECODE_BATCHES = flags.DEFINE_list("decode_batches", ["1", "8", "32"], "engine decode batches")
_CONTEXT = flags.DEFINE_integer("context", 128, "prompt length for the decode section",
                                lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 16, "timed steps per round (decode section)",
                              lower_bound=2)
_ROUNDS = flags.DEFINE_integer("rounds", 3, "interleaved rounds", lower_bound=1)
_PAGE_SIZE = flags.DEFINE_integer("page_size", 64, "KV page size", lower_bound=1)
_PAGED_CONTEXT = flags.DEFINE_integer("paged_context", 2048, "context of the paged section",
                                      lower_bound=2)
_TRACE_REQUESTS = flags.DEFINE_integer("trace_requests", 256, "requests in the trace",
                                       lower_bound=1)
_PROMPT_RANGE = flags.DEFINE_list("prompt_range", ["64", "512"], "prompt lengths (min,max)")
_OUTPUT_MEAN = flags.DEFINE_integer("output_mean", 128, "mean output length", lower_bound=1)
_OUTPUT_CAP = flags.DEFINE_integer("output_cap", 512, "output length cap", lower_bound=1)
_SLOTS = flags.DEFINE_integer("slots", 32, "decode slots", lower_bound=2)
_LONG_PROMPT = flags.DEFINE_integer("long_prompt", 1024, "long prompt length (chunked section)",
                                    lower_bound=2)
_LONG_COUNT = flags.DEFINE_integer("long_count", 4, "long prompts arriving", lower_bound=1)
_CHUNK = flags.DEFINE_integer("chunk", 128, "prefill chunk when chunking", lower_bound=1)
_TPOT_TARGET = flags.DEFINE_float("tpot_target_ms", 0.0, "chunked section: also run whole "
                                  "prompts under the TPOT-aware prefill budget (0: skip)",
                                  lower_bound=0.0)
_PREFILL_MIXES = flags.DEFINE_list("prefill_mixes", ["60", "100", "150", "120+150", "60+130+170",
                                                     "128+128+128+128"],
                                   "prefill section: a step's chunk lengths, joined by '+'")
_SEED = flags.DEFINE_integer("seed", 0, "trace seed")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object")
_AMX = flags.DEFINE_bool("amx", True, "let the resolved CPU backend use its AMX kernel (an A/B "
                         "switch: --noamx)")
_DPBF16 = flags.DEFINE_bool("dpbf16", True, "let the resolved CPU backend use its AVX512-BF16 "
                            "kernel (an A/B switch: --nodpbf16)")
_TILED = flags.DEFINE_bool("tiled", True, "let the resolved CPU backend use its tiled "
                           "AVX512-BF16 kernel and weight copies (an A/B switch: --notiled)")


@functools.cache
def _backend():
  """The CPU backend as the server resolves it at start-up (``--noamx`` / ``--nodpbf16`` /
  ``--notiled``: without that kernel)."""
  from models.cpu import backend as cpu_backend
  b = cpu_backend.resolve().backend
  return dataclasses.replace(b, amx=b.amx and _AMX.value, dpbf16=b.dpbf16 and _DPBF16.value,
                             tiled=b.tiled and _TILED.value)


def _stack(cfg, params, tok, *, slots, pages, chunk, step_tokens, context, tpot_target_ms=0.0):
  from models.step import UnshardedStep
  from serving import stack
  config = stack.ServingConfig(max_slots=slots, page_size=_PAGE_SIZE.value, kv_pages=pages,
                               max_step_tokens=step_tokens, max_chunk=chunk,
                               max_waiting=100_000, max_context=context,
                               tpot_target_ms=tpot_target_ms)
  return stack.build(UnshardedStep(cfg, backend=_backend()), params, tok, config)


def _request(rid, prompt, max_tokens):
  from serving.request import Request
  from serving.sampling import SamplingParams
  from serving.stop import StopCriteria
  return Request(rid, tuple(int(t) for t in prompt), SamplingParams(),
                 StopCriteria(max_tokens=max_tokens, ignore_eos=True))


def _pages(tokens: int) -> int:
  return -(-tokens // _PAGE_SIZE.value)


def _decode_section(cfg, params, tok, rng) -> dict:
  import jax
  import jax.numpy as jnp
  from models.kv_cache import init_cache
  from models.transformer import bucket, decode_step
  from serving.sampling import argmax

  batches = [int(b) for b in _DECODE_BATCHES.value]
  ctx = _CONTEXT.value
  steps, rounds = _STEPS.value, _ROUNDS.value
  total = ctx + (rounds + 2) * steps + 4
  out = []
  for b in batches:
    loop = _stack(cfg, params, tok, slots=b, pages=b * _pages(total) + 1, chunk=256,
                  step_tokens=max(256, b), context=total + 1)
    for i in range(b):
      loop.submit(_request(f"d{i}", rng.integers(0, tok.vocab_size, ctx), total - ctx),
                  lambda o: None)
    while loop.scheduler.num_decoding < b:
      loop.step()
    for _ in range(steps):  # warm every attend bucket the timed steps reach
      loop.step()
    # The direct model: contiguous cache at the same context, one step per call.
    attend = min(bucket(ctx + (rounds + 2) * steps), loop.engine.config.pages_per_seq
                 * _PAGE_SIZE.value)
    cache = init_cache(cfg, b, attend, params["final_norm"].dtype, _backend())
    cache = cache.replace(lengths=jnp.full((b,), ctx, jnp.int32))
    toks = jnp.zeros((b,), jnp.int32)

    def direct_step(params, toks, cache):
      logits, cache = decode_step(params, toks, cache, cfg=cfg, attend_len=attend,
                                  backend=_backend())
      return argmax(logits), cache

    # The cache donated, as the engine donates its pages: otherwise every step copies it.
    direct = jax.jit(direct_step, donate_argnums=(2,))

    toks, cache = direct(params, toks, cache)
    np.asarray(toks)
    eng_ms, dir_ms = [], []
    for _ in range(rounds):
      t0 = time.perf_counter()
      for _ in range(steps):
        loop.step()
      eng_ms.append((time.perf_counter() - t0) * 1e3 / steps)
      t0 = time.perf_counter()
      for _ in range(steps):
        toks, cache = direct(params, toks, cache)
        np.asarray(toks)
      dir_ms.append((time.perf_counter() - t0) * 1e3 / steps)
    e, d = statistics.median(eng_ms), statistics.median(dir_ms)
    out.append({"batch": b, "engine_ms_per_step": round(e, 3), "direct_ms_per_step": round(d, 3),
                "x_direct": round(e / d, 3), "engine_best_ms": round(min(eng_ms), 3),
                "direct_best_ms": round(min(dir_ms), 3)})
    for i in range(b):
      loop.cancel(f"d{i}")
    loop.run_until_idle()
  return {"context": ctx, "steps_per_round": steps, "rounds": rounds, "rows": out}


def _trace(rng) -> list[tuple[np.ndarray, int]]:
  lo, hi = (int(v) for v in _PROMPT_RANGE.value)
  n, mean, cap = _TRACE_REQUESTS.value, _OUTPUT_MEAN.value, _OUTPUT_CAP.value
  outs = np.minimum(rng.geometric(1.0 / mean, size=n), cap)
  return [(rng.integers(0, 256, int(rng.integers(lo, hi + 1))), int(o)) for o in outs]


def _run_trace(loop, reqs, prefix) -> tuple[float, int]:
  done = {"tokens": 0}

  def on_output(o):
    done["tokens"] += len(o.token_ids)

  t0 = time.perf_counter()
  for i, (prompt, n) in enumerate(reqs):
    loop.submit(_request(f"{prefix}{i}", prompt, n), on_output)
  loop.run_until_idle()
  return time.perf_counter() - t0, done["tokens"]


def _continuous_section(cfg, params, tok, rng) -> dict:
  reqs = _trace(rng)
  slots = _SLOTS.value
  longest = max(len(p) + n for p, n in reqs)
  loop = _stack(cfg, params, tok, slots=slots, pages=slots * _pages(longest) + 1, chunk=256,
                step_tokens=256 + slots, context=longest + 1)
  # Warm-up: the same trace once, continuous and static, so every bucketed program it needs
  # is compiled before the timed runs (the engine compiles lazily).
  _run_trace(loop, reqs, "warm")
  for g in range(0, len(reqs), slots):
    _run_trace(loop, reqs[g:g + slots], f"warm{g}-")
  cont_s, cont_tok = _run_trace(loop, reqs, "c")
  static_s, static_tok = 0.0, 0
  for g in range(0, len(reqs), slots):
    s, t = _run_trace(loop, reqs[g:g + slots], f"s{g}-")
    static_s, static_tok = static_s + s, static_tok + t
  assert cont_tok == static_tok == sum(n for _, n in reqs)
  return {"requests": len(reqs), "slots": slots, "generated_tokens": cont_tok,
          "prompt_tokens": int(sum(len(p) for p, _ in reqs)),
          "continuous_s": round(cont_s, 2), "static_s": round(static_s, 2),
          "continuous_tok_s": round(cont_tok / cont_s, 2),
          "static_tok_s": round(static_tok / static_s, 2),
          "x_static": round(static_s / cont_s, 3), "programs": loop.engine.programs}


def _chunked_run(cfg, params, tok, rng, *, chunk, long_prompts: bool,
                 tpot_target_ms: float = 0.0) -> dict:
  slots = _SLOTS.value
  n_dec = max(1, slots // 2)
  long_len, n_long = _LONG_PROMPT.value, _LONG_COUNT.value
  dec_tokens = 24 + 6 * n_long
  context = long_len + 2
  pages = n_dec * _pages(64 + dec_tokens) + n_long * _pages(context) + 2
  loop = _stack(cfg, params, tok, slots=slots, pages=pages, chunk=chunk,
                step_tokens=chunk + slots, context=context + 64 + dec_tokens,
                tpot_target_ms=tpot_target_ms)
  # The warm pass compiles every program of the timed one; under the TPOT budget a second
  # one, since the first runs before the step-cost model is fitted (no limit: other chunks).
  reps = ("warm", "warm2", "timed") if tpot_target_ms else ("warm", "timed")
  for rep in reps:
    _chunked_pass(loop, rng, n_dec, dec_tokens, long_prompts, prefix=rep)
  tpots, gaps = [], []
  for i in range(n_dec):
    tr = loop.traces[f"timeddec{i}"]
    tpots.append(tr.timings()["tpot_s"] * 1e3)
    gaps += [g * 1e3 for g in tr.inter_token_s()]
  ttfts = [loop.traces[f"timedlong{i}"].timings()["ttft_s"] * 1e3
           for i in range(_LONG_COUNT.value) if long_prompts]
  return {"p99_tpot_ms": round(float(np.percentile(tpots, 99)), 3),
          "median_tpot_ms": round(float(np.median(tpots)), 3),
          "p99_itl_ms": round(float(np.percentile(gaps, 99)), 3),
          "max_itl_ms": round(max(gaps), 3),
          "long_ttft_ms_max": round(max(ttfts), 1) if ttfts else None}


def _chunked_pass(loop, rng, n_dec, dec_tokens, long_prompts, prefix) -> None:
  long_len, n_long = _LONG_PROMPT.value, _LONG_COUNT.value
  for i in range(n_dec):
    loop.submit(_request(f"{prefix}dec{i}", rng.integers(0, 256, 64), dec_tokens),
                lambda o: None)
  step = sent = 0
  while not loop.idle:
    loop.step()
    step += 1
    if long_prompts and sent < n_long and step >= 8 + 5 * sent:
      loop.submit(_request(f"{prefix}long{sent}", rng.integers(0, 256, long_len), 1),
                  lambda o: None)
      sent += 1


def _chunked_section(cfg, params, tok, rng) -> dict:
  long_len = _LONG_PROMPT.value
  quiet = _chunked_run(cfg, params, tok, rng, chunk=_CHUNK.value, long_prompts=False)
  chunked = _chunked_run(cfg, params, tok, rng, chunk=_CHUNK.value, long_prompts=True)
  whole = _chunked_run(cfg, params, tok, rng, chunk=long_len, long_prompts=True)
  out = {"long_prompt": long_len, "long_count": _LONG_COUNT.value, "chunk": _CHUNK.value,
         "quiet": quiet, "chunked": chunked, "unchunked": whole,
         "chunked_x_quiet": round(chunked["p99_tpot_ms"] / quiet["p99_tpot_ms"], 3),
         "unchunked_x_quiet": round(whole["p99_tpot_ms"] / quiet["p99_tpot_ms"], 3)}
  if _TPOT_TARGET.value > 0:  # whole prompts allowed; the TPOT-aware budget sizes the chunks
    budget = _chunked_run(cfg, params, tok, rng, chunk=long_len, long_prompts=True,
                          tpot_target_ms=_TPOT_TARGET.value)
    out.update(tpot_target_ms=_TPOT_TARGET.value, tpot_budget=budget,
               tpot_budget_x_quiet=round(budget["p99_tpot_ms"] / quiet["p99_tpot_ms"], 3))
  return out


def _prefill_section(cfg, params, mixes: list[list[int]], rng) -> dict:
  from models.step import UnshardedStep
  from serving.engine import Engine, EngineConfig
  from serving.step_plan import PrefillChunk, StepPlan

  slots = max(len(m) for m in mixes)
  per_seq = _pages(max(2048, max(n for m in mixes for n in m)))  # the server's context: chunks
  # padded to their power of two, not capped by a short one
  config = EngineConfig(max_slots=slots, num_pages=slots * per_seq, page_size=_PAGE_SIZE.value,
                        max_seq_tokens=per_seq * _PAGE_SIZE.value, kv_dtype=_DTYPE.value, lag=0)
  engines = {pack: Engine(UnshardedStep(cfg, backend=_backend()), params,
                          dataclasses.replace(config, pack_prefill=pack)) for pack in (True, False)}
  table = np.arange(slots * per_seq, dtype=np.int32).reshape(slots, per_seq)
  rows = []
  for mix in mixes:
    plan = StepPlan(0, tuple(PrefillChunk(f"r{i}", i, tuple(int(t) for t in rng.integers(
        0, cfg.vocab_size, n)), 0, True) for i, n in enumerate(mix)), (), (), table)
    ms: dict[bool, list[float]] = {True: [], False: []}
    for r in range(_ROUNDS.value + 1):  # round 0 compiles
      for pack, engine in engines.items():
        t0 = time.perf_counter()
        engine.execute(plan)
        ms[pack].append((time.perf_counter() - t0) * 1e3)
    packed, padded = min(ms[True][1:]), min(ms[False][1:])
    rows.append({"chunks": mix, "tokens": sum(mix), "packed_ms": round(packed, 2),
                 "padded_ms": round(padded, 2), "x_packed": round(padded / packed, 3)})
  return {"packed": engines[True].packed, "rows": rows,
          "programs": {"packed": sorted(k[1:3] for k in engines[True].program_set.shapes
                                        if k[0] == "prefill"),
                       "padded": sorted(k[1:3] for k in engines[False].program_set.shapes
                                        if k[0] == "prefill")}}


def run() -> dict:
  import jax.numpy as jnp
  from models.io.loader import load_model

  unknown = set(_SECTIONS.value) - {"decode", "paged", "continuous", "chunked", "prefill"}
  if unknown:
    raise CliError(f"unknown --sections {sorted(unknown)}")
  try:
    lo, hi = (int(v) for v in _PROMPT_RANGE.value)
    [int(b) for b in _DECODE_BATCHES.value]
    mixes = [[int(n) for n in m.split("+")] for m in _PREFILL_MIXES.value]
  except ValueError:
    raise CliError("--prompt_range is two integers, --decode_batches a list of integers and "
                   "--prefill_mixes lists of integers joined by '+'")
  if any(n < 1 for m in mixes for n in m):
    raise CliError("--prefill_mixes: chunk lengths are >= 1")
  if not 1 <= lo <= hi:
    raise CliError("--prompt_range must be 1 <= min <= max")
  dtype = jnp.float32 if _DTYPE.value == "float32" else jnp.bfloat16
  try:
    cfg, params, tok = load_model(_MODEL.value, dtype, quantize=_QUANTIZE.value,
                                  int8_mode=_INT8_MODE.value)
  except (ValueError, FileNotFoundError) as e:
    raise CliError(str(e))
  rng = np.random.default_rng(_SEED.value)
  out: dict = {"model": cfg.name, "dtype": _DTYPE.value, "quantize": _QUANTIZE.value,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "machine": machine.describe()}
  t0 = time.perf_counter()
  if "decode" in _SECTIONS.value:
    out["decode"] = _decode_section(cfg, params, tok, rng)
  if "paged" in _SECTIONS.value:
    from launch.lab import bench_pages
    out["paged"] = bench_pages.run(_MODEL.value, _DTYPE.value, 8, _PAGED_CONTEXT.value,
                                   (_PAGE_SIZE.value,), 8, _ROUNDS.value)
  if "continuous" in _SECTIONS.value:
    out["continuous"] = _continuous_section(cfg, params, tok, rng)
  if "chunked" in _SECTIONS.value:
    out["chunked"] = _chunked_section(cfg, params, tok, rng)
  if "prefill" in _SECTIONS.value:
    out["prefill"] = _prefill_section(cfg, params, mixes, rng)
  out["wall_s"] = round(time.perf_counter() - t0, 1)
  return out


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  result = run()
  print(json.dumps(result) if _JSON.value else json.dumps(result, indent=1))


if __name__ == "__main__":
  cli.run(main)
