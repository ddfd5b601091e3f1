"""Random JSON schemas for structured-output checks, and the request that asks for one (no flags:
importable by tests beside other command-line modules).

Contract: ``random_schema(rng)``: an object schema of 1-4 required properties and no others (a
finite language), drawn from strings with a length cap, bounded integers, booleans, enums,
arrays of enums and nested objects (two levels at most). ``request_body(schema, model,
max_tokens, whitespace, show_schema)``: a greedy chat request constraining its answer to the
schema through vLLM's ``structured_outputs`` (``whitespace``: ``default`` leaves
``disable_any_whitespace`` out, ``compact`` / ``flexible`` set it).
"""

from __future__ import annotations

import json
import random
from typing import Any

_WORDS = ["name", "city", "age", "color", "size", "tags", "score", "ok", "kind", "item", "note",
          "level", "owner", "count", "label"]


def _leaf(rng: random.Random, depth: int) -> dict[str, Any]:
  kind = rng.choice(["string", "integer", "boolean", "enum", "array"] +
                    (["object"] if depth < 2 else []))
  if kind == "string":
    return {"type": "string", "maxLength": rng.choice([8, 16, 24])}
  if kind == "integer":
    lo = rng.randint(-50, 50)
    return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
  if kind == "boolean":
    return {"type": "boolean"}
  if kind == "enum":
    return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no"],
                               rng.randint(2, 4))}
  if kind == "array":
    return {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
            "maxItems": rng.randint(1, 4)}
  return random_schema(rng, depth + 1)


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
  """An object schema of 1-4 properties, all required, no others (a finite language)."""
  names = rng.sample(_WORDS, rng.randint(1, 4))
  return {"type": "object", "properties": {n: _leaf(rng, depth) for n in names},
          "required": names, "additionalProperties": False}


def request_body(schema: dict[str, Any], model: str, max_tokens: int,
                 whitespace: str = "default", show_schema: bool = True) -> dict[str, Any]:
  so: dict[str, Any] = {"json": schema}
  if whitespace != "default":
    so["disable_any_whitespace"] = whitespace == "compact"
  ask = "Reply with one JSON object" + (f" that fits this schema: {json.dumps(schema)}"
                                        if show_schema else ".")
  return {"model": model, "max_tokens": max_tokens, "temperature": 0, "structured_outputs": so,
          "messages": [{"role": "user", "content": ask}]}
