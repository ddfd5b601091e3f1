"""OpenAI tool calling on the HTTP API: the request's tool fields, their constraint, the calls
parsed back out of the generated text (whole or streamed).

Contract:
  * ``parse_tools(body) -> ToolSpec | None``: ``tools`` (``{"type": "function", "function":
    {name, description?, parameters?, strict?}}``; a name matches ``^[a-zA-Z0-9_-]{1,64}$`` and is
    unique, ``parameters`` is an object schema, absent = no arguments), ``tool_choice``
    (``none``, ``auto``, ``required`` or ``{"type": "function", "function": {"name"}}``; default
    ``auto`` with tools, ``none`` without) and ``parallel_tool_calls`` (false: one call at most).
    A bad value is a 400 naming the field (``tools[2].function.name``, ``tool_choice``). None when
    the request has neither tools nor a tool choice other than none / auto.
  * ``ToolSpec.grammar()`` is vLLM's constraint (``serving.grammar_spec.Grammar``, compact JSON):
    a named function -> its ``parameters`` schema (the whole output is that call's arguments);
    ``required`` -> a JSON array (``minItems`` 1; ``maxItems`` 1 without parallel calls) of
    ``{"name": <the tool's name>, "parameters": <its schema>}`` objects (``anyOf`` per tool,
    ``$defs`` hoisted to the root); None for ``auto`` / ``none``.
  * ``ToolCallParser(spec)``: ``push(text)`` / ``finish()`` -> ``(content, tool_call deltas)``,
    as chat stream deltas (``index``, and on a call's first delta ``id`` ``call_<24 hex>``,
    ``type``, ``function.name``; ``function.arguments`` a JSON string). ``auto``: the Hermes format
    (vLLM's ``hermes`` parser): each ``<tool_call>{"name", "arguments"}</tool_call>`` block (or a
    JSON list of such objects in one block) is one delta once complete; a block whose JSON does
    not parse stays content, as does the text outside the blocks (whitespace around calls is
    dropped); an unterminated block at the end is parsed as vLLM does. ``required``: the JSON array
    is parsed at the end (content if it does not parse). Named: the text streams as the
    arguments of the one call. ``none`` (or no spec): no parsing. ``called``: a call was made.
  * ``extract(spec, text) -> (content or None, tool_calls)``: the non-streamed message, by the same
    parser, so a stream's deltas and the whole answer agree.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any, Literal, Mapping

from models.text.chat_tools import TOOL_CALL_END, TOOL_CALL_START
from serving.api.http_errors import bad
from serving.grammar_spec import Grammar

Choice = Literal["none", "auto", "required", "named"]
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_NO_ARGS: dict[str, Any] = {"type": "object", "properties": {}}
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


@dataclasses.dataclass(frozen=True)
class ToolSpec:
  tools: tuple[dict[str, Any], ...]  # validated, as the client sent them (for the template)
  choice: Choice
  name: str = ""  # the named function (choice "named")
  parallel: bool = True

  @property
  def parses(self) -> bool:
    return self.choice != "none"

  def parameters(self, name: str) -> dict[str, Any]:
    fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
    return fn.get("parameters") or dict(_NO_ARGS)

  def grammar(self) -> Grammar | None:
    if self.choice == "named":
      i = next(i for i, t in enumerate(self.tools) if t["function"]["name"] == self.name)
      strict = self.tools[i]["function"].get("strict") is True
      return Grammar("json_schema", _compact(self.parameters(self.name)), any_whitespace=False,
                     lenient=not strict, field=f"tools[{i}].function.parameters")
    if self.choice != "required":
      return None
    defs: dict[str, Any] = {}
    items = []
    for i, t in enumerate(self.tools):
      params = dict(self.parameters(t["function"]["name"]))
      for k, v in (params.pop("$defs", None) or {}).items():
        if defs.setdefault(k, v) != v:
          raise bad(f"tools[{i}].function.parameters.$defs.{k}", "another tool defines it "
                    "differently (tool_choice required joins the tools' $defs)")
      items.append({"type": "object", "properties": {
          "name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": params},
                    "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": items}}
    if not self.parallel:
      schema["maxItems"] = 1
    if defs:
      schema["$defs"] = defs
    return Grammar("json_schema", _compact(schema), any_whitespace=False, lenient=True,
                   field="tools")


def _compact(value: object) -> str:
  return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _tool(i: int, t: object) -> dict[str, Any]:
  where = f"tools[{i}]"
  if not isinstance(t, dict):
    raise bad(where, "must be an object {type: function, function: {name, parameters}}")
  if t.get("type") != "function":
    raise bad(f"{where}.type", f"must be 'function', got {t.get('type')!r:.40}")
  fn = t.get("function")
  if not isinstance(fn, dict):
    raise bad(f"{where}.function", "required: an object with name and parameters")
  name = fn.get("name")
  if not isinstance(name, str) or not _NAME.fullmatch(name):
    raise bad(f"{where}.function.name", "required: 1-64 letters, digits, _ or -, got "
              f"{name!r:.70}")
  if fn.get("description") is not None and not isinstance(fn["description"], str):
    raise bad(f"{where}.function.description", "must be a string")
  if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
    raise bad(f"{where}.function.strict", "must be a boolean")
  params = fn.get("parameters")
  if params is not None and (not isinstance(params, dict)
                             or params.get("type", "object") != "object"):
    raise bad(f"{where}.function.parameters", "must be a JSON schema of type object")
  extra = sorted(set(fn) - _FUNCTION_KEYS)
  if extra:
    raise bad(f"{where}.function.{extra[0]}", "unknown field")
  return {"type": "function", "function": dict(fn)}


def _choice(value: object, names: list[str]) -> tuple[Choice, str]:
  if value is None:
    return ("auto" if names else "none"), ""
  if value in ("none", "auto", "required"):
    if value == "required" and not names:
      raise bad("tool_choice", "'required' needs tools")
    return value, ""
  if isinstance(value, dict) and value.get("type") == "function":
    fn = value.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
      raise bad("tool_choice", "a named choice is {type: function, function: {name}}")
    if name not in names:
      raise bad("tool_choice", f"names the function {name!r:.70}, which is not in tools")
    return "named", name
  raise bad("tool_choice", "must be 'none', 'auto', 'required' or {type: function, function: "
            f"{{name}}}}, got {value!r:.60}")


def parse_tools(body: Mapping[str, Any]) -> ToolSpec | None:
  """The request's tool fields; see the module contract."""
  raw = body.get("tools")
  if raw is not None and not isinstance(raw, list):
    raise bad("tools", "must be a list of tools")
  tools = [_tool(i, t) for i, t in enumerate(raw or [])]
  names: list[str] = []
  for i, t in enumerate(tools):
    if t["function"]["name"] in names:
      raise bad(f"tools[{i}].function.name", f"{t['function']['name']!r} is given twice")
    names.append(t["function"]["name"])
  choice, name = _choice(body.get("tool_choice"), names)
  parallel = body.get("parallel_tool_calls")
  if parallel is not None and not isinstance(parallel, bool):
    raise bad("parallel_tool_calls", "must be a boolean")
  if not tools:
    return None
  return ToolSpec(tuple(tools), choice, name, parallel is not False)


def message_keys(i: int, m: Mapping[str, Any]) -> dict[str, object]:
  """A chat message's ``tool_calls`` / ``tool_call_id``, checked (400s name the field)."""
  keys: dict[str, object] = {}
  call_id = m.get("tool_call_id")
  if call_id is not None:
    if not isinstance(call_id, str):
      raise bad(f"messages[{i}].tool_call_id", "must be a string")
    keys["tool_call_id"] = call_id
  calls = m.get("tool_calls")
  if calls is None:
    return keys
  if not isinstance(calls, list):
    raise bad(f"messages[{i}].tool_calls", "must be a list of tool calls")
  out = []
  for j, c in enumerate(calls):
    where = f"messages[{i}].tool_calls[{j}]"
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict):
      raise bad(where, "must be {id, type: function, function: {name, arguments}}")
    if not isinstance(fn.get("name"), str):
      raise bad(f"{where}.function.name", "required: a string")
    if not isinstance(fn.get("arguments", ""), str):
      raise bad(f"{where}.function.arguments", "must be a string (JSON)")
    call: dict[str, object] = {"type": "function", "function": {
        "name": fn["name"], "arguments": fn.get("arguments", "{}")}}
    if isinstance(c.get("id"), str):
      call["id"] = c["id"]
    out.append(call)
  if out:
    keys["tool_calls"] = out
  return keys


def _call_id() -> str:
  return "call_" + secrets.token_hex(12)


def _arguments(value: object) -> str:
  if isinstance(value, str):
    return value
  return json.dumps({} if value is None else value, ensure_ascii=False)


def _calls_of(value: object, args_key: str) -> list[tuple[str, str]] | None:
  """(name, arguments JSON) of each call object in ``value`` (one or a list); None if malformed."""
  items = value if isinstance(value, list) else [value]
  calls = []
  for item in items:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
      return None
    args = item.get(args_key, item.get("parameters" if args_key == "arguments" else "arguments"))
    calls.append((item["name"], _arguments(args)))
  return calls or None


def _partial_suffix(text: str, tag: str) -> int:
  """The length of the longest end of ``text`` that begins ``tag`` (held back: maybe a tag)."""
  for k in range(min(len(tag) - 1, len(text)), 0, -1):
    if tag.startswith(text[-k:]):
      return k
  return 0


class ToolCallParser:
  """One choice's tool calls out of its text; see the module contract."""

  def __init__(self, spec: ToolSpec):
    self.spec = spec
    self.called = False
    self.count = 0  # calls sent
    self.buf = ""
    self.in_call = False
    self.ws = ""  # trailing whitespace of content, not yet sent
    self.pre_ws = ""  # the whitespace dropped before the open block

  def _delta(self, name: str, arguments: str) -> dict[str, Any] | None:
    if self.count and not self.spec.parallel:
      return None
    self.called = True
    self.count += 1
    return {"index": self.count - 1, "id": _call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}

  def _content(self, text: str, out: list[str]) -> None:
    both = self.ws + text
    body = both.rstrip()
    self.ws = both[len(body):]
    if body:
      out.append(body)

  def _block(self, block: str, closed: bool, out: list[str], deltas: list[dict[str, Any]]):
    try:
      calls = _calls_of(json.loads(block), "arguments")
    except json.JSONDecodeError:
      calls = None
    if calls is None:
      self.ws += self.pre_ws
      self._content(TOOL_CALL_START + block + (TOOL_CALL_END if closed else ""), out)
      return
    for name, args in calls:
      d = self._delta(name, args)
      if d is not None:
        deltas.append(d)

  def _hermes(self, out: list[str], deltas: list[dict[str, Any]]) -> None:
    while True:
      if self.in_call:
        j = self.buf.find(TOOL_CALL_END)
        if j < 0:
          return
        block, self.buf = self.buf[:j], self.buf[j + len(TOOL_CALL_END):]
        self.in_call = False
        self._block(block, True, out, deltas)
        continue
      i = self.buf.find(TOOL_CALL_START)
      if i < 0:
        keep = len(self.buf) - _partial_suffix(self.buf, TOOL_CALL_START)
        self._content(self.buf[:keep], out)
        self.buf = self.buf[keep:]
        return
      self._content(self.buf[:i], out)
      self.pre_ws, self.ws = self.ws, ""  # whitespace before a call is not content
      self.buf = self.buf[i + len(TOOL_CALL_START):]
      self.in_call = True

  def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
    """The content and call deltas ``text`` completes."""
    choice = self.spec.choice
    if choice == "none":
      return text, []
    if choice == "named":
      if not text:
        return "", []
      if self.count:
        return "", [{"index": 0, "function": {"arguments": text}}]
      d = self._delta(self.spec.name, text)
      return "", [d] if d else []
    self.buf += text
    if choice == "required":
      return "", []
    out: list[str] = []
    deltas: list[dict[str, Any]] = []
    self._hermes(out, deltas)
    return "".join(out), deltas

  def finish(self) -> tuple[str, list[dict[str, Any]]]:
    """What is left at the end of the text."""
    choice = self.spec.choice
    if choice == "none":
      return "", []
    if choice == "named":
      d = None if self.count else self._delta(self.spec.name, "")
      return "", [d] if d else []
    buf, self.buf = self.buf, ""
    out: list[str] = []
    deltas: list[dict[str, Any]] = []
    if choice == "required":
      try:
        value = json.loads(buf)
        calls = _calls_of(value, "parameters") if isinstance(value, list) else None
      except json.JSONDecodeError:
        calls = None
      for name, args in calls or []:
        d = self._delta(name, args)
        if d is not None:
          deltas.append(d)
      return ("" if calls else buf), deltas
    if self.in_call:
      self.in_call = False
      self._block(buf, False, out, deltas)
    else:
      self._content(buf, out)
    if not self.called:
      out.append(self.ws)
    self.ws = ""
    return "".join(out), deltas


def merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Deltas of the same call (index) as one: what one chunk, or the whole message, carries."""
  by_index: dict[int, dict[str, Any]] = {}
  for d in deltas:
    got = by_index.get(d["index"])
    if got is None:
      by_index[d["index"]] = {**d, "function": dict(d["function"])}
    else:
      got["function"]["arguments"] = got["function"].get("arguments", "") + \
          d["function"].get("arguments", "")
  return [by_index[k] for k in sorted(by_index)]


def extract(spec: ToolSpec, text: str) -> tuple[str | None, list[dict[str, Any]]]:
  """The whole message's content (None if empty) and ``tool_calls``."""
  parser = ToolCallParser(spec)
  content, deltas = parser.push(text)
  more, last = parser.finish()
  calls = [{k: v for k, v in d.items() if k != "index"} for d in merge(deltas + last)]
  content += more
  return (content or None), calls


__all__ = ["Choice", "ToolCallParser", "ToolSpec", "extract", "merge", "message_keys",
           "parse_tools"]
