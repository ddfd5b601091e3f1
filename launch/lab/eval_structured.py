"""Structured outputs against a running OpenAI-compatible server: random JSON schemas, every
answer parsed and validated.

  python -m launch.lab.eval_structured --url http://127.0.0.1:8000/v1 --model smollm2-135m
  python -m launch.lab.eval_structured --url ... --whitespace flexible --n 50 --json

Sends ``--n`` chat requests, each with a random schema (``random_schema``: objects of 1-4
properties drawn from strings with a length cap, bounded integers, booleans, enums, arrays of
enums and nested objects: ``launch.lab.structured_schemas``; seeded by ``--seed``) as vLLM's ``structured_outputs.json`` with
``disable_any_whitespace`` from ``--whitespace`` (``default``: the field left out, the server's
choice), ``--concurrency`` at a time, and validates every answer with ``jsonschema``. ``--json``
prints one object: {"url", "model", "n", "whitespace", "valid", "invalid", "finish_reasons",
"completion_tokens", "seconds", "failures": [first five]}. Works against vLLM too.
``--noshow_schema`` keeps the prompt short (a small model's context).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import time
from typing import Any

from absl import flags

from launch import cli
from launch.cli import CliError
from launch.lab.structured_schemas import random_schema, request_body

_URL = flags.DEFINE_string("url", "http://127.0.0.1:8000/v1", "the server's OpenAI base URL")
_MODEL = flags.DEFINE_string("model", "smollm2-135m", "the served model id")
_KEY = flags.DEFINE_string("api_key", "EMPTY", "Bearer key")
_N = flags.DEFINE_integer("n", 50, "schemas (one request each)", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "schema seed")
_CONC = flags.DEFINE_integer("concurrency", 4, "requests in flight", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 256, "per answer", lower_bound=1)
_WS = flags.DEFINE_enum("whitespace", "default", ["default", "compact", "flexible"],
                        "JSON whitespace: the server's default, or disable_any_whitespace")
_SHOW = flags.DEFINE_bool("show_schema", True, "put the schema in the prompt (off: a short "
                          "prompt, for small contexts)")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object")

def run() -> dict[str, Any]:
  import logging
  import jsonschema
  import openai
  logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
  client = openai.OpenAI(base_url=_URL.value, api_key=_KEY.value, max_retries=0, timeout=600)
  rng = random.Random(_SEED.value)
  schemas = [random_schema(rng) for _ in range(_N.value)]

  def one(schema: dict[str, Any]) -> tuple[str, str, int, str]:
    body = request_body(schema, _MODEL.value, _MAX_TOKENS.value, _WS.value, _SHOW.value)
    r = client.chat.completions.create(**{k: v for k, v in body.items()
                                          if k != "structured_outputs"},
                                       extra_body={"structured_outputs":
                                                   body["structured_outputs"]})
    text = r.choices[0].message.content or ""
    try:
      jsonschema.validate(json.loads(text), schema)
      problem = ""
    except (ValueError, jsonschema.ValidationError) as e:
      problem = str(e).splitlines()[0][:200]
    return problem, r.choices[0].finish_reason, r.usage.completion_tokens, text[:200]

  t0 = time.monotonic()
  with cf.ThreadPoolExecutor(_CONC.value) as pool:
    results = list(pool.map(one, schemas))
  finishes: dict[str, int] = {}
  for _, f, _, _ in results:
    finishes[f] = finishes.get(f, 0) + 1
  bad = [{"schema": s, "problem": p, "text": t} for s, (p, _, _, t) in zip(schemas, results) if p]
  return {"url": _URL.value, "model": _MODEL.value, "n": len(schemas), "whitespace": _WS.value,
          "valid": len(schemas) - len(bad), "invalid": len(bad), "finish_reasons": finishes,
          "completion_tokens": sum(r[2] for r in results),
          "seconds": round(time.monotonic() - t0, 2), "failures": bad[:5]}


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  out = run()
  if _JSON.value:
    print(json.dumps(out))
    return
  print(f"{out['valid']} of {out['n']} answers valid ({out['whitespace']} whitespace), "
        f"finish reasons {out['finish_reasons']}, {out['completion_tokens']} tokens in "
        f"{out['seconds']} s")
  for f in out["failures"]:
    print(f"  {f['problem']}: {f['text']!r}")


if __name__ == "__main__":
  cli.run(main)
