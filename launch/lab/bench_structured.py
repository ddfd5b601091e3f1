"""What structured outputs cost a decode step: the engine with every row constrained vs none.

  python -m launch.lab.bench_structured --model smollm2-135m --rows 8 --json

Runs ``--rows`` requests of ``--tokens`` generated ids each (short prompts, ``ignore_eos``)
through the engine and scheduler (``serving.stack``'s engine, the server's CPU backend and
dtype), unconstrained and with every row under a grammar that never ends (a JSON array of
objects, ``--grammar``), alternately, ``--rounds`` times each; the time of a run over its steps is
the step time. Prints one JSON object: each round's ms per step for both, the median overhead
(constrained / plain - 1), the host time spent filling masks per step, the date and the machine.
"""

from __future__ import annotations

import json
import time

from absl import flags

from launch import cli
from launch import machine
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "a trained model, preset or checkpoint")
_ROWS = flags.DEFINE_integer("rows", 8, "requests decoding together", lower_bound=1)
_TOKENS = flags.DEFINE_integer("tokens", 64, "ids generated per request", lower_bound=2)
_ROUNDS = flags.DEFINE_integer("rounds", 3, "runs of each, alternating", lower_bound=1)
_GRAMMAR = flags.DEFINE_string("grammar", r'\[(\{"id":[0-9]{1,4},"ok":(true|false)\},)*',
                               "a regex that never completes (every step masked)")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object")


def run() -> dict:
  import jax.numpy as jnp
  import numpy as np
  from launch.defaults import choose_dtype
  from models.cpu import cpuinfo
  from models.io.loader import load_model
  from models.step import UnshardedStep
  from models.cpu import backend as cpu_backend
  from serving.engine import Engine, EngineConfig
  from serving.grammar import GrammarCompiler
  from serving.grammar_spec import Grammar
  from serving.kv_pages import PageBudget, PagePool
  from serving.lifecycle import RequestTrace
  from serving.request import Request
  from serving.sampling import SamplingParams
  from serving.drive import run_to_completion
  from serving.scheduler import Scheduler
  from serving.stop import StopCriteria

  dtype = str(choose_dtype("cpu", cpuinfo.flags()).value)
  cfg, params, tok = load_model(_MODEL.value, jnp.dtype(dtype))
  rows, n = _ROWS.value, _TOKENS.value
  page = 16
  pages = rows * (-(-(n + 32) // page)) + 8
  engine = Engine(UnshardedStep(cfg, backend=cpu_backend.resolve().backend), params, EngineConfig(
      max_slots=rows, num_pages=pages, page_size=page, max_seq_tokens=cfg.max_seq_len, lag=1,
      valid_vocab=tok.vocab_size))
  compiled = GrammarCompiler(tok).compile(Grammar("regex", _GRAMMAR.value))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(100, 1000, 16).tolist() for _ in range(rows)]

  def one(constrained: bool, tag: str) -> tuple[float, int, float]:
    pool = PagePool(PageBudget(page, pages), max_seq_tokens=cfg.max_seq_len)
    sched = Scheduler(pool, tok, max_slots=rows, max_step_tokens=16 * rows + rows,
                      max_chunk=16 * rows)
    for i, p in enumerate(prompts):
      req = Request(f"{tag}{i}", tuple(p), SamplingParams(
          temperature=1.0, seed=i, grammar=compiled if constrained else None),
          StopCriteria(max_tokens=n, ignore_eos=True))
      assert sched.add(req, RequestTrace(req.request_id)) is None
    steps = [0]

    def execute(plan):
      steps[0] += 1
      return engine.execute(plan)
    fill0 = engine.grammar.mask_seconds
    t0 = time.perf_counter()
    run_to_completion(sched, execute)
    for res in engine.flush():
      sched.update(res)
    return time.perf_counter() - t0, steps[0], engine.grammar.mask_seconds - fill0

  one(False, "w0")  # compiles and warms both
  one(True, "w1")
  plain, masked, fills = [], [], []
  for r in range(_ROUNDS.value):
    s, k, _ = one(False, f"p{r}-")
    plain.append(1e3 * s / k)
    s, k, f = one(True, f"c{r}-")
    masked.append(1e3 * s / k)
    fills.append(1e3 * f / k)
  ratios = [m / p - 1 for p, m in zip(plain, masked)]
  return {"model": _MODEL.value, "dtype": dtype, "rows": rows, "tokens": n,
          "grammar": _GRAMMAR.value, "plain_ms_per_step": [round(x, 2) for x in plain],
          "constrained_ms_per_step": [round(x, 2) for x in masked],
          "overhead_median": round(float(np.median(ratios)), 4),
          "mask_fill_ms_per_step": [round(x, 3) for x in fills],
          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
          "machine": machine.describe()}


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  out = run()
  if _JSON.value:
    print(json.dumps(out))
    return
  print(f"{out['rows']} rows: plain {out['plain_ms_per_step']} ms/step, constrained "
        f"{out['constrained_ms_per_step']} ms/step, overhead {100 * out['overhead_median']:.1f}%"
        f" (mask fill {out['mask_fill_ms_per_step']} ms/step)")


if __name__ == "__main__":
  cli.run(main)
