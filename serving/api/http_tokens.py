"""vLLM's helper routes as protocol logic: ``/tokenize`` and ``/detokenize`` bodies in and out.

Contract (shapes as vLLM's server answers them):
  * ``tokenize(body, served, tokenizer, limits) -> dict``: ``{prompt, add_special_tokens = true}``
    (BOS when the tokenizer has one) or ``{messages, add_generation_prompt = true,
    continue_final_message, chat_template_kwargs}`` (the chat as ``/v1/chat/completions``
    renders it, control ids only from the template); ``return_token_strs`` adds each token's
    text. Answer ``{count, max_model_len, tokens, token_strs}``.
  * ``detokenize(body, served, tokenizer) -> {prompt}``: ids outside the vocabulary are a 400.
  * A bad field is a 400 naming it (``serving.api.http_errors``); ``model`` as in generation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from models.text.tokenizer import Tokenizer
from serving.api import http_api
from serving.api.http_errors import ApiError, bad
from serving.api.validation import InvalidArgument, Limits, chat_messages

_TOKENIZE_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs",
                              "messages", "add_generation_prompt", "continue_final_message",
                              "chat_template_kwargs"})


def _body(body: object, served: http_api.Served, allowed: frozenset[str]) -> Mapping[str, Any]:
  if not isinstance(body, dict):
    raise ApiError(400, "the request body must be a JSON object")
  http_api.check_model(body, served)
  extra = sorted(set(body) - allowed)
  if extra:
    raise bad(extra[0], "unknown field")
  return body


def tokenize(body: object, served: http_api.Served, tok: Tokenizer,
             limits: Limits) -> dict[str, Any]:
  b = _body(body, served, _TOKENIZE_FIELDS)
  strs = http_api.get_bool(b, "return_token_strs")
  if "messages" in b and "prompt" in b:
    raise bad("prompt", "give prompt or messages, not both")
  if b.get("messages") is not None:
    msgs = b["messages"]
    if not isinstance(msgs, list):
      raise bad("messages", "must be a list of {role, content}")
    chat = [http_api.message(i, m, []) for i, m in enumerate(msgs)]
    options = http_api.chat_options(b)
    if limits.special_in_messages:
      options = dataclasses.replace(options, special_in_content=True)
    try:
      ids = tok.encode_chat(chat_messages(chat), options)
    except InvalidArgument as e:
      raise bad("messages", e.message) from None
    except ValueError as e:
      raise bad("messages", f"the chat template failed: {e}") from None
  else:
    prompt = b.get("prompt")
    if not isinstance(prompt, str):
      raise bad("prompt", "required: a string (or give messages)")
    ids = tok.encode(prompt)
    if http_api.get_bool(b, "add_special_tokens") is not False and tok.bos_id is not None:
      ids = [tok.bos_id] + ids
  return {"count": len(ids), "max_model_len": limits.max_context, "tokens": ids,
          "token_strs": [tok.decode([t]) for t in ids] if strs else None}


def detokenize(body: object, served: http_api.Served, tok: Tokenizer) -> dict[str, Any]:
  b = _body(body, served, frozenset({"model", "tokens"}))
  ids = b.get("tokens")
  if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in ids)):
    raise bad("tokens", "required: a list of token ids")
  wrong = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
  if wrong is not None:
    raise bad("tokens", f"token id {wrong} is outside the vocabulary [0, {tok.vocab_size})")
  return {"prompt": tok.decode(ids)}
