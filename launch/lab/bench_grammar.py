"""What structured outputs cost the host per decode step: serving.grammar on SmolLM2's tokenizer.

  .venv/bin/python -m launch.lab.bench_grammar [--rows 8] [--steps 60] [--json]

Measures the ``GrammarCompiler`` start (tokenizer -> llguidance vocabulary), cold compiles of
``launch.lab.grammar_libs.SCHEMAS``, a cache hit and a new matcher; then ``--rows`` matchers at
different points of a valid instance's tokens (mid-generation: inside keys, strings, numbers,
between items), and for ``--steps`` steps times, at the same state: filling the rows one by one
(``Matcher.fill``), in one ``GrammarCompiler.fill_rows`` call (llguidance's thread pool), and
accepting one token per row. A row that reaches its instance's end starts over on a fresh
matcher. Two batches: every row on the ``order`` schema, and rows on mixed grammars. Also the
jitted ``serving.token_mask.apply_bitmask`` on [rows, V] float32 logits. ``--json`` prints one
JSON object with every figure (milliseconds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from launch import machine
from launch.lab.grammar_libs import INSTANCES, SCHEMAS
from models.io.gguf_import import installed_smollm2_path
from models.text.gguf_tokenizer import load_gguf_tokenizer
from serving.grammar import GrammarCompiler, Matcher
from serving.grammar_spec import Grammar, grammar_from_request
from serving.token_mask import apply_bitmask


def _ms(seconds: list[float]) -> dict[str, float]:
  return {"median": 1e3 * statistics.median(seconds),
          "p90": 1e3 * float(np.percentile(seconds, 90)), "max": 1e3 * max(seconds)}


def _batch(c: GrammarCompiler, rows: list[tuple[Grammar, list[int]]], steps: int) -> dict:
  """Times fill (per row and fill_rows) and accept over ``steps`` steps of ``rows``."""
  R = len(rows)
  mask_RW = np.zeros((R, c.words), np.int32)
  matchers: list[Matcher] = []
  pos = []
  for r, (spec, ids) in enumerate(rows):
    m = c.matcher(spec)
    start = (r * len(ids)) // (R + 1)  # spread over the instance: mid-generation states
    for t in ids[:start]:
      assert m.accept(t)
    matchers.append(m)
    pos.append(start)
  one_by_one, together, accepts, per_row = [], [], [], []
  for _ in range(steps):
    t0 = time.perf_counter()
    for r, m in enumerate(matchers):
      t1 = time.perf_counter()
      m.fill(mask_RW[r])
      per_row.append(time.perf_counter() - t1)
    one_by_one.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    c.fill_rows(mask_RW, list(enumerate(matchers)))
    together.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for r, m in enumerate(matchers):
      assert m.accept(rows[r][1][pos[r]])
    accepts.append(time.perf_counter() - t0)
    for r in range(R):
      pos[r] += 1
      if pos[r] == len(rows[r][1]):
        matchers[r], pos[r] = c.matcher(rows[r][0]), 0
  return {"rows": R, "steps": steps, "fill_one_row_ms": _ms(per_row),
          "fill_rows_one_by_one_ms": _ms(one_by_one), "fill_rows_parallel_ms": _ms(together),
          "accept_rows_ms": _ms(accepts)}


def run(rows: int, steps: int) -> dict:
  t0 = time.perf_counter()
  tok = load_gguf_tokenizer(installed_smollm2_path())
  tokenizer_s = time.perf_counter() - t0
  c = GrammarCompiler(tok)
  specs = {name: grammar_from_request({"guided_json": s}) for name, s in SCHEMAS.items()}
  compile_ms = {}
  for name, spec in specs.items():
    t0 = time.perf_counter()
    c.compile(spec)
    compile_ms[name] = 1e3 * (time.perf_counter() - t0)
  t0 = time.perf_counter()
  c.compile(specs["order"])
  hit_ms = 1e3 * (time.perf_counter() - t0)
  t0 = time.perf_counter()
  c.matcher(specs["order"])
  matcher_ms = 1e3 * (time.perf_counter() - t0)
  ids = {n: tok.encode(json.dumps(INSTANCES[n], separators=(",", ":"))) for n in SCHEMAS}
  same = [(specs["order"], ids["order"])] * rows
  extra = [(grammar_from_request({"response_format": {"type": "json_object"}}),
            tok.encode(json.dumps(INSTANCES["order"], separators=(",", ":")))),
           (grammar_from_request({"guided_regex": r"[a-z]+( [a-z]+)*\."}),
            tok.encode("the quick brown fox jumps over the lazy dog and runs far away."))]
  pool = [(specs[n], ids[n]) for n in SCHEMAS] + extra
  mixed = [pool[r % len(pool)] for r in range(rows)]
  apply = jax.jit(apply_bitmask)
  logits = jnp.zeros((rows, c.vocab_size), jnp.float32)
  mask = jnp.asarray(np.random.default_rng(0).integers(-2 ** 31, 2 ** 31, (rows, c.words),
                                                       dtype=np.int64).astype(np.int32))
  on = jnp.ones((rows,), bool)
  apply(logits, mask, on).block_until_ready()
  apply_s = []
  for _ in range(50):
    t0 = time.perf_counter()
    apply(logits, mask, on).block_until_ready()
    apply_s.append(time.perf_counter() - t0)
  return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
          "cpu": machine.cpu_model(), "vocab": c.vocab_size, "tokenizer_load_s": tokenizer_s,
          "compiler_init_s": c.init_s, "compile_ms": compile_ms, "cache_hit_ms": hit_ms,
          "new_matcher_ms": matcher_ms, "same_schema": _batch(c, same, steps),
          "mixed": _batch(c, mixed, steps), "apply_bitmask_jit_ms": _ms(apply_s)}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args()
  r = run(args.rows, args.steps)
  if args.json:
    print(json.dumps(r))
    return
  print(f"{r['cpu']}, V={r['vocab']}: tokenizer {r['tokenizer_load_s']:.2f} s, compiler init "
        f"{r['compiler_init_s']:.2f} s; compile ms {r['compile_ms']}; cache hit "
        f"{r['cache_hit_ms']:.3f} ms; new matcher {r['new_matcher_ms']:.3f} ms")
  for key in ("same_schema", "mixed"):
    b = r[key]
    print(f"{key} ({b['rows']} rows, {b['steps']} steps): " + "; ".join(
        f"{k} median {v['median']:.3f} p90 {v['p90']:.3f} max {v['max']:.3f}"
        for k, v in b.items() if isinstance(v, dict)))
  a = r["apply_bitmask_jit_ms"]
  print(f"apply_bitmask [{args.rows}, {r['vocab']}] jit: median {a['median']:.3f} ms, "
        f"p90 {a['p90']:.3f}")


if __name__ == "__main__":
  main()
