"""OpenAI tools in a chat prompt: through the chat template when it takes them, else as Hermes text.

Contract: ``with_tools(template, messages, tools) -> (messages, template_vars)`` prepares a chat
whose request carries ``tools`` (OpenAI's list of ``{"type": "function", "function": {name,
description, parameters}}``; None: no tools) and whose messages may carry ``tool_calls`` /
``tool_call_id`` (``models.text.chat_template.ChatMessage``).
  * A template that references ``tools`` (transformers' ``apply_chat_template(tools=...)``
    convention: Qwen2.5, Hermes 2 Pro, Llama 3.1, ...) gets ``{"tools": tools}`` as a template
    variable; one that references ``tool_calls`` gets the messages' ``tool_calls`` as message keys,
    each call's ``function.arguments`` as a dict when it is a JSON object string (as vLLM passes
    them; templates write ``arguments | tojson``).
  * Otherwise (SmolLM2's ``<|im_start|>role\\ncontent<|im_end|>``) the chat is rewritten as text
    in the Hermes function-calling format: a system message listing the tools' signatures inside
    ``<tools>...</tools>`` and asking for ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
    </tool_call>`` (after the client's own system message, in the same message, when there is
    one); an assistant's ``tool_calls`` appended to its content as such ``<tool_call>`` blocks;
    a ``tool`` message's content wrapped in ``<tool_response>...</tool_response>``. The result is
    plain content: ``models.text.chat_encode`` tokenizes it as text (never control ids).
  * ``hermes_call(name, arguments)`` is one ``<tool_call>`` block as the model is asked to write
    it (``serving.api.tool_calls`` parses it back).
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from models.text.chat_template import ChatMessage

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_TOOLS_VAR = re.compile(r"\btools\b")
_TOOL_CALLS_KEY = re.compile(r"\btool_calls\b")

HERMES_SYSTEM = (
    "You are a function calling AI model. You are given function signatures within <tools>"
    "</tools> XML tags. You may call one or more of these functions to answer the user's "
    "request. Do not make up values for a function's arguments. Here are the available tools:\n"
    "<tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function's name and arguments within "
    "<tool_call></tool_call> XML tags, as follows:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def hermes_call(name: str, arguments: object) -> str:
  """One call as Hermes text; ``arguments`` a JSON object string (embedded as the object) or a
  value (serialized)."""
  if isinstance(arguments, str):
    try:
      arguments = json.loads(arguments)
    except json.JSONDecodeError:
      pass  # kept as the string the client gave
  body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
  return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


def hermes_system(tools: Sequence[Mapping[str, Any]]) -> str:
  """The system prompt listing ``tools`` (one JSON signature per line)."""
  lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
  return HERMES_SYSTEM.format(tools=lines)


def _call_parts(call: Mapping[str, Any]) -> tuple[str, object]:
  fn = call.get("function")
  fn = fn if isinstance(fn, Mapping) else call
  return str(fn.get("name", "")), fn.get("arguments", {})


def _as_text(m: ChatMessage) -> ChatMessage:
  """A message with its tool keys folded into its content (the Hermes format)."""
  content = m["content"]
  if m.get("tool_calls"):
    calls = "\n".join(hermes_call(*_call_parts(c)) for c in m.get("tool_calls", []))
    content = f"{content}\n{calls}" if content else calls
  elif m["role"] == "tool":
    content = f"<tool_response>\n{content}\n</tool_response>"
  out: ChatMessage = {"role": m["role"], "content": content}
  if "name" in m:
    out["name"] = m["name"]
  return out


def _arguments_as_objects(m: ChatMessage) -> ChatMessage:
  if not m.get("tool_calls"):
    return m
  calls = []
  for call in m.get("tool_calls", []):
    call = dict(call)
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
      try:
        args = json.loads(fn["arguments"])
      except json.JSONDecodeError:
        args = None
      if isinstance(args, dict):
        call["function"] = dict(fn, arguments=args)
    calls.append(call)
  out = dict(m)
  out["tool_calls"] = calls
  return out  # type: ignore[return-value]  # the same keys as m


def with_tools(template: str | None, messages: Sequence[ChatMessage],
               tools: Sequence[Mapping[str, Any]] | None
               ) -> tuple[list[ChatMessage], dict[str, object]]:
  """(messages, extra template variables); see the module contract."""
  msgs = list(messages)
  has_calls = any("tool_calls" in m or "tool_call_id" in m or m["role"] == "tool" for m in msgs)
  if not tools and not has_calls:
    return msgs, {}
  takes_tools = template is not None and _TOOLS_VAR.search(template) is not None
  takes_calls = template is not None and _TOOL_CALLS_KEY.search(template) is not None
  extra: dict[str, object] = {}
  if takes_calls:
    msgs = [_arguments_as_objects(m) for m in msgs]
  else:
    msgs = [_as_text(m) for m in msgs]
  if tools and takes_tools:
    extra["tools"] = [dict(t) for t in tools]
  elif tools:
    prompt = hermes_system(tools)
    if msgs and msgs[0]["role"] == "system":
      first: ChatMessage = {**msgs[0]}
      first["content"] = f"{msgs[0]['content']}\n\n{prompt}" if msgs[0]["content"] else prompt
      msgs[0] = first
    else:
      msgs.insert(0, {"role": "system", "content": prompt})
  return msgs, extra


__all__ = ["HERMES_SYSTEM", "TOOL_CALL_END", "TOOL_CALL_START", "hermes_call", "hermes_system",
           "with_tools"]
