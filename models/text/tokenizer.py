"""Tokenizers: text <-> token ids for the serving loop, plus streaming (incremental) decode.

Contract:
  * ``Tokenizer`` (ABC): ``encode(text)`` never adds special tokens (callers prepend ``bos_id``
    when not None); ``decode(ids)`` drops special and unknown ids and never raises on invalid
    UTF-8; ``vocab_size``, ``bos_id``, ``eos_id`` / ``eos_ids``, ``token_bytes(id)``;
    ``chat_template``, ``apply_chat_template(messages)`` and ``encode_chat`` (no BOS prepended:
    the template writes its special tokens; message content never becomes control ids unless
    ``ChatOptions.special_in_content``: ``models.text.chat_encode``); a tokenizer without a
    template is a ``ValueError``. ``control_texts`` / ``encode_plain(text)``: the special tokens'
    texts, and ``text`` encoded with those split as plain text.
  * Implementations: ``ByteTokenizer`` (the random presets: bytes 0..255, BOS 256, EOS 257, PAD
    258), ``TokenizersTokenizer`` (an in-memory ``tokenizers.Tokenizer``, used for GGUF files),
    ``HFTokenizer`` (a Hugging Face ``tokenizer.json`` with its config files).
  * ``StreamDecoder(tokenizer, keep_special=False)``: ``push(id)`` returns only newly completed
    text (never a partial UTF-8 character), ``flush()`` the rest; ``keep_special``: special
    tokens' texts too (``decode_all``).
  * ``load_tokenizer(name_or_path)``: a preset name -> ``ByteTokenizer``; a directory with
    ``tokenizer.json`` (or the file) -> ``HFTokenizer``; anything else -> ``ValueError``.
Where HF ids, BOS and the template come from: BUILD_NOTES "Design: Tokenizers and chat templates".
"""

from __future__ import annotations

import abc
import functools
import json
import os
from typing import Iterable, Iterator, Mapping, Sequence

import tokenizers

from models.text.chat_encode import ChatOptions, encode_chat
from models.text.chat_template import DEFAULT_CHAT_TEMPLATE, ChatMessage, render_chat_template
from models.config import PRESET_NAMES, get_preset

_REPLACEMENT = "\ufffd"
# A UTF-8 character has at most 4 bytes, so at most 4 (byte-level) tokens; once more are pending
# and the text still ends in U+FFFD, the bytes are invalid rather than incomplete.
_MAX_PENDING = 4


class Tokenizer(abc.ABC):
  """Text <-> ids; see the module contract."""

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    ...

  @abc.abstractmethod
  def decode(self, ids: Iterable[int]) -> str:
    ...

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    ...

  def token_bytes(self, token_id: int) -> bytes:
    """The token's bytes (may be part of a character; b"" for a special or unknown id)."""
    return self.decode([token_id]).encode("utf-8")

  def decode_all(self, ids: Iterable[int]) -> str:
    """``decode`` keeping the special tokens' texts (vLLM's ``skip_special_tokens: false``)."""
    return self.decode(ids)

  @property
  @abc.abstractmethod
  def bos_id(self) -> int | None:
    ...

  @property
  @abc.abstractmethod
  def eos_id(self) -> int:
    ...

  @property
  def eos_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)

  @property
  def chat_template(self) -> str | None:
    return None

  @property
  def bos_token(self) -> str | None:
    """The bos token's text as a chat template sees it (None: the variable is left undefined)."""
    return None

  @property
  def eos_token(self) -> str | None:
    return None

  @property
  def control_texts(self) -> tuple[str, ...]:
    """The texts ``encode`` turns into control (special) ids wherever they occur."""
    return ()

  def encode_plain(self, text: str) -> list[int]:
    """``text`` as text: a control token's text in it is split like any other text."""
    return self.encode(text)

  def apply_chat_template(self, messages: Sequence[ChatMessage],
                          add_generation_prompt: bool = True,
                          template_vars: Mapping[str, object] | None = None) -> str:
    """``messages`` rendered with this tokenizer's chat template; ValueError without one."""
    template = self.chat_template
    if template is None:
      raise ValueError(f"{self!r} has no chat template")
    return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                bos_token=self.bos_token, eos_token=self.eos_token,
                                template_vars=template_vars)

  def encode_chat(self, messages: Sequence[ChatMessage],
                  options: ChatOptions = ChatOptions()) -> list[int]:
    """The chat's ids, control ids only from the template (``models.text.chat_encode``);
    ``bos_id`` is not prepended."""
    return encode_chat(self, messages, options)


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes as ids 0..255, then bos / eos / pad."""

  BOS = 256
  EOS = 257
  PAD = 258
  VOCAB_SIZE = 259

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Iterable[int]) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

  def token_bytes(self, token_id: int) -> bytes:
    return bytes([token_id]) if 0 <= token_id < 256 else b""

  @property
  def vocab_size(self) -> int:
    return self.VOCAB_SIZE

  @property
  def bos_id(self) -> int:
    return self.BOS

  @property
  def eos_id(self) -> int:
    return self.EOS

  @property
  def pad_id(self) -> int:
    return self.PAD

  @property
  def chat_template(self) -> str:
    return DEFAULT_CHAT_TEMPLATE

  def __repr__(self) -> str:
    return "ByteTokenizer()"


_JSON = Mapping[str, object]
_EOS_NAMES = ("</s>", "<eos>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>")


def _read_json(path: str) -> _JSON:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  if not isinstance(data, dict):
    raise ValueError(f"{path} is not a JSON object")
  return data


def _as_ids(value: object) -> tuple[int, ...]:
  if isinstance(value, bool):
    return ()
  if isinstance(value, int):
    return (value,)
  if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                     for v in value):
    return tuple(value)
  return ()


def _token_name(value: object) -> str | None:
  if isinstance(value, str):
    return value
  if isinstance(value, dict) and isinstance(value.get("content"), str):
    return str(value["content"])
  return None


class TokenizersTokenizer(Tokenizer):
  """An in-memory ``tokenizers.Tokenizer`` with explicitly given special ids and chat template."""

  def __init__(self, tok: tokenizers.Tokenizer, *, bos_id: int | None, eos_ids: Sequence[int],
               chat_template: str | None = None, bos_token: str | None = None,
               eos_token: str | None = None, name: str = "tokenizers"):
    self._tok = tok
    self.name = name
    eos = tuple(dict.fromkeys(int(i) for i in eos_ids))
    if not eos:
      raise ValueError(f"{name}: no eos id")
    if min(eos) < 0 or (bos_id is not None and bos_id < 0):
      raise ValueError(f"{name}: negative special id (bos {bos_id}, eos {eos})")
    self._bos_id = None if bos_id is None else int(bos_id)
    self._eos_ids = eos
    self._chat_template = chat_template
    self._bos_token = bos_token if bos_token is not None else (
        None if bos_id is None else tok.id_to_token(bos_id))
    self._eos_token = eos_token if eos_token is not None else tok.id_to_token(eos[0])

  def encode(self, text: str) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  @functools.cached_property
  def control_texts(self) -> tuple[str, ...]:
    added = self._tok.get_added_tokens_decoder().values()
    return tuple(sorted({t.content for t in added if t.special}, key=len, reverse=True))

  @functools.cached_property
  def _plain(self) -> tokenizers.Tokenizer:
    """A copy that splits special tokens' texts like other text (never mutates ``_tok``)."""
    tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
    tok.encode_special_tokens = True
    return tok

  def encode_plain(self, text: str) -> list[int]:
    return list(self._plain.encode(text, add_special_tokens=False).ids)

  def decode(self, ids: Iterable[int]) -> str:
    size = self.vocab_size
    return self._tok.decode([i for i in ids if 0 <= i < size], skip_special_tokens=True)

  def decode_all(self, ids: Iterable[int]) -> str:
    size = self.vocab_size
    return self._tok.decode([i for i in ids if 0 <= i < size], skip_special_tokens=False)

  def token_bytes(self, token_id: int) -> bytes:
    """The piece's bytes: byte-level BPE (GPT-2's alphabet) spelled back, SentencePiece's
    ``<0xNN>`` byte tokens and ``▁`` spaces; b"" for a special token or an unknown id."""
    if not 0 <= token_id < self.vocab_size or self.decode([token_id]) == "":
      return b""
    piece = self._tok.id_to_token(token_id)
    if piece is None:
      return b""
    if self._byte_level:
      back = _byte_level_decoder()
      if all(ch in back for ch in piece):
        return bytes(back[ch] for ch in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
      try:
        return bytes([int(piece[3:5], 16)])
      except ValueError:
        pass
    return piece.replace("\u2581", " ").encode("utf-8")

  @functools.cached_property
  def _byte_level(self) -> bool:
    """Whether the decoder is (or chains) GPT-2's ByteLevel: pieces spell bytes."""
    decoder = json.loads(self._tok.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [])} | {decoder.get("type")}
    return "ByteLevel" in kinds

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  @property
  def eos_id(self) -> int:
    return self._eos_ids[0]

  @property
  def eos_ids(self) -> tuple[int, ...]:
    return self._eos_ids

  @property
  def chat_template(self) -> str | None:
    return self._chat_template

  @property
  def bos_token(self) -> str | None:
    return self._bos_token

  @property
  def eos_token(self) -> str | None:
    return self._eos_token

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The wrapped ``tokenizers.Tokenizer`` (do not mutate it)."""
    return self._tok

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.name!r})"


def _chat_template_in(directory: str, tok_cfg: _JSON) -> str | None:
  path = os.path.join(directory, "chat_template.jinja")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return f.read()
  value = tok_cfg.get("chat_template")
  if isinstance(value, str):
    return value
  if isinstance(value, list):
    for entry in value:
      if (isinstance(entry, dict) and entry.get("name") == "default"
          and isinstance(entry.get("template"), str)):
        return str(entry["template"])
  return None


class HFTokenizer(TokenizersTokenizer):
  """A Hugging Face ``tokenizers`` tokenizer.json with eos / bos from the checkpoint's configs."""

  def __init__(self, tokenizer_json: str | os.PathLike[str]):
    path = os.fspath(tokenizer_json)
    try:
      tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises plain Exception for unreadable / bad files
      raise ValueError(f"cannot load tokenizer {path}: {e}") from None
    self._tok = tok
    self.path = path
    directory = os.path.dirname(os.path.abspath(path))
    configs = [_read_json(os.path.join(directory, name))
               for name in ("generation_config.json", "config.json")]
    tok_cfg = _read_json(os.path.join(directory, "tokenizer_config.json"))
    eos_ids = self._find_ids("eos", configs, tok_cfg)
    if not eos_ids:
      eos_ids = tuple(i for i in map(tok.token_to_id, _EOS_NAMES) if i is not None)[:1]
    if not eos_ids:
      raise ValueError(f"{path}: no eos token in generation_config.json, config.json or "
                       "tokenizer_config.json, and none of the usual names is in the vocab")
    bos_ids = self._find_ids("bos", configs, tok_cfg)
    added = self._prepended_ids()
    add_bos = tok_cfg.get("add_bos_token")
    if isinstance(add_bos, bool):
      bos_id = (bos_ids or added or (None,))[0] if add_bos else None
    else:
      bos_id = added[0] if added else None
    bos_any = (bos_ids or added or (None,))[0]
    super().__init__(
        tok, bos_id=bos_id, eos_ids=eos_ids,
        chat_template=_chat_template_in(directory, tok_cfg),
        bos_token=_token_name(tok_cfg.get("bos_token")) or (
            None if bos_any is None else tok.id_to_token(bos_any)),
        eos_token=_token_name(tok_cfg.get("eos_token")), name=path)

  def _find_ids(self, kind: str, configs: list[_JSON], tok_cfg: _JSON) -> tuple[int, ...]:
    for cfg in configs:
      ids = _as_ids(cfg.get(f"{kind}_token_id"))
      if ids:
        return ids
    name = _token_name(tok_cfg.get(f"{kind}_token"))
    found = self._tok.token_to_id(name) if name is not None else None
    return (found,) if found is not None else ()

  def _prepended_ids(self) -> tuple[int, ...]:
    """Ids the tokenizer's post-processor puts before a sequence (e.g. Llama's ``<s>``)."""
    plain = self._tok.encode("a", add_special_tokens=False).ids
    full = self._tok.encode("a", add_special_tokens=True).ids
    n = len(full) - len(plain)
    if n > 0 and full[n:n + len(plain)] == plain:
      return tuple(full[:n])
    return ()

  def __repr__(self) -> str:
    return f"HFTokenizer({self.path!r})"


def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table (the ByteLevel alphabet)."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
               *range(ord("\xae"), ord("\xff") + 1)]
  table = {b: chr(b) for b in printable}
  n = 0
  for b in range(256):
    if b not in table:
      table[b] = chr(256 + n)
      n += 1
  return table


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
  return {c: b for b, c in bytes_to_unicode().items()}


class StreamDecoder:
  """Turns ids arriving one at a time into text, emitting only complete characters.

  Keeps a small window: ids already emitted once (for context, so a tokenizer that drops a
  leading space decodes the next word correctly) and ids not yet emitted.
  """

  def __init__(self, tokenizer: Tokenizer, keep_special: bool = False):
    self._decode = tokenizer.decode_all if keep_special else tokenizer.decode
    self._ids: list[int] = []
    self._prefix = 0  # start of the context window
    self._read = 0  # ids before this have been emitted

  def push(self, token_id: int) -> str:
    """Adds one id; returns the text it completes ('' while a character is still partial)."""
    self._ids.append(int(token_id))
    prefix_text = self._decode(self._ids[self._prefix:self._read])
    text = self._decode(self._ids[self._prefix:])
    pending = len(self._ids) - self._read
    if len(text) <= len(prefix_text):
      return ""
    if text.endswith(_REPLACEMENT) and pending < _MAX_PENDING:
      return ""
    del self._ids[:self._read]
    self._prefix, self._read = 0, len(self._ids)
    return text[len(prefix_text):]

  def flush(self) -> str:
    """Returns whatever is left (incomplete bytes as U+FFFD) and resets."""
    prefix_text = self._decode(self._ids[self._prefix:self._read])
    text = self._decode(self._ids[self._prefix:])
    self._ids, self._prefix, self._read = [], 0, 0
    return text[len(prefix_text):]


def stream_decode(tokenizer: Tokenizer, ids: Iterable[int]) -> Iterator[str]:
  """Yields non-empty text chunks as ``ids`` arrive; concatenated they equal ``decode(ids)``
  (for any tokenizer whose decode of a sequence is the concatenation of its pieces)."""
  decoder = StreamDecoder(tokenizer)
  for i in ids:
    chunk = decoder.push(i)
    if chunk:
      yield chunk
  rest = decoder.flush()
  if rest:
    yield rest


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> Tokenizer:
  """A preset name -> ``ByteTokenizer``; a tokenizer.json or a directory with one ->
  ``HFTokenizer``."""
  name = os.fspath(name_or_path)
  if name in PRESET_NAMES:
    vocab = get_preset(name).vocab_size
    if vocab < ByteTokenizer.VOCAB_SIZE:
      raise ValueError(f"preset {name!r} has vocab {vocab} < {ByteTokenizer.VOCAB_SIZE} byte ids")
    return ByteTokenizer()
  if os.path.isdir(name):
    path = os.path.join(name, "tokenizer.json")
    if not os.path.isfile(path):
      raise ValueError(f"{name} has no tokenizer.json (only Hugging Face tokenizer.json "
                       "tokenizers are supported)")
    return HFTokenizer(path)
  if os.path.isfile(name) and name.endswith(".json"):
    return HFTokenizer(name)
  raise ValueError(f"{name!r} is neither a model preset ({', '.join(PRESET_NAMES)}) nor a "
                   "directory containing tokenizer.json")
