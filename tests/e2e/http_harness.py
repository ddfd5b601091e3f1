"""What the OpenAI HTTP tests share: the tiny chat model on disk (byte-level BPE tokenizer with
three special tokens and a chat template in transformers' style), a server with ``KEY`` and an
HTTP port (``served``), the official client on it (``client``), and plain HTTP / server-sent
event requests to a ``ServerProc``'s HTTP port."""

from __future__ import annotations

import contextlib
import http.client
import json
from typing import Iterator

import jax

from models.config import get_preset
from models.text.tokenizer import bytes_to_unicode
from models.weights import init_params
from tests.grpc_harness import ServerProc

MODEL = "tiny-chat"
KEY = "sk-test"
VOCAB = 259
# Exercises what transformers' environment does: trim_blocks / lstrip_blocks on a multi-line
# template, bos_token / eos_token, filters, loop variables, namespace, raise_exception.
TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(turns=0) %}
{% if messages[0]['role'] != 'system' %}
<|im_start|>system
You are a test model.<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'user' %}{% set ns.turns = ns.turns + 1 %}{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}
{%- if loop.last and message['role'] == 'assistant' %}{{ eos_token }}{% endif %}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant (turn {{ ns.turns }})
{% endif %}"""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 256, 257, 258


def write_model(directory) -> None:
  """The tiny preset (param seed 0) as a checkpoint, with a byte-level BPE tokenizer (id = byte,
  no merges, three special tokens: 259 ids, the preset's vocab) and a chat template."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers
  from models.io.checkpoint import save_params
  cfg = get_preset("tiny")
  save_params(str(directory), init_params(cfg, jax.random.key(0)), cfg.replace(name=MODEL))
  chars = bytes_to_unicode()
  tok = tokenizers.Tokenizer(models.BPE({chars[b]: b for b in range(256)}, []))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(SPECIALS)
  assert tok.get_vocab_size() == VOCAB
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
      "eos_token": "<|im_end|>", "add_bos_token": False, "model_max_length": 128,
      "chat_template": TEMPLATE}))



def request(s: ServerProc, method: str, path: str, body=None, key: str | None = KEY,
             raw: bytes | None = None, headers: dict | None = None):
  """(status, headers, JSON body or text) of one plain HTTP request."""
  conn = http.client.HTTPConnection("127.0.0.1", s.http_port, timeout=60)
  try:
    h = dict(headers or {})
    if key:
      h["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    if data is not None:
      h["Content-Type"] = "application/json"
    conn.request(method, path, body=data, headers=h)
    r = conn.getresponse()
    text = r.read().decode()
    try:
      out = json.loads(text)
    except json.JSONDecodeError:
      out = text
    return r.status, dict(r.getheaders()), out
  finally:
    conn.close()


def sse(s: ServerProc, path: str, body: dict, headers: dict | None = None):
  """(status, [event objects], done) of a streamed request read to its end."""
  conn = http.client.HTTPConnection("127.0.0.1", s.http_port, timeout=60)
  try:
    conn.request("POST", path, body=json.dumps(dict(body, stream=True)).encode(),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
                          **(headers or {})})
    r = conn.getresponse()
    if r.status != 200:
      return r.status, [json.loads(r.read())], False
    assert r.getheader("Content-Type").startswith("text/event-stream")
    events, done = [], False
    for line in r:
      line = line.decode().rstrip("\n")
      if not line:
        continue
      assert line.startswith("data: ") and not done, line
      if line == "data: [DONE]":
        done = True
      else:
        events.append(json.loads(line[6:]))
    return r.status, events, done
  finally:
    conn.close()



def is_error(body, status_type: str | None = None) -> bool:
  e = body.get("error") if isinstance(body, dict) else None
  return (isinstance(e, dict) and set(e) == {"message", "type", "param", "code"} and
          isinstance(e["message"], str) and (status_type is None or e["type"] == status_type))


@contextlib.contextmanager
def served(tmp, *flags: str, keys: dict | None = None, **start) -> Iterator[ServerProc]:
  """launch.server with ``flags``, HTTP on a free port and ``KEY`` its API key (with ``keys``,
  more: key -> info; ``start``: more of ``ServerProc.start``'s arguments); stopped (and its exit
  checked) when the block ends."""
  (tmp / "keys.json").write_text(json.dumps({KEY: {"name": "test"}, **(keys or {})}))
  s = ServerProc.start(tmp, *flags, "--http_port", "0", "--api_keys", str(tmp / "keys.json"),
                       "--grace_s", "2", **start)
  try:
    yield s
  finally:
    assert s.stop() in (0,), s.log()


def client(s: ServerProc, timeout: float = 60):
  import openai
  return openai.OpenAI(base_url=f"http://127.0.0.1:{s.http_port}/v1", api_key=KEY,
                       max_retries=0, timeout=timeout)
