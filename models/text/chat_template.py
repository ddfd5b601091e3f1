"""Chat templates: render a model's Jinja2 chat template for a list of messages, sandboxed.

Contract:
  * ``render_chat_template(template, messages, *, add_generation_prompt=True, bos_token=None,
    eos_token=None, template_vars=None) -> str`` renders the way transformers' ``apply_chat_template`` does, in
    Jinja2's ``ImmutableSandboxedEnvironment`` (with transformers' globals and filters).
  * ``messages`` must be a non-empty list of mappings with the keys ``role`` and ``content``
    and optionally ``name``, all ``str``, and the OpenAI tool keys ``tool_calls`` (a list of
    JSON objects) and ``tool_call_id`` (a ``str``) (``validate_messages``); the template sees
    fresh plain dicts. ``template_vars`` adds variables (not the four above).
  * The sandbox is strict: an unsafe attribute raises at once.
  * Every failure is a ``ValueError`` with the reason (invalid messages, syntax error, sandbox
    violation, a render error, the template's own ``raise_exception(message)`` verbatim).
  * Compiled templates are cached per template string; nothing is built at import time.
  * ``DEFAULT_CHAT_TEMPLATE`` (the random presets'): one line ``role: content`` per message, then
    ``assistant: `` when ``add_generation_prompt``; no special tokens.
The environment in full: BUILD_NOTES "Design: Tokenizers and chat templates".
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Mapping, NotRequired, Sequence, TypedDict

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import jinja2.utils

_MIN_JINJA = (3, 1, 6)  # older releases have known sandbox escapes

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


class ChatMessage(TypedDict):
  role: str
  content: str
  name: NotRequired[str]  # OpenAI's participant name, passed to the template
  tool_calls: NotRequired[list[dict[str, Any]]]  # an assistant's calls (plain JSON objects)
  tool_call_id: NotRequired[str]  # a tool result's call id


class _RaisedByTemplate(jinja2.TemplateError):
  """What ``raise_exception`` raises; its message is the template's own."""


class _StrictSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
  """The immutable sandbox, but an unsafe attribute is an error, not a silent undefined."""

  def unsafe_undefined(self, obj: object, attribute: str) -> jinja2.Undefined:
    raise jinja2.sandbox.SecurityError(
        f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


class _GenerationTag(jinja2.ext.Extension):
  """``{% generation %}...{% endgeneration %}``: renders the body (no assistant-mask tracking)."""

  tags = {"generation"}

  def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
  """``namespace(...)`` that refuses underscore-prefixed attribute names."""

  def __init__(*args: object, **kwargs: object):  # same signature trick as jinja2's Namespace
    self, rest = args[0], args[1:]
    attrs = dict(*rest, **kwargs)
    for name in attrs:
      _Namespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name: str, value: object) -> None:
    _Namespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.sandbox.SecurityError(
          f"a chat template cannot set the underscore-prefixed attribute {name!r}")


def _raise_exception(message: object) -> None:
  raise _RaisedByTemplate(str(message))


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


def _make_dict(*args: Any, **kwargs: object) -> dict[Any, object]:
  return dict(*args, **kwargs)


@functools.cache
def _environment() -> jinja2.Environment:
  version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
  if version < _MIN_JINJA:
    raise RuntimeError(f"chat templates need jinja2>={'.'.join(map(str, _MIN_JINJA))} (older "
                       f"sandboxes have known escapes); found {jinja2.__version__}")
  env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True,
                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  env.globals["dict"] = _make_dict
  env.globals["namespace"] = _Namespace
  return env


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
  try:
    return _environment().from_string(template)
  except jinja2.TemplateSyntaxError as e:
    raise ValueError(f"chat template syntax error (line {e.lineno}): {e.message}") from None


_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
_RESERVED_VARS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def validate_messages(messages: object) -> list[ChatMessage]:
  """``messages`` as fresh plain dicts, or a ValueError saying what is wrong."""
  if not isinstance(messages, (list, tuple)) or not messages:
    raise ValueError(f"chat messages must be a non-empty list, got {type(messages).__name__}")
  out: list[ChatMessage] = []
  for i, message in enumerate(messages):
    if not isinstance(message, Mapping):
      raise ValueError(f"chat message {i} must be a dict with 'role' and 'content', got "
                       f"{type(message).__name__}")
    keys = set(message)
    if not {"role", "content"} <= keys <= _MESSAGE_KEYS:
      missing, extra = {"role", "content"} - keys, keys - _MESSAGE_KEYS
      raise ValueError(f"chat message {i} must have the keys 'role' and 'content' and may have "
                       f"'name', 'tool_calls', 'tool_call_id' (missing: {sorted(missing)}, "
                       f"unexpected: {sorted(map(str, extra))})")
    role, content = message["role"], message["content"]
    if not isinstance(role, str) or not role:
      raise ValueError(f"chat message {i}: 'role' must be a non-empty str, got {role!r}")
    if not isinstance(content, str):
      raise ValueError(f"chat message {i}: 'content' must be a str, got "
                       f"{type(content).__name__}")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
      raise ValueError(f"chat message {i}: 'name' must be a str, got {type(name).__name__}")
    plain: ChatMessage = {"role": str.__str__(role), "content": str.__str__(content)}
    if name is not None:
      plain["name"] = str.__str__(name)
    _tool_keys(i, message, plain)
    out.append(plain)
  return out


def _tool_keys(i: int, message: Mapping[str, Any], plain: ChatMessage) -> None:
  """Copies ``tool_calls`` (as plain JSON: fresh dicts, lists, str, numbers) and
  ``tool_call_id`` into ``plain``, or a ValueError."""
  calls, call_id = message.get("tool_calls"), message.get("tool_call_id")
  if call_id is not None:
    if not isinstance(call_id, str):
      raise ValueError(f"chat message {i}: 'tool_call_id' must be a str, got "
                       f"{type(call_id).__name__}")
    plain["tool_call_id"] = str.__str__(call_id)
  if calls is None:
    return
  if not isinstance(calls, (list, tuple)) or not all(isinstance(c, Mapping) for c in calls):
    raise ValueError(f"chat message {i}: 'tool_calls' must be a list of dicts")
  try:
    plain["tool_calls"] = json.loads(json.dumps(list(calls), allow_nan=False))
  except (TypeError, ValueError) as e:
    raise ValueError(f"chat message {i}: 'tool_calls' is not plain JSON: {e}") from None


def render_chat_template(template: str, messages: Sequence[ChatMessage], *,
                         add_generation_prompt: bool = True, bos_token: str | None = None,
                         eos_token: str | None = None,
                         template_vars: Mapping[str, object] | None = None) -> str:
  """Renders ``template`` for ``messages``; see the module contract."""
  if not isinstance(template, str):
    raise ValueError(f"a chat template must be a str, got {type(template).__name__}")
  chat = validate_messages(messages)
  compiled = _compile(template)
  clash = sorted(_RESERVED_VARS & set(template_vars or {}))
  if clash:
    raise ValueError(f"template variables cannot set {clash[0]!r}")
  variables: dict[str, object] = {**(template_vars or {}), "messages": chat,
                                  "add_generation_prompt": bool(add_generation_prompt)}
  for name, token in (("bos_token", bos_token), ("eos_token", eos_token)):
    if token is not None:
      variables[name] = str(token)
  try:
    return compiled.render(**variables)
  except _RaisedByTemplate as e:
    raise ValueError(f"chat template raised an exception: {e.message}") from None
  except jinja2.sandbox.SecurityError as e:
    raise ValueError(f"chat template blocked by the sandbox: {e}") from None
  except jinja2.TemplateError as e:
    raise ValueError(f"chat template error: {e}") from None
  except Exception as e:  # the template is untrusted code: any failure while rendering is its own
    raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from None
