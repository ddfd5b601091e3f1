"""Tool calling and structured outputs end to end on the real model, in `make test`:
launch.server as a real process serving SmolLM2-135M-Instruct (the trained weights, the default
dtype for this CPU), driven by the official ``openai`` client. A named function and ``required``
return ``tool_calls`` whose arguments parse and match the tool's schema (the grammar engine
enforces it); ``auto`` with a prompt asking for the tool gives a well-formed answer; a conversation
holding an assistant's ``tool_calls`` and the ``tool`` result is accepted; a streamed named call
is rebuilt by the client's own stream accumulator; 20 random JSON schemas
(``launch.lab.structured_schemas.random_schema``): every answer parses and validates with
``jsonschema``.

The server is kept cheap for the suite: a 1024-token context, 4 slots, layers in one scan (one
layer's program to compile) and no warm-up (programs compile on first use, hence the long
watchdog): what is tested is the answers, not start-up or latency."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from launch.lab.structured_schemas import random_schema, request_body
from tests.e2e import http_harness

pytestmark = pytest.mark.timeout(400)

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  with http_harness.served(tmp_path_factory.mktemp("tools"), "--model", MODEL,
                           "--max_context", "1024", "--max_slots", "4", "--kv_pages", "256",
                           "--page_size", "16", "--max_chunk", "128", "--scan_layers",
                           "--nowarmup", "--watchdog_s", "600",
                           xla_flags="") as s:  # XLA's default level: this server decodes a
    # lot (the random schemas), and XLA's own code at level 0 runs slower (94 s against 35 s)
    yield s


@pytest.fixture(scope="module")
def client(server):
  return http_harness.client(server, timeout=240)


def _check(call) -> None:
  assert call.type == "function" and call.id.startswith("call_"), call
  assert call.function.name in SCHEMAS, call
  jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_returns_its_call(client):
  r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                     max_tokens=48, temperature=0)
  (choice,) = r.choices
  (call,) = choice.message.tool_calls
  assert call.function.name == "get_weather" and choice.message.content is None
  _check(call)
  assert choice.finish_reason == "stop"  # OpenAI's for a named function


def test_required_returns_calls_that_match_their_schemas(client):
  r = client.chat.completions.create(
      model=MODEL, messages=[{"role": "user", "content": "What is 2 plus 3?"}], tools=TOOLS,
      tool_choice="required", max_tokens=64, temperature=0)
  (choice,) = r.choices
  assert choice.message.tool_calls and choice.finish_reason == "tool_calls", choice
  for call in choice.message.tool_calls:
    _check(call)


def test_auto_gives_a_well_formed_answer(client):
  r = client.chat.completions.create(
      model=MODEL, messages=[{"role": "user", "content": "Call get_weather for Paris in "
                                                         "celsius."}],
      tools=TOOLS, max_tokens=48, temperature=0)
  (choice,) = r.choices
  calls = choice.message.tool_calls or []
  assert choice.finish_reason in ("tool_calls", "stop", "length"), choice
  assert (choice.finish_reason == "tool_calls") == bool(calls) or choice.finish_reason == "length"
  assert calls or isinstance(choice.message.content, str)
  for call in calls:  # a parsed call always has a name and JSON arguments
    assert call.id.startswith("call_") and isinstance(json.loads(call.function.arguments), dict)


def test_a_conversation_with_a_call_and_its_result(client):
  messages = ASK + [
      {"role": "assistant", "content": None, "tool_calls": [{
          "id": "call_1", "type": "function", "function": {
              "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
  r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=24,
                                     temperature=0, tool_choice="none")
  (choice,) = r.choices
  assert isinstance(choice.message.content, str) and choice.message.content, choice
  assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
  assert r.usage.prompt_tokens > 200  # the tools' system message and both turns were rendered


def test_a_streamed_named_call_is_rebuilt_by_the_client(client):
  """The client's stream accumulator (what ``chat.completions.stream`` runs) rebuilds the call
  the whole answer holds (greedy: the same text)."""
  args = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=48,
              temperature=0, seed=1)
  (whole,) = client.chat.completions.create(**args).choices[0].message.tool_calls
  state = ChatCompletionStreamState()
  chunks = 0
  for chunk in client.chat.completions.create(stream=True, **args):
    state.handle_chunk(chunk)
    chunks += bool(chunk.choices and chunk.choices[0].delta.tool_calls)
  (choice,) = state.current_completion_snapshot.choices
  (call,) = choice.message.tool_calls
  assert chunks > 1  # the arguments stream as they are generated
  assert (call.id.startswith("call_"), call.type, call.function.name, call.function.arguments) \
      == (True, "function", "get_weather", whole.function.arguments)
  assert choice.finish_reason == "stop"
  _check(call)


def test_random_schemas_all_parse_and_validate(client):
  # 20 in the suite (50 took 49 s of it); ``launch.lab.eval_structured --n 50`` runs the 50.
  import concurrent.futures as cf
  import random
  rng = random.Random(0)
  schemas = [random_schema(rng) for _ in range(20)]

  def one(schema):
    body = request_body(schema, MODEL, 200)
    so = body.pop("structured_outputs")
    r = client.chat.completions.create(**body, extra_body={"structured_outputs": so})
    return r.choices[0].finish_reason, r.choices[0].message.content
  with cf.ThreadPoolExecutor(4) as pool:
    answers = list(pool.map(one, schemas))
  for schema, (finish, text) in zip(schemas, answers):
    assert finish == "stop", (finish, text)
    jsonschema.validate(json.loads(text), schema)
