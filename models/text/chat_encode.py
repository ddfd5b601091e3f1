"""A chat rendered by its template and tokenized so that only the template makes control ids.

Contract: ``encode_chat(tok, messages, options) -> list[int]`` renders ``messages`` with the
tokenizer's chat template (``Tokenizer.apply_chat_template``) and tokenizes the result.
  * By default (``ChatOptions.special_in_content`` false) message content is text: a control
    token's text inside it (``<|im_start|>`` ...) is split like any other text, so no client can
    forge a system or assistant turn; only the template's own markers become control ids. A chat
    whose content holds no control text is tokenized exactly as ``encode(rendered)``.
  * The content's place in the rendering is found with a random marker per message, rendered in
    its stead. A template that transforms content (``| trim`` ...) so that the rendering differs
    with the markers: then content holding control text is a ``ValueError`` (refused, never
    tokenized into control ids).
  * ``special_in_content`` true is the permissive behaviour of vLLM and llama.cpp's servers:
    ``encode(rendered)``, control text in content becomes control ids.
  * ``add_generation_prompt`` as transformers'; ``continue_final``: the rendering is cut after the
    last message's content (no end marker), so the model continues that message (vLLM's
    ``continue_final_message``); ``template_vars``: extra template variables
    (``chat_template_kwargs``); ``tools``: OpenAI's tool list, rendered by
    ``models.text.chat_tools.with_tools`` (a template variable, or a Hermes system message).
  * Tool definitions and ``tool_calls`` that a template renders itself are not content: one that
    holds a control token's text is a ``ValueError`` unless ``special_in_content``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from models.text.chat_template import ChatMessage
from models.text.chat_tools import with_tools

if TYPE_CHECKING:
  from models.text.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class ChatOptions:
  add_generation_prompt: bool = True
  continue_final: bool = False
  template_vars: Mapping[str, object] | None = None
  special_in_content: bool = False
  tools: Sequence[Mapping[str, Any]] | None = None  # OpenAI's tools (None: none)


def _with_tools(tok: Tokenizer, messages: Sequence[ChatMessage], options: ChatOptions
                ) -> tuple[Sequence[ChatMessage], ChatOptions]:
  """The chat and options with the tools rendered in (``chat_tools.with_tools``); refuses control
  text in what the template renders outside content."""
  msgs, extra = with_tools(tok.chat_template, messages, options.tools)
  if not extra and msgs == list(messages):
    return messages, options
  raw = [extra.get("tools"), [m.get("tool_calls") for m in msgs],
         [m.get("tool_call_id") for m in msgs]]
  if not options.special_in_content:
    text = json.dumps(raw, ensure_ascii=False)
    if any(c in text for c in tok.control_texts):
      raise ValueError("a tool definition or tool call holds a control token's text; remove it "
                       "(or start the server with --special_tokens_in_messages)")
  variables = {**(options.template_vars or {}), **extra}
  return msgs, dataclasses.replace(options, template_vars=variables or None)


def _cut_after(text: str, content: str) -> str:
  at = text.rfind(content)
  if at < 0 or not content:
    raise ValueError("continue_final_message: the last message's content is not in the rendered "
                     "chat (the template changes it)")
  return text[:at + len(content)]


def _render(tok: Tokenizer, messages: Sequence[ChatMessage], options: ChatOptions) -> str:
  text = tok.apply_chat_template(
      messages, options.add_generation_prompt and not options.continue_final,
      options.template_vars)
  if options.continue_final:
    text = _cut_after(text, messages[-1]["content"])
  return text


def encode_chat(tok: Tokenizer, messages: Sequence[ChatMessage],
                options: ChatOptions = ChatOptions()) -> list[int]:
  messages, options = _with_tools(tok, messages, options)
  text = _render(tok, messages, options)
  controls = tok.control_texts
  if options.special_in_content or not any(
      c in m["content"] for m in messages for c in controls):
    return tok.encode(text)
  nonce = secrets.token_hex(8)
  marks = [f"\ue000{nonce}.{i}\ue001" for i in range(len(messages))]
  masked: list[ChatMessage] = [dict(m, content=mark)  # type: ignore[misc]  # same keys
                               for m, mark in zip(messages, marks)]
  marked = tok.apply_chat_template(
      masked, options.add_generation_prompt and not options.continue_final,
      options.template_vars)
  if options.continue_final:
    marked = _cut_after(marked, marks[-1])
  pattern = re.compile(f"\ue000{nonce}\\.(\\d+)\ue001")
  parts = pattern.split(marked)  # template text, index, template text, index, ...
  back = "".join(p if k % 2 == 0 else messages[int(p)]["content"] for k, p in enumerate(parts))
  if back != text:
    raise ValueError("a message's content holds a control token's text and this chat template "
                     "transforms message content, so it cannot be kept as text; remove the "
                     "control text (or start the server with --special_tokens_in_messages)")
  ids: list[int] = []
  for k, p in enumerate(parts):
    if k % 2 == 0:
      ids += tok.encode(p) if p else []
    else:
      ids += tok.encode_plain(messages[int(p)]["content"])
  return ids
