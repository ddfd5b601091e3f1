"""Structured-output constraints as the API states them -> one ``Grammar`` spec.

Contract:
  * ``Grammar`` (frozen, hashable: the compile cache's key): ``kind`` is ``json_object``,
    ``json_schema`` (``source`` is the schema as compact JSON, key order kept: properties are
    generated in the schema's order), ``regex`` (Rust ``regex`` syntax: no look-around, no
    back-references), ``choice`` (``source`` is a JSON list of the strings) or ``grammar`` (Lark,
    or llama.cpp GBNF, which is converted to Lark); ``any_whitespace`` (JSON kinds: whitespace
    between tokens may be any run, vLLM's default; False, phaseserve's default: compact ``,`` /
    ``:``, since a small model given free whitespace runs on in newlines: BUILD_NOTES;
    ``structured_outputs.disable_any_whitespace: false`` or a ``whitespace_pattern`` asks),
    ``lenient`` (json_schema: keywords the compiler does not implement are ignored rather than
    errors; set by ``response_format`` with ``strict`` false or absent). ``field`` names the API
    field the spec came from; it is left out of equality.
  * ``grammar_from_request(fields)`` reads the request's ``response_format`` (OpenAI: ``text``,
    ``json_object``, ``json_schema`` with ``json_schema.{name, schema, strict}``), vLLM's
    ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (with
    ``guided_whitespace_pattern``) and ``structured_outputs`` (``json``, ``regex``, ``choice``,
    ``grammar``, ``json_object``, ``disable_any_whitespace``, ``whitespace_pattern``); None when
    no constraint is set. A malformed value, or more than one constraint, is a
    ``GrammarSpecError`` (a ``ValueError``) whose ``field`` names the offending field: the API
    answers 400. Whether a well-formed schema / regex / grammar compiles is checked by
    ``serving.grammar.GrammarCompiler.compile`` (the same error type).
  * Not supported (a ``GrammarSpecError``): ``structural_tag`` (response_format or
    structured_outputs) and ``disable_additional_properties``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal, Mapping

GrammarKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
KINDS: tuple[GrammarKind, ...] = ("json_object", "json_schema", "regex", "choice", "grammar")
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
MAX_SOURCE_CHARS = 256 * 1024  # a schema / grammar / regex longer than this is refused
MAX_CHOICES = 4096


class GrammarSpecError(ValueError):
  """A structured-output field that cannot be served; ``field`` names it (e.g.
  ``response_format.json_schema.schema``)."""

  def __init__(self, field: str, message: str):
    super().__init__(f"{field}: {message}")
    self.field = field


@dataclasses.dataclass(frozen=True)
class Grammar:
  """One structured-output constraint; see the module contract."""

  kind: GrammarKind
  source: str = ""
  any_whitespace: bool = False  # compact JSON unless asked (BUILD_NOTES: why)
  whitespace_pattern: str | None = None
  lenient: bool = False
  field: str = dataclasses.field(default="", compare=False)

  def __post_init__(self) -> None:
    if self.kind not in KINDS:
      raise GrammarSpecError(self.field or "grammar", f"unknown kind {self.kind!r}")
    if len(self.source) > MAX_SOURCE_CHARS:
      raise GrammarSpecError(self.field, f"{len(self.source)} characters is longer than the "
                             f"{MAX_SOURCE_CHARS} served")


def _json_schema(field: str, value: object, *, any_whitespace: bool = False,
                 whitespace_pattern: str | None = None, lenient: bool = False) -> Grammar:
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except json.JSONDecodeError as e:
      raise GrammarSpecError(field, f"not valid JSON: {e}") from None
  if not isinstance(value, dict):
    raise GrammarSpecError(field, f"a JSON schema must be a JSON object, not "
                           f"{type(value).__name__}")
  try:
    source = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
  except (TypeError, ValueError) as e:
    raise GrammarSpecError(field, f"not serializable as JSON: {e}") from None
  return Grammar("json_schema", source, any_whitespace, whitespace_pattern, lenient, field)


def _text(field: str, kind: GrammarKind, value: object) -> Grammar:
  if not isinstance(value, str) or not value:
    raise GrammarSpecError(field, f"must be a non-empty string, not {value!r:.80}")
  return Grammar(kind, value, field=field)


def _choice(field: str, value: object) -> Grammar:
  if (not isinstance(value, list) or not value
      or not all(isinstance(c, str) and c for c in value)):
    raise GrammarSpecError(field, "must be a non-empty list of non-empty strings")
  if len(value) > MAX_CHOICES:
    raise GrammarSpecError(field, f"{len(value)} choices; at most {MAX_CHOICES} are served")
  return Grammar("choice", json.dumps(value, ensure_ascii=False), field=field)


def _whitespace(field: str, value: object) -> str | None:
  if value is None or isinstance(value, str):
    return value
  raise GrammarSpecError(field, "must be a string (a regex) or null")


def from_response_format(value: object) -> Grammar | None:
  """OpenAI's ``response_format``; None for ``{"type": "text"}``."""
  field = "response_format"
  if not isinstance(value, dict):
    raise GrammarSpecError(field, "must be an object with a 'type'")
  kind = value.get("type")
  if kind == "text":
    return None
  if kind == "json_object":
    return Grammar("json_object", field=field)
  if kind != "json_schema":
    raise GrammarSpecError(f"{field}.type", f"{kind!r} is not one of 'text', 'json_object', "
                           "'json_schema'")
  spec = value.get("json_schema")
  if not isinstance(spec, dict):
    raise GrammarSpecError(f"{field}.json_schema", "must be an object with 'name' and 'schema'")
  name = spec.get("name")
  if name is not None and not isinstance(name, str):
    raise GrammarSpecError(f"{field}.json_schema.name", "must be a string")
  strict = spec.get("strict")
  if strict is not None and not isinstance(strict, bool):
    raise GrammarSpecError(f"{field}.json_schema.strict", "must be a boolean")
  schema = spec.get("schema")
  if schema is None:  # OpenAI's schema is optional: any JSON object
    return Grammar("json_object", field=f"{field}.json_schema")
  return _json_schema(f"{field}.json_schema.schema", schema, lenient=not strict)


def from_structured_outputs(value: object) -> Grammar:
  """vLLM's ``structured_outputs`` object: exactly one constraint plus whitespace options."""
  field = "structured_outputs"
  if not isinstance(value, dict):
    raise GrammarSpecError(field, "must be an object")
  if value.get("disable_additional_properties"):
    raise GrammarSpecError(f"{field}.disable_additional_properties", "is not supported")
  if value.get("structural_tag") is not None:
    raise GrammarSpecError(f"{field}.structural_tag", "is not supported")
  disable_ws = value.get("disable_any_whitespace", True)  # compact unless asked
  if not isinstance(disable_ws, bool):
    raise GrammarSpecError(f"{field}.disable_any_whitespace", "must be a boolean")
  ws_pattern = _whitespace(f"{field}.whitespace_pattern", value.get("whitespace_pattern"))
  set_keys = [k for k in ("json", "regex", "choice", "grammar", "json_object")
              if value.get(k) is not None]
  if len(set_keys) != 1:
    raise GrammarSpecError(field, "exactly one of json, regex, choice, grammar, json_object "
                           f"must be set (got {set_keys or 'none'})")
  key = set_keys[0]
  sub = f"{field}.{key}"
  if key == "json":
    return _json_schema(sub, value[key], any_whitespace=not disable_ws,
                        whitespace_pattern=ws_pattern)
  if key == "json_object":
    if value[key] is not True:
      raise GrammarSpecError(sub, "must be true when set")
    return Grammar("json_object", "", not disable_ws, ws_pattern, field=sub)
  if key == "choice":
    return _choice(sub, value[key])
  return _text(sub, "regex" if key == "regex" else "grammar", value[key])


def from_guided(field: str, value: object, whitespace_pattern: object = None) -> Grammar:
  """One of vLLM's ``guided_*`` fields (``GUIDED_FIELDS``)."""
  if field == "guided_json":
    return _json_schema(field, value, whitespace_pattern=_whitespace(
        "guided_whitespace_pattern", whitespace_pattern))
  if field == "guided_regex":
    return _text(field, "regex", value)
  if field == "guided_choice":
    return _choice(field, value)
  if field == "guided_grammar":
    return _text(field, "grammar", value)
  raise GrammarSpecError(field, f"is not one of {', '.join(GUIDED_FIELDS)}")


def grammar_from_request(fields: Mapping[str, object]) -> Grammar | None:
  """The one constraint a request's body sets (None: unconstrained); see the module contract."""
  found: list[Grammar] = []
  names: list[str] = []
  rf = fields.get("response_format")
  if rf is not None:
    g = from_response_format(rf)
    if g is not None:
      found.append(g)
      names.append("response_format")
  for name in GUIDED_FIELDS:
    if fields.get(name) is not None:
      found.append(from_guided(name, fields[name], fields.get("guided_whitespace_pattern")))
      names.append(name)
  if fields.get("structured_outputs") is not None:
    found.append(from_structured_outputs(fields["structured_outputs"]))
    names.append("structured_outputs")
  if len(found) > 1:
    raise GrammarSpecError(names[1], f"only one structured-output constraint per request "
                           f"(got {', '.join(names)})")
  return found[0] if found else None


__all__ = ["GUIDED_FIELDS", "KINDS", "MAX_CHOICES", "MAX_SOURCE_CHARS", "Grammar",
           "GrammarKind", "GrammarSpecError", "from_guided", "from_response_format",
           "from_structured_outputs", "grammar_from_request"]
