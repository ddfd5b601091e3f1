"""serving.api.tool_calls without a server: the tool fields' checks (400s naming the field), the
constraint ``required`` / a named function set (random walks through the compiled grammar parse
back into calls that match the schemas), the Hermes parser on whole texts and on streams fed in
pieces (a tag split across chunks, a malformed call, two calls), and the chat response shapes."""

from __future__ import annotations

import json

import jsonschema
import pytest

from models.text.tokenizer import ByteTokenizer
from serving.api import http_response
from serving.api.http_api import Served, parse_chat
from serving.api.http_errors import ApiError
from serving.api.tool_calls import ToolCallParser, ToolSpec, extract, merge, parse_tools
from serving.grammar import GrammarCompiler
from serving.request import RequestOutput, Usage
from serving.stop import FinishReason
from tests.serving.test_grammar import _walk

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters
TOOLS = [WEATHER, ADD, NOW]
USER = [{"role": "user", "content": "hi"}]
CALL1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n' \
    "</tool_call>"
CALL2 = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def _chat(**body):
  return parse_chat(dict({"messages": USER}, **body), Served("m"))


def _spec(choice="auto", parallel=True) -> ToolSpec:
  spec = parse_tools({"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel})
  assert spec is not None
  return spec


@pytest.mark.parametrize("body,param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [WEATHER, "f"]}, "tools[1]"),
    ({"tools": [dict(WEATHER, type="code")]}, "tools[0].type"),
    ({"tools": [WEATHER, ADD, {"type": "function", "function": {"name": "a b"}}]},
     "tools[2].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]},
     "tools[0].function.strict"),
    ({"tools": [{"type": "function", "function": {"name": "f", "code": "x"}}]},
     "tools[0].function.code"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}},
      "guided_regex": "a+"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": 3}}]}]},
     "messages[0].tool_calls[0].function.name"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "tool", "content": "1", "tool_call_id": 5}]},
     "messages[0].tool_call_id"),
])
def test_tool_fields_are_checked(body, param):
  with pytest.raises(ApiError) as e:
    _chat(**body)
  assert e.value.status == 400 and e.value.param == param, e.value.message


def test_tool_fields_reach_the_request():
  p = _chat(tools=TOOLS)
  (a,) = p.prompts
  assert p.tools is not None and p.tools.choice == "auto" and a.grammar is None
  assert [t["function"]["name"] for t in a.chat_options.tools] == ["get_weather", "add", "now"]
  p = _chat(tools=TOOLS, tool_choice="none")  # rendered, not parsed (vLLM's default)
  assert p.tools is None and p.prompts[0].chat_options.tools
  for choice in ("none", "auto", None):  # without tools: nothing to do
    p = _chat(tool_choice=choice, parallel_tool_calls=False, tools=[])
    assert p.tools is None and p.prompts[0].chat_options.tools is None
  named = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
  g = named.prompts[0].grammar
  assert g.kind == "json_schema" and json.loads(g.source) == ADD["function"]["parameters"]
  assert g.field == "tools[1].function.parameters" and not g.any_whitespace
  req = _chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
  schema = json.loads(req.prompts[0].grammar.source)
  assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
  assert [o["properties"]["name"] for o in schema["items"]["anyOf"]] == [
      {"type": "string", "enum": [n]} for n in ("get_weather", "add", "now")]
  # Calls and results come back in the conversation.
  p = _chat(messages=[{"role": "user", "content": "w?"}, {
      "role": "assistant", "content": None, "tool_calls": [
          {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
      {"role": "tool", "content": "3", "tool_call_id": "c1"}], tools=TOOLS)
  assert list(p.prompts[0].messages)[1:] == [
      ("assistant", "", None, {"tool_calls": [{"type": "function", "id": "c1", "function": {
          "name": "add", "arguments": "{}"}}]}),
      ("tool", "3", None, {"tool_call_id": "c1"})]


def test_defs_are_hoisted_for_required():
  ref = {"type": "function", "function": {"name": "r", "parameters": {
      "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
      "$defs": {"P": {"type": "integer"}}}}}
  schema = json.loads(_chat(tools=[ref, ADD], tool_choice="required").prompts[0].grammar.source)
  assert schema["$defs"] == {"P": {"type": "integer"}}
  assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
  other = {"type": "function", "function": {"name": "o", "parameters": {
      "type": "object", "$defs": {"P": {"type": "string"}}}}}
  with pytest.raises(ApiError) as e:
    _chat(tools=[ref, other], tool_choice="required")
  assert e.value.param == "tools[1].function.parameters.$defs.P"


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
  return GrammarCompiler(ByteTokenizer())


def test_the_constraints_parse_back_into_calls_that_match_the_schemas(compiler):
  params = {t["function"]["name"]: t["function"].get("parameters", {}) for t in TOOLS}
  required = _spec("required").grammar()
  named = _spec({"type": "function", "function": {"name": "get_weather"}}).grammar()
  names = set()
  for seed in range(8):
    text = _walk(compiler, compiler.matcher(required), seed)
    content, calls = extract(_spec("required"), text)
    assert content is None and calls, text
    for c in calls:
      names.add(c["function"]["name"])
      jsonschema.validate(json.loads(c["function"]["arguments"]), params[c["function"]["name"]])
    text = _walk(compiler, compiler.matcher(named), 100 + seed)
    content, (call,) = extract(_spec({"type": "function", "function": {"name": "get_weather"}}),
                               text)
    assert content is None and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), params["get_weather"])
  assert len(names) >= 2  # anyOf: more than one tool is reachable


def test_hermes_calls_out_of_a_whole_text():
  spec = _spec()
  content, calls = extract(spec, f"Let me check.\n{CALL1}\n{CALL2}\n")
  assert content == "Let me check."
  assert [(c["type"], c["function"]) for c in calls] == [
      ("function", {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}),
      ("function", {"name": "add", "arguments": '{"a": 1, "b": 2}'})]
  assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
  assert calls[0]["id"] != calls[1]["id"]
  assert extract(spec, "Just text.") == ("Just text.", [])
  assert extract(spec, CALL1)[0] is None
  # A malformed call stays content; the good one is a call.
  bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>'
  content, calls = extract(spec, f"{bad}\n{CALL2}")
  assert content == bad and [c["function"]["name"] for c in calls] == ["add"]
  # An unterminated call at the end (EOS / max_tokens) is parsed if it can be, as vLLM does.
  assert extract(spec, CALL2[:-len("</tool_call>")])[1][0]["function"]["name"] == "add"
  assert extract(spec, "<tool_call>\n{\"name\": \"ad")[0] == "<tool_call>\n{\"name\": \"ad"
  # SmolLM2's trained form: a list of calls in one block; no arguments: {}.
  content, calls = extract(spec, '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                                 '{"name": "now"}]</tool_call>')
  assert [c["function"]["arguments"] for c in calls] == ['{"a": 1, "b": 2}', "{}"]
  # parallel_tool_calls false: the first call only.
  assert len(extract(_spec(parallel=False), CALL1 + CALL2)[1]) == 1


def _stream(spec: ToolSpec, pieces) -> tuple[str, list[dict]]:
  parser = ToolCallParser(spec)
  content, deltas = "", list[dict]()
  for piece in pieces:
    c, d = parser.push(piece)
    content, deltas = content + c, deltas + d
  c, d = parser.finish()
  return content + c, deltas + d


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 1000])
def test_a_stream_fed_in_pieces_gives_the_whole_texts_answer(size):
  spec = _spec()
  bad = '<tool_call>{"name": add}</tool_call>'
  for text in (f"Sure!\n{CALL1}\n{CALL2}", f"{CALL1}{bad} and <tool_c", "a < b <tool", "x\n\n",
               f"{CALL2}\n\nDone."):
    content, deltas = _stream(spec, [text[i:i + size] for i in range(0, len(text), size)])
    whole_content, whole_calls = extract(spec, text)
    assert (content or None) == whole_content, text
    assert [d["function"] for d in deltas] == [c["function"] for c in whole_calls]
    assert [d["index"] for d in deltas] == list(range(len(deltas)))


def test_a_split_tag_is_held_back_until_it_is_known():
  parser = ToolCallParser(_spec())
  assert parser.push("Hi <tool_") == ("Hi", [])  # maybe a tag: held (the space too)
  assert parser.push("ca") == ("", [])
  assert parser.push('ll>{"name": "now", "arguments": {}}</tool') == ("", [])
  content, (d,) = parser.push("_call>")
  assert content == "" and d["index"] == 0 and d["function"] == {"name": "now",
                                                                  "arguments": "{}"}
  assert parser.push(" <to") == ("", [])
  assert parser.push("day") == (" <today", [])
  assert parser.finish() == ("", []) and parser.called


def test_named_and_required_streams():
  named = _spec({"type": "function", "function": {"name": "add"}})
  parser = ToolCallParser(named)
  (first,) = parser.push('{"a": ')[1]
  assert first["function"] == {"name": "add", "arguments": '{"a": '} and first["id"]
  assert parser.push("1}") == ("", [{"index": 0, "function": {"arguments": "1}"}}])
  assert parser.finish() == ("", [])
  assert merge([first, {"index": 0, "function": {"arguments": "1}"}}])[0]["function"] == {
      "name": "add", "arguments": '{"a": 1}'}
  req = _spec("required")
  text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "now", "parameters": {}}]'
  content, deltas = _stream(req, [text[:10], text[10:]])
  assert content == "" and [d["function"]["name"] for d in deltas] == ["add", "now"]
  assert _stream(req, ["[{oops"]) == ("[{oops", [])


def test_chat_response_shapes_with_tools():
  tok = ByteTokenizer()
  text = f"Ok.\n{CALL1}"
  p = _chat(tools=TOOLS, stream=True)
  r = http_response.Response(p, "m", "q", tok, [http_response.PromptInfo(3)])
  events = [r.chunk(0, RequestOutput("r", (1,), text[i:i + 4])) for i in range(0, len(text), 4)]
  events.append(r.chunk(0, RequestOutput("r", (), "", FinishReason.STOP)))
  deltas = [e["choices"][0]["delta"] for e in events if e]
  assert "".join(d.get("content", "") for d in deltas) == "Ok."
  (call,) = [c for d in deltas for c in d.get("tool_calls", [])]
  assert call["function"]["name"] == "get_weather" and call["type"] == "function"
  assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
  p = _chat(tools=TOOLS, n=2)
  r = http_response.Response(p, "m", "q", tok, [http_response.PromptInfo(3)])
  r.add(0, RequestOutput("r", (1,), CALL2, FinishReason.STOP))
  r.add(1, RequestOutput("r", (1,), "No call.", FinishReason.STOP))
  c0, c1 = _body(r)
  assert c0["message"]["content"] is None and c0["finish_reason"] == "tool_calls"
  assert c0["message"]["tool_calls"][0]["function"] == {"name": "add",
                                                        "arguments": '{"a": 1, "b": 2}'}
  assert c1["message"] == {"role": "assistant", "content": "No call.", "tool_calls": []}
  assert c1["finish_reason"] == "stop"
  named = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
  r = http_response.Response(named, "m", "q", tok, [http_response.PromptInfo(3)])
  r.add(0, RequestOutput("r", (1,), '{"a": 1, "b": 2}', FinishReason.STOP))
  (c,) = _body(r)
  assert c["finish_reason"] == "stop"  # OpenAI's for a named function
  assert c["message"]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'
  none = _chat(tools=TOOLS, tool_choice="none")  # not parsed
  r = http_response.Response(none, "m", "q", tok, [http_response.PromptInfo(3)])
  r.add(0, RequestOutput("r", (1,), CALL2, FinishReason.STOP))
  (c,) = _body(r)
  assert c["message"] == {"role": "assistant", "content": CALL2}


class _Done:
  """What ``Response.body`` reads of a finished stream."""

  def usage(self) -> Usage:
    return Usage(3, 1, 0)


def _body(r: http_response.Response) -> list[dict]:
  return r.body([_Done()])["choices"]  # type: ignore[list-item]  # a Stream's usage() only
