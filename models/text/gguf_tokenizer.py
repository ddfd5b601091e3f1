"""The tokenizer a GGUF file describes in its metadata (llama.cpp's ``tokenizer.*`` keys).

Contract:
  * ``load_gguf_tokenizer(path) -> GGUFTokenizer``; ``gguf_tokenizer_from_reader(reader, name)``
    reuses an open ``GGUFFile`` (the header is parsed once); the two steps are
    ``read_gguf_vocab(reader) -> GGUFVocab`` and ``build_tokenizer(vocab) -> tokenizers.Tokenizer``.
  * Only ``tokenizer.ggml.model = gpt2`` (byte-level BPE) is supported, with the pre-tokenizers
    named by ``tokenizer.ggml.pre`` that llama.cpp knows (``default``, ``gpt2``, and the
    digit-splitting ``smollm`` family); anything else is a ``ValueError``.
  * CONTROL and UNKNOWN tokens are special (matched whole, dropped by ``decode``); USER_DEFINED
    tokens are matched whole and kept.
  * ``bos_id`` is set only when ``tokenizer.ggml.add_bos_token`` is true; ``eos_ids`` is the eos
    id, then eot / eom, then well-known end tokens (``END_TOKEN_NAMES``); none is a ValueError.
    ``chat_template`` is ``tokenizer.chat_template`` (None when absent).
A missing file is ``FileNotFoundError``; anything unreadable or unsupported is a ``ValueError``
naming the file and key. Details: BUILD_NOTES "Design: Tokenizers and chat templates".
"""

from __future__ import annotations

import dataclasses
import os

import gguf
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from models.io.gguf_file import GGUFFile
from models.text.tokenizer import TokenizersTokenizer, bytes_to_unicode

TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone")
PLAIN_PRE = ("default", "gpt2", "gpt-2")
SUPPORTED_PRE = DIGIT_SPLIT_PRE + PLAIN_PRE
END_TOKEN_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
                   "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
                   "<|end_of_text|>", "<end_of_utterance>", "</s>", "<eos>")

_K = "tokenizer.ggml."
_CHAT_TEMPLATE = "tokenizer.chat_template"


@dataclasses.dataclass(frozen=True)
class GGUFVocab:
  """The tokenizer metadata of one GGUF file (ids are None when the key is absent)."""

  model: str
  pre: str
  tokens: tuple[str, ...]
  token_types: tuple[int, ...]  # empty when the file has no token_type array
  merges: tuple[str, ...]
  bos_id: int | None
  eos_id: int | None
  eot_id: int | None
  eom_id: int | None
  add_bos: bool
  add_space_prefix: bool
  chat_template: str | None
  name: str = "gguf"


class GGUFTokenizer(TokenizersTokenizer):
  """A ``TokenizersTokenizer`` built from GGUF metadata; see the module contract."""

  def __init__(self, vocab: GGUFVocab):
    tok = build_tokenizer(vocab)
    eos_ids = _end_ids(vocab)
    bos_id = None
    if vocab.add_bos:
      if vocab.bos_id is None:
        raise ValueError(f"{vocab.name}: {_K}add_bos_token is true but there is no "
                         f"{_K}bos_token_id")
      bos_id = vocab.bos_id
    super().__init__(
        tok, bos_id=bos_id, eos_ids=eos_ids, chat_template=vocab.chat_template,
        bos_token=None if vocab.bos_id is None else vocab.tokens[vocab.bos_id],
        eos_token=vocab.tokens[eos_ids[0]], name=vocab.name)
    self.path = vocab.name
    self.pre = vocab.pre

  def __repr__(self) -> str:
    return f"GGUFTokenizer({self.path!r})"


def load_gguf_tokenizer(path: str | os.PathLike[str]) -> GGUFTokenizer:
  """The tokenizer of the GGUF file at ``path``."""
  name = os.fspath(path)
  if not os.path.isfile(name):
    raise FileNotFoundError(f"GGUF file {name!r} not found")
  try:
    reader = GGUFFile(name)
  except Exception as e:  # the reader raises ValueError / IndexError / OSError on bad files
    raise ValueError(f"{name}: not a readable GGUF file ({type(e).__name__}: {e})") from None
  return gguf_tokenizer_from_reader(reader, name)


def gguf_tokenizer_from_reader(reader: GGUFFile, name: str = "gguf") -> GGUFTokenizer:
  """The tokenizer described by an open reader's metadata; ``name`` labels errors."""
  return GGUFTokenizer(read_gguf_vocab(reader, name))


def _value(reader: GGUFFile, key: str) -> object:
  field = reader.fields.get(key)
  if field is None:
    return None
  if field.types == [gguf.GGUFValueType.ARRAY]:  # an empty array has no element type
    return []
  return field.contents()


def _int_or_none(reader: GGUFFile, key: str, name: str) -> int | None:
  value = _value(reader, key)
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int):
    raise ValueError(f"{name}: {key} must be an integer, got {value!r}")
  return int(value)


def _str_or_none(reader: GGUFFile, key: str, name: str) -> str | None:
  value = _value(reader, key)
  if value is not None and not isinstance(value, str):
    raise ValueError(f"{name}: {key} must be a string, got {type(value).__name__}")
  return value


def _bool(reader: GGUFFile, key: str, name: str, default: bool) -> bool:
  value = _value(reader, key)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise ValueError(f"{name}: {key} must be a bool, got {value!r}")
  return value


def _array(reader: GGUFFile, key: str, name: str, kind: type[str] | type[int]
           ) -> list[str] | list[int] | None:
  value = _value(reader, key)
  if value is None:
    return None
  if not isinstance(value, list) or not all(
      isinstance(v, kind) and not isinstance(v, bool) for v in value):
    raise ValueError(f"{name}: {key} must be an array of {kind.__name__}")
  return value


def _strings(reader: GGUFFile, key: str, name: str) -> tuple[str, ...] | None:
  value = _array(reader, key, name, str)
  return None if value is None else tuple(str(v) for v in value)


def _ints(reader: GGUFFile, key: str, name: str) -> tuple[int, ...] | None:
  value = _array(reader, key, name, int)
  return None if value is None else tuple(int(v) for v in value)


def read_gguf_vocab(reader: GGUFFile, name: str = "gguf") -> GGUFVocab:
  """The tokenizer metadata of an open GGUF file; ValueError when a key is missing or bad."""
  model = _str_or_none(reader, _K + "model", name)
  if model is None:
    raise ValueError(f"{name}: no {_K}model (the file carries no tokenizer)")
  if model != "gpt2":
    what = "SentencePiece (llama) tokenizers are" if model == "llama" else \
        f"tokenizer.ggml.model {model!r} is"
    raise ValueError(f"{name}: {what} not supported yet (supported: 'gpt2', byte-level BPE)")
  tokens = _strings(reader, _K + "tokens", name)
  if not tokens:
    raise ValueError(f"{name}: no {_K}tokens")
  merges = _strings(reader, _K + "merges", name)
  if merges is None:
    raise ValueError(f"{name}: a gpt2 (BPE) tokenizer needs {_K}merges")
  types = _ints(reader, _K + "token_type", name) or ()
  if types and len(types) != len(tokens):
    raise ValueError(f"{name}: {_K}token_type has {len(types)} entries for {len(tokens)} tokens")
  vocab = GGUFVocab(
      model=model, pre=_str_or_none(reader, _K + "pre", name) or "default", tokens=tokens,
      token_types=types, merges=merges,
      bos_id=_int_or_none(reader, _K + "bos_token_id", name),
      eos_id=_int_or_none(reader, _K + "eos_token_id", name),
      eot_id=_int_or_none(reader, _K + "eot_token_id", name),
      eom_id=_int_or_none(reader, _K + "eom_token_id", name),
      add_bos=_bool(reader, _K + "add_bos_token", name, False),
      add_space_prefix=_bool(reader, _K + "add_space_prefix", name, False),
      chat_template=_str_or_none(reader, _CHAT_TEMPLATE, name), name=name)
  for key, i in (("bos", vocab.bos_id), ("eos", vocab.eos_id), ("eot", vocab.eot_id),
                 ("eom", vocab.eom_id)):
    if i is not None and not 0 <= i < len(tokens):
      raise ValueError(f"{name}: {_K}{key}_token_id {i} is outside the vocab [0, {len(tokens)})")
  return vocab


def _pre_tokenizer(vocab: GGUFVocab) -> pre_tokenizers.PreTokenizer:
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if vocab.pre in DIGIT_SPLIT_PRE:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  if vocab.pre in PLAIN_PRE:
    return byte_level
  raise ValueError(f"{vocab.name}: unsupported {_K}pre {vocab.pre!r} (supported: "
                   f"{', '.join(SUPPORTED_PRE)})")


def _byte_spelling(token: str, alphabet: dict[int, str]) -> str:
  return "".join(alphabet[b] for b in token.encode("utf-8"))


def build_tokenizer(vocab: GGUFVocab) -> tokenizers.Tokenizer:
  """The ``tokenizers`` byte-level BPE tokenizer that ``vocab`` describes."""
  if vocab.add_space_prefix:
    raise ValueError(f"{vocab.name}: {_K}add_space_prefix with a byte-level BPE vocab is not "
                     "supported")
  pre = _pre_tokenizer(vocab)
  byte_to_char = bytes_to_unicode()
  alphabet = set(byte_to_char.values())
  types = vocab.token_types or (TOKEN_NORMAL,) * len(vocab.tokens)
  ids: dict[str, int] = {}
  special: list[tokenizers.AddedToken] = []
  user: list[tokenizers.AddedToken] = []
  for i, (token, kind) in enumerate(zip(vocab.tokens, types)):
    if not token:
      token = f"[EMPTY_{i}]"
    if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN):
      special.append(tokenizers.AddedToken(token, special=True, normalized=False))
    elif kind == TOKEN_USER_DEFINED:
      user.append(tokenizers.AddedToken(token, special=False, normalized=False))
    elif not set(token) <= alphabet:
      token = _byte_spelling(token, byte_to_char)
    if token in ids:
      raise ValueError(f"{vocab.name}: token {token!r} appears twice (ids {ids[token]} and {i})")
    ids[token] = i
  merges: list[tuple[str, str]] = []
  for m in vocab.merges:
    parts = m.split(" ")
    if len(parts) != 2 or not all(parts):
      raise ValueError(f"{vocab.name}: bad merge {m!r} in {_K}merges (want 'left right')")
    merges.append((parts[0], parts[1]))
  try:
    bpe = models.BPE(vocab=ids, merges=merges, fuse_unk=False, byte_fallback=False)
  except Exception as e:  # the Rust side raises plain Exception (e.g. a merge of unknown tokens)
    raise ValueError(f"{vocab.name}: cannot build the BPE model: {e}") from None
  tok = tokenizers.Tokenizer(bpe)
  tok.pre_tokenizer = pre
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(special)
  tok.add_tokens(user)
  for added in (*special, *user):
    if tok.token_to_id(added.content) != ids[added.content]:  # added tokens reuse vocab ids
      raise ValueError(f"{vocab.name}: added token {added.content!r} did not keep its id")
  if tok.get_vocab_size(with_added_tokens=True) != len(vocab.tokens):
    raise ValueError(f"{vocab.name}: built {tok.get_vocab_size(with_added_tokens=True)} ids for "
                     f"{len(vocab.tokens)} tokens")
  return tok


def _end_ids(vocab: GGUFVocab) -> tuple[int, ...]:
  ids = [i for i in (vocab.eos_id, vocab.eot_id, vocab.eom_id) if i is not None]
  by_name = [i for i, t in enumerate(vocab.tokens) if t in END_TOKEN_NAMES]
  names = {vocab.tokens[i] for i in by_name}
  if {"<|return|>", "<|call|>", "<|end|>"} <= names:  # o200k_harmony: <|end|> ends a message only
    by_name = [i for i in by_name if vocab.tokens[i] != "<|end|>"]
  out = tuple(dict.fromkeys(ids + by_name))
  if not out:
    raise ValueError(f"{vocab.name}: no {_K}eos_token_id and none of the usual end tokens "
                     f"({', '.join(END_TOKEN_NAMES)}) is in the vocab")
  return out
