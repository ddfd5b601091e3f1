"""What the prefix cache buys on shared prefixes: one engine, the same requests, cache on and off.

  python -m launch.lab.bench_prefix --model smollm2-135m --dtype bfloat16 --prefix_len 512 \
      --requests 16 --suffix_len 16 --max_tokens 16 --json

Workload (RadixAttention's case: a long shared system prompt or few-shot block): one request
with the shared ``--prefix_len`` tokens + its own suffix runs first (it fills the cache; with
``--host_tier`` a third run then pushes every cached page to the host tier, so the batch's hits
are host hits loaded back), then
``--requests`` requests with the same prefix and distinct ``--suffix_len`` suffixes arrive at
once. Both configurations are built in one process from the same params and warmed up; each
measures the batch's prefill tokens computed, TTFT p50 / p99, e2e, generated tokens/s and the
peak KV pages held (sequences + cache); ``kv_over_ideal`` compares that peak with the least KV
the whole batch needs (the prefix once plus each request's own tokens), and
``kv_held_over_least`` is the worst step's KV held by the running sequences over the least
those sequences need (the prefix once plus their own prompt and output tokens).
Prints one JSON object with both, the ratios (off / on for time), whether the greedy ids agree,
and the machine. ``--multiturn`` measures a session's turn 2 (turn 1's prompt + answer + new
ids) resumed from turn 1's pinned KV against recomputed without the cache.
"""

from __future__ import annotations

import json
import time

from absl import flags

from launch import cli
from launch import machine
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "model")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "float param dtype")
_QUANTIZE = flags.DEFINE_enum("quantize", "none", ["none", "int8"], "weight quantization")
_PREFIX = flags.DEFINE_integer("prefix_len", 512, "shared prefix tokens", lower_bound=1)
_SUFFIX = flags.DEFINE_integer("suffix_len", 16, "distinct tokens per request", lower_bound=1)
_REQUESTS = flags.DEFINE_integer("requests", 16, "requests sharing the prefix", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 16, "tokens per request", lower_bound=1)
_MAX_SLOTS = flags.DEFINE_integer("max_slots", 16, "decode slots", lower_bound=1)
_CHUNK = flags.DEFINE_integer("max_chunk", 256, "longest prefill chunk", lower_bound=16)
_CHUNKS = flags.DEFINE_integer("max_prefill_chunks", 4, "prefill chunks per step", lower_bound=1)
_STEP_TOKENS = flags.DEFINE_integer("max_step_tokens", 1024, "token budget per step",
                                    lower_bound=1)
_PAGE = flags.DEFINE_integer("page_size", 64, "KV positions per page", lower_bound=1)
_HOST = flags.DEFINE_bool("host_tier", True, "also run with the prefix pushed to the host tier")
_MULTITURN = flags.DEFINE_bool("multiturn", False, "instead: turn 2 of a session (turn 1's "
                               "prompt + answer + --suffix_len new ids), resumed vs recomputed")
_JSON = flags.DEFINE_bool("json", True, "one JSON line")


def _pct(xs, q):
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class _Collect:
  """An ``on_output`` that keeps each request's ids and, at its end, its cached tokens."""

  def __init__(self):
    self.ids: dict[str, list[int]] = {}
    self.cached: dict[str, int] = {}

  def __call__(self, o) -> None:
    self.ids.setdefault(o.request_id, []).extend(o.token_ids)
    if o.finished:
      self.cached[o.request_id] = o.usage.cached_tokens if o.usage else 0


def _run(loop, prompts, max_tokens):
  from serving.request import Request
  from serving.stop import StopCriteria
  cb = _Collect()
  ids, cached = cb.ids, cb.cached
  stop = StopCriteria(max_tokens=max_tokens, ignore_eos=True)
  loop.submit(Request("warm", tuple(prompts[0]), stop=stop), cb)
  loop.run_until_idle()
  cache = loop.scheduler.kv.prefix_cache
  if cache.host_capacity:  # push every cached page to the host tier
    cache.evict(0, loop.scheduler.kv.pool.budget.num_pages)
  t0 = time.perf_counter()
  for i, p in enumerate(prompts[1:]):
    loop.submit(Request(f"r{i}", tuple(p), stop=stop), cb)
  pool, sched = loop.scheduler.kv.pool, loop.scheduler
  peak = 0
  worst = 0.0  # KV held by running sequences / the least they need, at the worst step
  least = lambda r: _PREFIX.value + r * (
      _SUFFIX.value + max_tokens)
  while True:  # run_until_idle, sampling the pages held
    busy = loop.step()
    peak = max(peak, pool.pages_used + pool.pages_cached)
    if sched.num_running:
      worst = max(worst, pool.pages_used * pool.page_size / least(sched.num_running))
    if not busy and loop.idle:
      break
  seconds = time.perf_counter() - t0
  rids = [f"r{i}" for i in range(len(prompts) - 1)]
  ttft = [loop.traces[r].timings()["ttft_s"] for r in rids]
  prompt_tokens = sum(len(p) for p in prompts[1:])
  reused = sum(cached[r] for r in rids)
  return {"seconds": round(seconds, 3),
          "tokens_per_s": round(sum(len(ids[r]) for r in rids) / seconds, 1),
          "ttft_p50_ms": round(_pct(ttft, 0.5) * 1e3, 2),
          "ttft_p99_ms": round(_pct(ttft, 0.99) * 1e3, 2),
          "prefill_tokens_computed": prompt_tokens - reused, "cached_tokens": reused,
          "peak_kv_pages": peak, "peak_kv_bytes": peak * pool.budget.bytes_per_page,
          "kv_held_over_least": round(worst, 3),
          "programs": loop.engine.programs}, [ids[r] for r in rids]


def _turn2(loop, turn1, suffix, max_tokens) -> dict:
  """Turn 1 of a session, then turn 2 extending its prompt + answer: turn 2's TTFT."""
  from serving.request import Request
  from serving.stop import StopCriteria
  cb = _Collect()
  ids, cached = cb.ids, cb.cached
  stop = StopCriteria(max_tokens=max_tokens, ignore_eos=True)
  loop.submit(Request("t1", tuple(turn1), stop=stop, session_id="bench"), cb)
  loop.run_until_idle()
  turn2 = list(turn1) + ids["t1"] + list(suffix)
  loop.submit(Request("t2", tuple(turn2), stop=stop, session_id="bench"), cb)
  loop.run_until_idle()
  t = loop.traces["t2"].timings()
  return {"turn2_prompt": len(turn2), "ttft_ms": round(t["ttft_s"] * 1e3, 2),
          "cached_tokens": cached["t2"], "ids": ids["t2"]}


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  import jax.numpy as jnp
  from models.io.loader import load_model
  from models.cpu import backend as cpu_backend
  from models.step import UnshardedStep
  from serving import stack
  dtype = jnp.float32 if _DTYPE.value == "float32" else jnp.bfloat16
  try:
    cfg, params, tok = load_model(_MODEL.value, dtype, quantize=_QUANTIZE.value)
  except (ValueError, FileNotFoundError) as e:
    raise CliError(str(e))
  context = _PREFIX.value + _SUFFIX.value + _MAX_TOKENS.value
  if context + (_MAX_TOKENS.value + _SUFFIX.value if _MULTITURN.value else 0) > cfg.max_seq_len:
    raise CliError(f"prefix + suffix + max_tokens = {context} exceeds the model's context")
  vocab = tok.vocab_size - 3
  shared = [(11 + 7 * j) % vocab for j in range(_PREFIX.value)]
  prompts = [shared + [(101 + 13 * i + 5 * j) % vocab for j in range(_SUFFIX.value)]
             for i in range(_REQUESTS.value + 1)]
  pages = -(-context // _PAGE.value) * (_REQUESTS.value + 2) * 2
  out: dict[str, object] = {}
  ids = {}
  backend = cpu_backend.resolve().backend  # as the server resolves it at start-up
  if _MULTITURN.value:
    res = {}
    for name, on in (("recomputed", False), ("resumed", True)):
      loop = stack.build(UnshardedStep(cfg, backend=backend), params, tok, stack.ServingConfig(
          max_slots=_MAX_SLOTS.value, page_size=_PAGE.value, kv_pages=pages,
          max_step_tokens=_STEP_TOKENS.value, max_chunk=_CHUNK.value,
          max_prefill_chunks=_CHUNKS.value,
          max_context=context + _SUFFIX.value + _MAX_TOKENS.value,
          prefix_cache=on))
      stack.warmup(loop)
      res[name] = _turn2(loop, prompts[0], prompts[1][-_SUFFIX.value:], _MAX_TOKENS.value)
    same = res["recomputed"].pop("ids") == res["resumed"].pop("ids")
    print(json.dumps({"bench": "multiturn", "model": _MODEL.value, "dtype": _DTYPE.value,
                      "turn1_prompt": len(prompts[0]), **res,
                      "recomputed_over_resumed_ttft": round(
                          res["recomputed"]["ttft_ms"] / res["resumed"]["ttft_ms"], 3),
                      "same_greedy_ids": same,
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "machine": machine.describe()}))
    return
  runs = [("cache_off", False, 0), ("cache_on", True, 0)]
  if _HOST.value:
    runs.append(("cache_host", True, 1 << 40))
  for name, on, host in runs:
    loop = stack.build(UnshardedStep(cfg, backend=backend), params, tok, stack.ServingConfig(
        max_slots=_MAX_SLOTS.value, page_size=_PAGE.value, kv_pages=pages,
        max_step_tokens=_STEP_TOKENS.value, max_chunk=_CHUNK.value,
        max_prefill_chunks=_CHUNKS.value, max_context=context, prefix_cache=on,
        host_tier_bytes=host))
    stack.warmup(loop)
    out[name], ids[name] = _run(loop, prompts, _MAX_TOKENS.value)
    if host:
      c = loop.scheduler.kv.prefix_cache
      out[name].update(spilled=c.spilled, loaded=c.loaded, host_hit_tokens=c.host_hit_tokens)
  on, off = out["cache_on"], out["cache_off"]
  # The KV the batch needs at the least: the shared prefix once, plus each request's own tokens.
  own = _SUFFIX.value + _MAX_TOKENS.value
  ideal_tokens = _PREFIX.value + _REQUESTS.value * own
  page_tokens = _PAGE.value
  result = {"bench": "prefix_cache", "model": _MODEL.value, "dtype": _DTYPE.value,
            "quantize": _QUANTIZE.value, "prefix_len": _PREFIX.value,
            "suffix_len": _SUFFIX.value, "requests": _REQUESTS.value,
            "max_tokens": _MAX_TOKENS.value, **out,
            "off_over_on": {k: round(off[k] / on[k], 3) for k in ("seconds", "ttft_p50_ms",
                                                                 "ttft_p99_ms")},
            **({"off_over_host": {k: round(off[k] / out["cache_host"][k], 3)
                                  for k in ("seconds", "ttft_p50_ms", "ttft_p99_ms")}}
               if "cache_host" in out else {}),
            "kv_over_ideal": {k: round(out[k]["peak_kv_pages"] * page_tokens / ideal_tokens, 3)
                              for k in ("cache_off", "cache_on")},
            "same_greedy_ids": all(v == ids["cache_off"] for v in ids.values()),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine.describe()}
  print(json.dumps(result, indent=None if _JSON.value else 2))


if __name__ == "__main__":
  cli.run(main)
