"""Speculative decoding against plain decoding on input-grounded tasks, in one run.

  python -m launch.lab.bench_spec --model smollm2-135m --json
  python -m launch.lab.bench_spec --model tiny --batches 1 --max_tokens 16 --rounds 1

The benchmark writes its own tasks (``TASKS``, ``--tasks``): correct the spelling of a paragraph
(``spelling``), rename a variable in a function (``rename``), turn a list into a table
(``table``), summarize a paragraph (``summary``), each a chat prompt whose answer copies some of
its input (what n-gram prompt lookup, ``--prompt_lookup_min`` / ``_max``, is for); a prompt
longer than the model's context less ``--max_tokens`` keeps its tail. Each batch size of
``--batches`` runs that many requests at once (``max_slots``; at least one request per task,
tasks cycled, greedy, EOS honoured, ``--max_tokens``) through the serving stack
(``serving.stack.build``: the server's scheduler, engine and defaults but ``--max_slots``), once
without speculation and once with ``--num_speculative_tokens`` draft ids a row
(``--speculative_max_rows``: 0, the default, speculates at every batch; -1 takes the server's
default, its measured off-switch), interleaved for ``--rounds`` rounds; generated tok/s is the
median over rounds. ``--draft_model`` (``--draft_quantize``) proposes with a draft model instead
of n-gram lookup (``serving.draft_model``). Per batch: ``plain_tok_s``, ``spec_tok_s``,
``speedup``, ``same_ids`` (every
request got identical ids with and without speculation), and the acceptance: ``drafts``,
``draft_tokens``, ``accepted_tokens``, ``acceptance`` (accepted / proposed),
``accepted_per_pos`` and ``tokens_per_step`` (ids a verified row advanced per step).
``--json`` prints one object {"model", "dtype", "machine", "date", "k", "batches": {...}}.
Bad flags exit 2.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import statistics
import time

from absl import flags

from launch import cli
from launch import machine
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "model (preset, smollm2-135m, .gguf, ...)")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "param dtype")
_K = flags.DEFINE_integer("num_speculative_tokens", 4, "draft ids per row", lower_bound=1,
                          upper_bound=16)
_BATCHES = flags.DEFINE_list("batches", ["1", "32"], "requests at once")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "tokens per request", lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 2, "interleaved rounds", lower_bound=1)
_LOOKUP_MIN = flags.DEFINE_integer("prompt_lookup_min", 2, "n-gram proposer: shortest suffix",
                                   lower_bound=1)
_LOOKUP_MAX = flags.DEFINE_integer("prompt_lookup_max", 4, "n-gram proposer: longest suffix",
                                   lower_bound=1)
_MAX_ROWS = flags.DEFINE_integer("speculative_max_rows", 0, "speculate while at most this many "
                                 "sequences decode (0: at every batch; -1: the server's default)",
                                 lower_bound=-1)
_DRAFT = flags.DEFINE_string("draft_model", None, "a draft model proposes instead of n-gram "
                             "lookup (a model name; the target's tokenizer)")
_DRAFT_QUANTIZE = flags.DEFINE_enum("draft_quantize", "none", ["none", "int8"],
                                    "the draft model's weights")
_TASKS = flags.DEFINE_list("tasks", ["spelling", "rename", "table", "summary"], "tasks to run")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object")

_TEXT = ("The comittee met on tuesday to discus the new budjet. After a long debate, they agred "
         "to increase funding for the libary and to repair the roof of the old school buiding "
         "before winter. The mayor thanked everyone for there hard work and promised to publish "
         "the minutes by friday.")
_CODE = ("def mean(values):\n    total = 0\n    count = 0\n    for v in values:\n"
         "        total = total + v\n        count = count + 1\n    if count == 0:\n"
         "        return 0.0\n    return total / count\n")
_LIST = ("apples - 3 - red\nbananas - 12 - yellow\ncherries - 40 - dark red\n"
         "grapes - 25 - green\nlemons - 6 - yellow\n")
TASKS = {
    "spelling": "Rewrite the following text with the spelling mistakes corrected. Reply with the "
                "corrected text only.\n\n" + _TEXT,
    "rename": "In this Python function, rename the variable `total` to `acc`. Reply with the "
              "whole function only.\n\n" + _CODE,
    "table": "Turn this list (fruit - count - colour) into a Markdown table with the columns "
             "Fruit, Count and Colour.\n\n" + _LIST,
    "summary": "Summarize the following text in two sentences, keeping its names.\n\n" + _TEXT,
}


def _serve(loop, reqs) -> tuple[dict[str, list[int]], float]:
  from serving.lifecycle import RequestTrace
  from serving.drive import run_to_completion
  sched, engine = loop.scheduler, loop.engine
  for r in reqs:
    assert sched.add(r, RequestTrace(r.request_id)) is None
  t0 = time.perf_counter()
  outs = run_to_completion(sched, engine.execute, flush=engine.flush)
  for res in engine.flush():
    outs += sched.update(res)
  seconds = time.perf_counter() - t0
  got: dict[str, list[int]] = {}
  for o in outs:
    got.setdefault(o.request_id, []).extend(o.token_ids)
  return got, seconds


def _programs(loop) -> int:
  """Programs the loop's engines dispatched so far (a draft model's engine too)."""
  from serving.draft_model import DraftModelProposer
  p = loop.scheduler.proposer
  return loop.engine.programs + (p.engine.programs if isinstance(p, DraftModelProposer) else 0)


def run() -> dict[str, object]:
  import jax.numpy as jnp
  from models.cpu import backend as cpu_backend
  from models.io.loader import load_model
  from models.step import UnshardedStep
  from serving import stack
  from serving.draft_model import DraftModel, check_tokenizers
  from serving.request import Request
  from serving.sampling import SamplingParams
  from serving.stop import StopCriteria
  try:
    batches = sorted({int(b) for b in _BATCHES.value})
  except ValueError:
    raise CliError(f"--batches: integers, got {_BATCHES.value}") from None
  if min(batches) < 1:
    raise CliError("--batches must be >= 1")
  try:
    cfg, params, tok = load_model(_MODEL.value, jnp.dtype(_DTYPE.value))
  except (ValueError, FileNotFoundError) as e:
    raise CliError(str(e))
  backend = cpu_backend.resolve().backend
  step = UnshardedStep(cfg, backend=backend)
  draft = None
  if _DRAFT.value:
    try:
      q = _DRAFT_QUANTIZE.value
      dcfg, dparams, dtok = load_model(_DRAFT.value, jnp.dtype(_DTYPE.value),
                                       quantize=q)  # type: ignore[arg-type]  # an enum flag
      check_tokenizers(tok, dtok)
    except (ValueError, FileNotFoundError) as e:
      raise CliError(f"--draft_model: {e}")
    draft = DraftModel(UnshardedStep(dcfg, backend=backend), dparams, _DRAFT.value)
  unknown = sorted(set(_TASKS.value) - set(TASKS))
  if unknown or not _TASKS.value:
    raise CliError(f"--tasks: unknown {unknown}; known: {', '.join(TASKS)}")
  prompts = [tok.encode_chat([{"role": "user", "content": TASKS[t]}]) for t in _TASKS.value]
  if _MAX_TOKENS.value >= cfg.max_seq_len:
    raise CliError(f"--max_tokens {_MAX_TOKENS.value}: the model's context is {cfg.max_seq_len}")
  room = cfg.max_seq_len - _MAX_TOKENS.value  # a small model's context: each prompt's tail
  prompts = [p[-room:] for p in prompts]
  context = min(cfg.max_seq_len, max(map(len, prompts)) + _MAX_TOKENS.value + 64)
  out: dict[str, object] = {}
  for b in batches:
    n = max(b, len(prompts))  # every task at least once; at most b at a time
    reqs = lambda tag: [Request(f"{tag}{i}", tuple(prompts[i % len(prompts)]), SamplingParams(),
                                StopCriteria(max_tokens=_MAX_TOKENS.value)) for i in range(n)]
    base = stack.ServingConfig(max_slots=b, max_context=context, max_waiting=100_000,
                               kv_pages=max(64, b * (-(-context // 64) + 1)))
    loops = {"plain": stack.build(step, params, tok, base),
             "spec": stack.build(step, params, tok, dataclasses.replace(
                 base, spec_tokens=_K.value,
                 spec_max_rows={0: b, -1: 0}.get(_MAX_ROWS.value, _MAX_ROWS.value),
                 prompt_lookup_min=_LOOKUP_MIN.value, prompt_lookup_max=_LOOKUP_MAX.value),
                 draft=draft)}
    sealed = {}
    for name, loop in loops.items():
      stack.warmup(loop)
      loop.engine.seal()
      sealed[name] = _programs(loop)
    rates: dict[str, list[float]] = {"plain": [], "spec": []}
    ids: dict[str, dict[str, list[int]]] = {}
    for r in range(_ROUNDS.value):
      for name, loop in loops.items():
        got, seconds = _serve(loop, reqs(f"{name}{r}-"))
        rates[name].append(sum(map(len, got.values())) / seconds)
        ids[name] = {k.split("-", 1)[1]: v for k, v in got.items()}
    c = loops["spec"].scheduler.spec
    verified = c.drafts or 1
    out[str(b)] = {
        "plain_tok_s": round(statistics.median(rates["plain"]), 1),
        "spec_tok_s": round(statistics.median(rates["spec"]), 1),
        "speedup": round(statistics.median(rates["spec"]) / statistics.median(rates["plain"]), 3),
        "same_ids": ids["plain"] == ids["spec"], "drafts": c.drafts,
        "draft_tokens": c.draft_tokens, "accepted_tokens": c.accepted_tokens,
        "acceptance": round(c.accepted_tokens / max(1, c.draft_tokens), 3),
        "accepted_per_pos": list(c.accepted_per_pos),
        "tokens_per_step": round(1 + c.accepted_tokens / verified, 3),
        "programs_after_ready": sum(_programs(lp) - sealed[n] for n, lp in loops.items())}
  return {"model": _MODEL.value, "dtype": _DTYPE.value, "k": _K.value, "tasks": _TASKS.value,
          "proposer": f"draft_model {_DRAFT.value} ({_DRAFT_QUANTIZE.value})" if draft
          else "ngram",
          "prompt_lookup": [_LOOKUP_MIN.value, _LOOKUP_MAX.value],
          "max_tokens": _MAX_TOKENS.value, "machine": machine.describe(),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "batches": out}


def main(argv: list[str]) -> None:
  cli.start(argv)
  result = run()
  print(json.dumps(result) if _JSON.value else json.dumps(result, indent=1))


if __name__ == "__main__":
  cli.run(main)
