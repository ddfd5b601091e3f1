"""Grammar engine for structured outputs: compile a ``Grammar`` once, match it per request.

Contract:
  * Backend: llguidance (BUILD_NOTES "Grammar engine for structured outputs": why, and the
    measurements). It is reached only through this module.
  * ``GrammarCompiler(tokenizer, cache_size=256, threads=None)``: bound to one ``Tokenizer``
    (its ``token_bytes`` spell the vocabulary; ids with no bytes are special; ``eos_ids`` end a
    grammar). Built once at server start (SmolLM2's 49,152 ids: ~0.4 s, see BUILD_NOTES).
    ``compile(spec) -> CompiledGrammar`` checks and builds a grammar, raising
    ``GrammarSpecError`` (a ``ValueError`` naming ``spec.field``) when the schema / regex /
    grammar is invalid or unsupported; results are kept in a thread-safe LRU of ``cache_size``
    entries keyed by the spec (an equal spec returns the same object). ``matcher(spec)`` (a
    ``Grammar`` or a ``CompiledGrammar``) -> a fresh ``Matcher`` (a copy of the compiled
    template: microseconds). ``fill_rows(mask_RW, rows)`` fills several matchers' rows in one
    call on the library's thread pool; rows not named are left untouched.
  * ``Matcher`` (one request; not thread-safe): ``fill(mask_W)`` writes the allowed-token
    bitmask (``serving.token_mask`` layout; ``mask_W`` int32, C-contiguous, at least
    ``words`` long: words past the tokenizer's vocab are zeroed), without changing the state;
    ``accept(token_id) -> bool``: False when the token is not allowed (then the matcher is in an
    error state for good, ``error()`` says why, and the caller ends the request with an error);
    an eos id is allowed exactly when ``is_accepting()`` (the text so far is complete), and
    accepting one terminates the matcher. ``is_terminated()``: nothing but eos can follow (the
    grammar cannot be extended, or eos was accepted): the caller may finish the request
    without sampling again. After termination or an error the mask allows the eos ids only.
    ``rollback(n)`` undoes the last ``n`` accepted tokens (speculative decoding; cheap).
  * Mask fill and accept release the GIL in the library, so a host thread can fill the next
    step's masks while the device computes.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from typing import TYPE_CHECKING, Sequence

import llguidance
import numpy as np

from models.text.tokenizer import Tokenizer
from serving.grammar_spec import Grammar, GrammarSpecError
from serving.token_mask import words

if TYPE_CHECKING:
  from llguidance._lib import JsonCompileOptions


class _Vocab:
  """What ``llguidance.TokenizerWrapper`` reads: the ids' bytes, the specials, an encoder."""

  def __init__(self, tokenizer: Tokenizer, tokens: list[bytes]):
    self._tok = tokenizer
    self.eos_token_id = tokenizer.eos_id
    self.bos_token_id = tokenizer.bos_id
    self.tokens = tokens
    self.special_token_ids = [i for i, b in enumerate(tokens) if not b]

  def __call__(self, text: bytes) -> list[int]:
    return self._tok.encode(text.decode("utf-8", errors="replace"))


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledGrammar:
  """A checked grammar and a matcher at its start state (never advanced; copied per request)."""

  spec: Grammar
  grammar: str  # llguidance's serialized grammar
  compile_s: float
  template: llguidance.LLMatcher
  vocab_size: int
  eos_ids: tuple[int, ...]

  def matcher(self) -> Matcher:
    """A fresh matcher at the grammar's start (a copy of the template: microseconds)."""
    return Matcher(self.template.deep_copy(), self.vocab_size, self.eos_ids)


def _serialize(spec: Grammar) -> str:
  """The llguidance grammar text of ``spec`` (GrammarSpecError when it cannot be converted)."""
  if spec.kind in ("json_object", "json_schema"):
    options: JsonCompileOptions = {"whitespace_flexible": spec.any_whitespace,
                                   "lenient": spec.lenient}
    if spec.whitespace_pattern is not None:
      options["whitespace_pattern"] = spec.whitespace_pattern
    schema = spec.source if spec.kind == "json_schema" else '{"type": "object"}'
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
  if spec.kind == "regex":
    return llguidance.LLMatcher.grammar_from_regex(spec.source)
  if spec.kind == "choice":
    choices = json.loads(spec.source)
    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
  try:
    return llguidance.grammar_from("grammar", spec.source)  # Lark, or GBNF converted to Lark
  except ValueError as e:  # GBNF that does not convert
    raise GrammarSpecError(spec.field or "grammar", f"invalid grammar: {e}") from None


class GrammarCompiler:
  """Compiles ``Grammar`` specs for one tokenizer and makes matchers; see the module contract."""

  def __init__(self, tokenizer: Tokenizer, *, cache_size: int = 256, threads: int | None = None):
    if cache_size < 1:
      raise ValueError(f"cache_size must be >= 1, got {cache_size}")
    start = time.perf_counter()
    self.tokenizer = tokenizer
    self.vocab_size = tokenizer.vocab_size
    self.words = words(self.vocab_size)
    self.eos_ids = tuple(tokenizer.eos_ids)
    tokens = [tokenizer.token_bytes(i) for i in range(self.vocab_size)]
    self._ll_tokenizer = llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Vocab(tokenizer, tokens)), n_vocab=self.vocab_size,
        eos_token=list(self.eos_ids))
    self._executor = llguidance.LLExecutor(threads)
    # errors reach clients: no parser state, no grammar dump in them
    self._limits = llguidance.LLParserLimits(verbose_errors=False)
    self._cache: collections.OrderedDict[Grammar, CompiledGrammar] = collections.OrderedDict()
    self._cache_size = cache_size
    self._lock = threading.Lock()
    self.init_s = time.perf_counter() - start

  def compile(self, spec: Grammar) -> CompiledGrammar:
    """The compiled ``spec``, from the cache when an equal spec was compiled before."""
    with self._lock:
      hit = self._cache.get(spec)
      if hit is not None:
        self._cache.move_to_end(spec)
        return hit
    start = time.perf_counter()
    field = spec.field or spec.kind
    try:
      grammar = _serialize(spec)
    except GrammarSpecError:
      raise
    except ValueError as e:  # grammar_from_json_schema: a source that is not a JSON object
      raise GrammarSpecError(field, str(e)) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, self._ll_tokenizer, limits=self._limits)
    if is_error:
      raise GrammarSpecError(field, f"invalid {spec.kind.replace('_', ' ')}: "
                             f"{messages[0].strip()}")
    template = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0,
                                    limits=self._limits)
    if template.is_error():
      raise GrammarSpecError(field, f"invalid {spec.kind}: {template.get_error()}")
    compiled = CompiledGrammar(spec, grammar, time.perf_counter() - start, template,
                               self.vocab_size, self.eos_ids)
    with self._lock:
      compiled = self._cache.setdefault(spec, compiled)  # a racing compile of it: keep the first
      self._cache.move_to_end(spec)
      while len(self._cache) > self._cache_size:
        self._cache.popitem(last=False)
    return compiled

  def cached(self) -> int:
    """How many compiled grammars the cache holds."""
    with self._lock:
      return len(self._cache)

  def matcher(self, spec: Grammar | CompiledGrammar) -> Matcher:
    """A fresh matcher at the grammar's start (compiling ``spec`` if needed)."""
    compiled = spec if isinstance(spec, CompiledGrammar) else self.compile(spec)
    return compiled.matcher()

  def fill_rows(self, mask_RW: np.ndarray, rows: Sequence[tuple[int, Matcher]]) -> None:
    """Fills row ``r`` of ``mask_RW`` from ``m`` for each ``(r, m)`` in one parallel call."""
    _check_mask(mask_RW, 2, self.words)
    R, W = mask_RW.shape
    idx = [int(r) for r, _ in rows]
    if len(set(idx)) != len(idx) or any(not 0 <= r < R for r in idx):
      raise ValueError(f"rows must be distinct and in [0, {R}): {idx}")
    if not rows:
      return
    pairs = [(m._ll, r) for r, m in rows]
    if W == self.words:
      self._executor.unsafe_compute_mask_ptr(pairs, mask_RW.ctypes.data, 4 * W, R)
      return
    scratch_RW = np.empty((R, self.words), np.int32)
    self._executor.unsafe_compute_mask_ptr(pairs, scratch_RW.ctypes.data, 4 * self.words, R)
    mask_RW[idx, :self.words] = scratch_RW[idx]
    mask_RW[idx, self.words:] = 0


def _check_mask(mask: np.ndarray, ndim: int, W: int) -> None:
  if not (isinstance(mask, np.ndarray) and mask.dtype == np.int32 and mask.ndim == ndim
          and mask.flags["C_CONTIGUOUS"] and mask.flags["WRITEABLE"] and mask.shape[-1] >= W):
    raise ValueError(f"the mask must be a writable C-contiguous int32 array of {ndim} dims "
                     f"with at least {W} words per row")


class Matcher:
  """One request's position in its grammar; see the module contract."""

  def __init__(self, ll: llguidance.LLMatcher, vocab_size: int, eos_ids: tuple[int, ...]):
    self._ll = ll
    self.vocab_size = vocab_size
    self.words = words(vocab_size)
    self.eos_ids = eos_ids

  def fill(self, mask_W: np.ndarray) -> None:
    """Writes the allowed tokens of the next step into ``mask_W``."""
    _check_mask(mask_W, 1, self.words)
    self._ll.unsafe_compute_mask_ptr(mask_W.ctypes.data, 4 * self.words)
    mask_W[self.words:] = 0

  def accept(self, token_id: int) -> bool:
    """Advances by ``token_id``; False (and an error state) when it is not allowed."""
    if self._ll.is_error():
      return False
    return bool(self._ll.consume_token(int(token_id)))

  def is_accepting(self) -> bool:
    """The text so far is complete: eos is allowed now."""
    return not self._ll.is_error() and self._ll.is_accepting()

  def is_terminated(self) -> bool:
    """Nothing but eos can follow (the grammar is complete, or eos was accepted)."""
    return not self._ll.is_error() and self._ll.is_stopped()

  def error(self) -> str:
    """Why the matcher is in an error state ('' when it is not)."""
    return self._ll.get_error()

  def rollback(self, num_tokens: int) -> None:
    """Undoes the last ``num_tokens`` accepted tokens."""
    if num_tokens < 0 or not self._ll.rollback(num_tokens):
      raise ValueError(f"cannot roll back {num_tokens} tokens: {self._ll.get_error()}")


__all__ = ["CompiledGrammar", "GrammarCompiler", "Matcher"]
