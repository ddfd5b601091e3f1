"""serving.grammar / grammar_spec / token_mask: structured outputs on the real SmolLM2 tokenizer.

Random walks: fill the mask, take an allowed token (numpy RNG, seeded; a few uniform steps, then
a bias towards closing quotes / brackets so the text ends within 200 tokens), accept it, stop
when eos is allowed and chosen or the matcher terminates; the decoded text must then parse and
validate (``jsonschema``), fully match the regex, or be one of the choices. Every step also
checks that eos is in the mask exactly when ``is_accepting()``.
"""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from models.io.gguf_import import installed_smollm2_path
from models.text.gguf_tokenizer import load_gguf_tokenizer
from models.text.tokenizer import ByteTokenizer, Tokenizer
from serving.grammar import GrammarCompiler, Matcher
from serving.grammar_spec import Grammar, GrammarSpecError, grammar_from_request
from serving.token_mask import allowed_ids, apply_bitmask, unpack_bitmask, words

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "boolean"},
                                      "c": {"type": "number"}}, "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"enum": [1, 2.5, None, "x", True]}},
     "required": ["v"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer"}},
     "required": ["kind", "x"], "additionalProperties": False},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                             "minItems": 2, "maxItems": 4}},
     "required": ["xs"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                               "maxItems": 2}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["id", "address"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["p"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 120}},
     "required": ["n"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": ["boolean", "null"]}},
     "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
     "required": ["id"], "additionalProperties": False},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 8}},
     "required": ["s"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
     "required": ["v"], "additionalProperties": False},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"},
                                                        "y": {"type": "integer"}},
                      "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "object", "properties": {
        "status": {"enum": ["new", "paid", "shipped"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string"},
                                             "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
     "required": ["status", "items"], "additionalProperties": False},
    {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 5},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
    {"type": "string", "enum": ["alpha", "alphabet", "beta"]},
]
MAX_TOKENS = 200
_CLOSERS = b'"}]'


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
  return load_gguf_tokenizer(installed_smollm2_path())


@pytest.fixture(scope="module")
def compiler(smol) -> GrammarCompiler:
  return GrammarCompiler(smol)


@pytest.fixture(scope="module")
def byte_compiler() -> GrammarCompiler:
  return GrammarCompiler(ByteTokenizer())


_SPELLING: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _spelling(c: GrammarCompiler) -> tuple[np.ndarray, np.ndarray]:
  """Per id: whether its first byte closes a string / object / array, and its byte length."""
  if id(c) not in _SPELLING:
    spelled = [c.tokenizer.token_bytes(t) for t in range(c.vocab_size)]
    _SPELLING[id(c)] = (np.array([b[:1] != b"" and b[0] in _CLOSERS for b in spelled]),
                        np.array([len(b) for b in spelled]))
  return _SPELLING[id(c)]


def _pick(c: GrammarCompiler, allowed: np.ndarray, wander: bool, rng) -> int:
  choices = allowed[~np.isin(allowed, c.eos_ids)]
  assert choices.size, "nothing but eos allowed on a matcher that is not terminated"
  if not wander:
    closes, length = _spelling(c)
    closers, singles = choices[closes[choices]], choices[length[choices] == 1]
    choices = closers if closers.size else singles if singles.size else choices
  return int(rng.choice(choices))


def _walk(c: GrammarCompiler, m: Matcher, seed: int) -> str:
  """A random walk to the end of the grammar; returns the decoded text."""
  rng = np.random.default_rng(seed)
  wander = int(rng.integers(0, 16))
  mask_W = np.zeros(c.words, np.int32)
  ids: list[int] = []
  for step in range(MAX_TOKENS):
    m.fill(mask_W)
    allowed = allowed_ids(mask_W, c.vocab_size)
    eos_allowed = bool(np.isin(c.eos_ids, allowed).any())
    assert eos_allowed == m.is_accepting(), (step, c.tokenizer.decode(ids))
    if m.is_terminated():
      assert set(allowed.tolist()) == set(c.eos_ids)
      break
    if eos_allowed and (step >= wander or rng.random() < 0.2):
      assert m.accept(c.eos_ids[0]) and m.is_terminated()
      break
    t = _pick(c, allowed, step < wander, rng)
    assert m.accept(t), (t, m.error())
    ids.append(t)
  else:
    pytest.fail(f"no end within {MAX_TOKENS} tokens: {c.tokenizer.decode(ids)!r}")
  return c.tokenizer.decode(ids)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_random_walks_validate_against_the_schema(compiler, i):
  schema = SCHEMAS[i]
  spec = grammar_from_request({"guided_json": schema})
  for seed in range(3):
    text = _walk(compiler, compiler.matcher(spec), 100 * i + seed)
    jsonschema.validate(json.loads(text), schema)


def test_compact_whitespace_and_response_format(compiler):
  schema = SCHEMAS[0]
  spec = grammar_from_request({"structured_outputs": {"json": schema,
                                                      "disable_any_whitespace": True}})
  for seed in range(3):
    text = _walk(compiler, compiler.matcher(spec), seed)
    assert json.loads(text) is not None and " " not in text.replace(json.loads(text)["name"], "")
  rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}
  spec = grammar_from_request({"response_format": rf})
  assert spec.kind == "json_schema" and not spec.lenient
  jsonschema.validate(json.loads(_walk(compiler, compiler.matcher(spec), 7)), schema)


def test_json_object(compiler):
  spec = grammar_from_request({"response_format": {"type": "json_object"}})
  for seed in range(5):
    assert isinstance(json.loads(_walk(compiler, compiler.matcher(spec), seed)), dict)


@pytest.mark.parametrize("pattern", [r"[a-z]{2,6}@example\.(com|org)", r"(yes|no|maybe)!?",
                                     r"-?[0-9]{1,4}(\.[0-9]{2})?", r"[A-Z][a-z]+( [A-Z][a-z]+)*"])
def test_regex_walks_fully_match(compiler, pattern):
  spec = grammar_from_request({"guided_regex": pattern})
  for seed in range(4):
    text = _walk(compiler, compiler.matcher(spec), seed)
    assert re.fullmatch(pattern, text), text


def test_choice_walks_are_a_choice(compiler):
  choices = ["yes", "yes please", "no", 'a "quoted" one', "ünïcödé"]
  spec = grammar_from_request({"structured_outputs": {"choice": choices}})
  seen = {_walk(compiler, compiler.matcher(spec), seed) for seed in range(30)}
  assert seen <= set(choices) and len(seen) >= 3


@pytest.mark.parametrize("source,check", [
    ('start: "(" num ("," num)* ")"\nnum: /[0-9]+/', r"\([0-9]+(,[0-9]+)*\)"),
    ('root ::= "<" [a-c]+ ">"', r"<[a-c]+>"),  # GBNF
])
def test_grammar_walks(compiler, source, check):
  spec = grammar_from_request({"guided_grammar": source})
  for seed in range(4):
    assert re.fullmatch(check, _walk(compiler, compiler.matcher(spec), seed))


@pytest.mark.parametrize("body", [
    {"guided_json": SCHEMAS[15]}, {"response_format": {"type": "json_object"}},
    {"guided_regex": r"[a-z]+@[a-z]+\.com"}, {"guided_choice": ["on", "off"]}])
def test_byte_tokenizer_walks(byte_compiler, body):
  spec = grammar_from_request(body)
  for seed in range(3):
    text = _walk(byte_compiler, byte_compiler.matcher(spec), seed)
    if "guided_json" in body:
      jsonschema.validate(json.loads(text), body["guided_json"])
    elif "guided_regex" in body:
      assert re.fullmatch(body["guided_regex"], text)
    elif "guided_choice" in body:
      assert text in body["guided_choice"]
    else:
      assert isinstance(json.loads(text), dict)


def test_disallowed_token_is_refused(compiler, smol):
  m = compiler.matcher(grammar_from_request({"guided_json": SCHEMAS[0]}))
  mask_W = np.zeros(compiler.words, np.int32)
  m.fill(mask_W)
  bad = smol.encode("hello")[0]
  assert bad not in allowed_ids(mask_W, compiler.vocab_size)
  assert not m.is_accepting() and 2 not in allowed_ids(mask_W, compiler.vocab_size)
  assert not m.accept(bad) and m.error() and not m.is_terminated()
  assert not m.accept(smol.encode("{")[0])  # an error state is for good
  m2 = compiler.matcher(grammar_from_request({"guided_choice": ["a"]}))
  assert not m2.accept(compiler.eos_ids[0])  # eos before the grammar can end
  assert not compiler.matcher(grammar_from_request({"guided_choice": ["a"]})).accept(10 ** 6)


def test_rollback_restores_the_mask(compiler, smol):
  m = compiler.matcher(grammar_from_request({"guided_json": SCHEMAS[0]}))
  ids = smol.encode('{"name":"Al')  # compact: phaseserve's default JSON whitespace
  first, later = np.zeros(compiler.words, np.int32), np.zeros(compiler.words, np.int32)
  assert m.accept(ids[0])
  m.fill(first)
  for t in ids[1:]:
    assert m.accept(t)
  m.rollback(len(ids) - 1)
  m.fill(later)
  np.testing.assert_array_equal(first, later)
  with pytest.raises(ValueError):
    m.rollback(5)


@pytest.mark.parametrize("body,field,words_in_message", [
    ({"guided_json": {"type": "objekt"}}, "guided_json", "objekt"),
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json", "minimum"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"guided_regex": "(?=a)b"}, "guided_regex", "look-around"),
    ({"guided_grammar": "start: a | b"}, "guided_grammar", "unknown name"),
    ({"guided_grammar": "root ::= x"}, "guided_grammar", "'x' not found"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "string", "format": "nope"}, "strict": True}}},
     "response_format.json_schema.schema", "format"),
])
def test_invalid_sources_are_value_errors_naming_the_field(compiler, body, field,
                                                           words_in_message):
  with pytest.raises(ValueError) as info:
    compiler.compile(grammar_from_request(body))
  assert isinstance(info.value, GrammarSpecError) and info.value.field == field
  assert str(info.value).startswith(field) and words_in_message in str(info.value)
  assert "\n<state>" not in str(info.value)


@pytest.mark.parametrize("body,field", [
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1, 2]}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 3]}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": 3}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_malformed_fields(body, field):
  with pytest.raises(GrammarSpecError) as info:
    grammar_from_request(body)
  assert info.value.field == field, str(info.value)


def test_request_without_constraint_and_spec_fields():
  assert grammar_from_request({}) is None
  assert grammar_from_request({"response_format": {"type": "text"}}) is None
  rf = grammar_from_request({"response_format": {"type": "json_schema", "json_schema": {
      "name": "n", "schema": {"type": "object", "properties": {"b": {}, "a": {}}}}}})
  assert rf.kind == "json_schema" and rf.lenient  # strict absent: unknown keywords ignored
  assert list(json.loads(rf.source)["properties"]) == ["b", "a"]  # order kept
  assert grammar_from_request({"guided_json": '{"type": "integer"}'}) == Grammar(
      "json_schema", '{"type":"integer"}')


def test_compile_cache(byte_compiler):
  a = grammar_from_request({"guided_json": {"type": "integer"}})
  b = grammar_from_request({"structured_outputs": {"json": '{"type": "integer"}'}})
  assert a == b and a.field != b.field
  assert byte_compiler.compile(a) is byte_compiler.compile(b)
  small = GrammarCompiler(ByteTokenizer(), cache_size=2)
  specs = [Grammar("regex", r) for r in ("a+", "b+", "c+")]
  first = small.compile(specs[0])
  small.compile(specs[1])
  assert small.compile(specs[0]) is first  # refreshed: specs[1] is now the oldest
  small.compile(specs[2])
  assert small.cached() == 2 and small.compile(specs[0]) is first
  assert small.compile(specs[1]) is not None and small.cached() == 2


def test_fill_rows_matches_fill_and_pads(compiler, smol):
  specs = [grammar_from_request({"guided_json": s}) for s in SCHEMAS[:3]]
  ms = [compiler.matcher(s) for s in specs]
  assert ms[0].accept(smol.encode("{")[0])
  for W in (compiler.words, compiler.words + 3):
    mask_RW = np.full((5, W), 7, np.int32)
    compiler.fill_rows(mask_RW, [(0, ms[0]), (3, ms[1]), (4, ms[2])])
    for r, m in ((0, ms[0]), (3, ms[1]), (4, ms[2])):
      one = np.full(W, 7, np.int32)
      m.fill(one)
      np.testing.assert_array_equal(mask_RW[r], one)
      assert not one[compiler.words:].any()
    assert (mask_RW[[1, 2]] == 7).all()
  with pytest.raises(ValueError):
    compiler.fill_rows(np.zeros((2, compiler.words - 1), np.int32), [(0, ms[0])])
  with pytest.raises(ValueError):
    compiler.fill_rows(np.zeros((2, compiler.words), np.int32), [(0, ms[0]), (0, ms[1])])
  with pytest.raises(ValueError):
    ms[0].fill(np.zeros(compiler.words, np.int64))


def _apply_reference(logits, mask, on):
  out = logits.copy()
  allowed = unpack_bitmask(mask, logits.shape[1])
  out[on[:, None] & ~allowed] = -np.inf
  return out


@pytest.mark.parametrize("V,W", [(259, 9), (320, 9), (250, 9), (64, 2), (49152, 1536)])
def test_apply_bitmask_matches_numpy(V, W):
  rng = np.random.default_rng(V)
  logits = rng.standard_normal((4, V)).astype(np.float32)
  mask = rng.integers(-2 ** 31, 2 ** 31, (4, W), dtype=np.int64).astype(np.int32)
  mask[1] = -1  # all allowed
  on = np.array([True, True, False, True])
  got = np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(mask), jnp.asarray(on)))
  np.testing.assert_array_equal(got, _apply_reference(logits, mask, on))
  if V > 32 * W:
    assert np.isneginf(got[[0, 1, 3], 32 * W:]).all() and not np.isinf(got[2]).any()
  assert words(V) == (V + 31) // 32
