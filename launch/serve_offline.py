"""Offline batch serving: every request of a JSONL file submitted at once to the engine.

  python -m launch.serve_offline --model smollm2-135m --requests reqs.jsonl --quantize int8 --json

One request per line: {"prompt": "..."} or {"prompt_ids": [...]} or {"messages": [...]} (chat,
rendered with the model's template), plus optional "max_tokens" (default 64), "temperature",
"top_k", "top_p", "seed" (default: a fresh random seed), "stop" (a string or a list of strings),
"stop_ids", "min_tokens", "ignore_eos", "priority", "lora" (a LoRA adapter of ``--lora_modules``, by
name). Results are written one line each, in input
order: {"index", "token_ids", "text", "finish_reason", "message", "ttft_ms", "tpot_ms",
"queue_ms", "e2e_ms", "prompt_tokens", "completion_tokens"}; a bad line gets {"index", "error"}
naming the field, and the others still run. The last line is {"summary": {"requests",
"completion_tokens", "seconds", "throughput_tok_s", "kv_pages_in_use", "programs",
"programs_warmed", "warmup_s", "deployment", ...}} (``kv_pages_in_use`` must be 0; ``--warmup``,
the default, compiles every bucketed program before the clock starts). ``--mode disaggregated``
(with ``--fake_devices 8`` on a CPU) runs prefill and decode on two sub-meshes; layouts per phase
come from ``--prefill_layout`` / ``--decode_layout`` (``ffn:attn``) or the planner. ``--trace_out FILE`` writes every request's Chrome trace.
Bad flags exit 2 with one line.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import TYPE_CHECKING, Iterator

from absl import flags, logging

from launch import cli, engine_flags as ef
from launch import machine
from launch.cli import CliError
from serving.step_timeline import summarize

if TYPE_CHECKING:
  from models.text.tokenizer import Tokenizer
  from serving.lora import LoraRegistry
  from serving.request import Request

_REQUESTS = flags.DEFINE_string("requests", None, "JSONL file, one request per line")
_JSON = flags.DEFINE_bool("json", False, "JSON lines on stdout (else a short table)")
_WARMUP = flags.DEFINE_bool("warmup", True, "compile every bucketed program before serving")
_TRACE_OUT = flags.DEFINE_string("trace_out", None, "write the Chrome trace JSON here")

_FIELDS = {"prompt", "prompt_ids", "messages", "max_tokens", "temperature", "top_k", "top_p",
           "seed", "stop", "stop_ids", "min_tokens", "ignore_eos", "priority", "lora"}


def parse_request(index: int, line: str, tokenizer: "Tokenizer",
                  loras: "LoraRegistry | None" = None) -> "Request":
  """One JSONL line -> Request; ``ValueError`` naming the bad field."""
  from serving.request import Request, fresh_seed
  from serving.sampling import SamplingParams
  from serving.stop import StopCriteria
  try:
    obj = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"not JSON: {e}") from None
  if not isinstance(obj, dict):
    raise ValueError("a request must be a JSON object")
  unknown = sorted(set(obj) - _FIELDS)
  if unknown:
    raise ValueError(f"unknown field {unknown[0]!r}")
  given = [k for k in ("prompt", "prompt_ids", "messages") if k in obj]
  if len(given) != 1:
    raise ValueError("give exactly one of 'prompt', 'prompt_ids', 'messages'")

  def typed(name, kinds, default):
    v = obj.get(name, default)
    if isinstance(v, bool) and bool not in kinds:
      raise ValueError(f"field {name!r} must be {kinds[0].__name__}, got {v!r}")
    if not isinstance(v, kinds):
      raise ValueError(f"field {name!r} must be {kinds[0].__name__}, got {v!r}")
    return v

  if "prompt" in obj:
    ids = tokenizer.encode(typed("prompt", (str,), ""))
    if tokenizer.bos_id is not None:
      ids = [tokenizer.bos_id] + ids
  elif "prompt_ids" in obj:
    ids = typed("prompt_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tokenizer.vocab_size
               for t in ids):
      raise ValueError(f"field 'prompt_ids' must be ids in [0, {tokenizer.vocab_size})")
  else:
    try:
      ids = tokenizer.encode_chat(typed("messages", (list,), []))
    except ValueError as e:
      raise ValueError(f"field 'messages': {e}") from None
  if not ids:
    raise ValueError("the prompt is empty")
  stop = obj.get("stop", [])
  stop = [stop] if isinstance(stop, str) else stop
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
    raise ValueError("field 'stop' must be a non-empty string or a list of them")
  stop_ids = typed("stop_ids", (list,), [])
  if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
    raise ValueError("field 'stop_ids' must be a list of integers")
  seed = obj.get("seed")
  if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
    raise ValueError(f"field 'seed' must be an integer, got {seed!r}")
  temperature = float(typed("temperature", (int, float), 0.0))
  top_k, top_p = typed("top_k", (int,), 0), float(typed("top_p", (int, float), 1.0))
  try:
    sampling = SamplingParams(temperature, top_k, top_p, fresh_seed() if seed is None else seed)
  except ValueError as e:
    raise ValueError(f"sampling field: {e}") from None
  max_tokens, min_tokens = typed("max_tokens", (int,), 64), typed("min_tokens", (int,), 0)
  ignore_eos = typed("ignore_eos", (bool,), False)
  try:
    criteria = StopCriteria(max_tokens=max_tokens, stop_ids=tuple(stop_ids),
                            stop_strings=tuple(stop), min_tokens=min_tokens,
                            ignore_eos=ignore_eos)
  except ValueError as e:
    raise ValueError(f"field 'max_tokens' / 'min_tokens': {e}") from None
  lora, name = None, typed("lora", (str,), "")
  if name:
    try:
      if loras is None:
        raise LookupError("this run serves no LoRA adapters (--lora_modules)")
      lora = loras.resolve(name)
    except LookupError as e:
      raise ValueError(f"field 'lora': {e.args[0]}") from None
  return Request(f"req-{index}", tuple(ids), sampling, criteria, typed("priority", (int,), 0),
                 lora=lora)


def _read_lines(path: str) -> Iterator[str]:
  try:
    with open(path, encoding="utf-8") as f:
      for line in f:
        if line.strip():
          yield line
  except OSError as e:
    raise CliError(f"--requests {path!r}: {e}")


def run() -> list[dict]:
  ef.set_fake_devices()
  from serving import stack
  from serving.lifecycle import chrome_trace

  if _REQUESTS.value is None:
    raise CliError("--requests is required")
  lines = list(_read_lines(_REQUESTS.value))
  built = ef.build(max_waiting=max(1, len(lines)))
  cfg, tok, steps, loop, mode = built.cfg, built.tokenizer, built.steps, built.loop, built.mode
  t0 = time.perf_counter()
  warmed = stack.warmup(loop, ef.WARMUP_THREADS.value or None) if _WARMUP.value else 0
  warmup_s = time.perf_counter() - t0
  results: list[dict | None] = [None] * len(lines)
  texts: dict[int, list[str]] = {}
  ids: dict[int, list[int]] = {}
  index_of: dict[str, int] = {}

  def on_output(out):
    i = index_of[out.request_id]
    ids.setdefault(i, []).extend(out.token_ids)
    texts.setdefault(i, []).append(out.text)
    if out.finished:
      t = loop.traces[out.request_id].timings()
      ms = lambda v: None if v is None else round(v * 1e3, 3)
      results[i] = {"index": i, "token_ids": ids[i], "text": "".join(texts[i]),
                    "finish_reason": out.finish_reason.value, "message": out.message,
                    "ttft_ms": ms(t["ttft_s"]), "tpot_ms": ms(t["tpot_s"]),
                    "queue_ms": ms(t["queue_s"]), "e2e_ms": ms(t["e2e_s"]),
                    "prompt_tokens": out.usage.prompt_tokens if out.usage else None,
                    "completion_tokens": out.usage.completion_tokens if out.usage else None}

  start = time.perf_counter()
  for i, line in enumerate(lines):
    try:
      req = parse_request(i, line, tok, loop.loras)
    except ValueError as e:
      results[i] = {"index": i, "error": str(e)}
      continue
    index_of[req.request_id] = i
    loop.submit(req, on_output)
  loop.run_until_idle()
  seconds = time.perf_counter() - start
  done = [r for r in results if r is not None and "error" not in r]
  completion = sum(r["completion_tokens"] or 0 for r in done)
  if _TRACE_OUT.value:
    with open(_TRACE_OUT.value, "w", encoding="utf-8") as f:
      json.dump(chrome_trace(loop.traces.values()), f)
  summary = {"requests": len(lines), "ok": len(done), "errors": len(lines) - len(done),
             "completion_tokens": completion, "seconds": round(seconds, 3),
             "throughput_tok_s": round(completion / seconds, 2) if seconds > 0 else None,
             "kv_pages_in_use": loop.occupancy().pages_used,
             "programs": loop.engine.programs, "programs_warmed": warmed,
             "warmup_s": round(warmup_s, 2), "model": cfg.name, "quantize": ef.QUANTIZE.value,
             "dtype": built.dtype, "defaults": built.defaults, "mode": mode, "deployment": steps.description,
             "stack": stack.describe(loop),
             "spec_decode": dataclasses.asdict(loop.scheduler.spec), "step_breakdown": summarize(loop.timeline.records),
             "machine": machine.describe()}
  return [r for r in results if r is not None] + [{"summary": summary}]


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  rows = run()
  if _JSON.value:
    for r in rows:
      print(json.dumps(r))
    return
  for r in rows[:-1]:
    print(f"[{r['index']}] " + (f"error: {r['error']}" if "error" in r else
                               f"{r['finish_reason']}: {r['text']!r}"))
  s = rows[-1]["summary"]
  print(f"{s['ok']}/{s['requests']} ok, {s['completion_tokens']} tokens in {s['seconds']} s "
        f"({s['throughput_tok_s']} tok/s), KV pages in use at the end: {s['kv_pages_in_use']}")


if __name__ == "__main__":
  cli.run(main)
