"""When a sequence stops, and what text it has produced so far.

Contract: ``StopChecker(tokenizer, StopCriteria(...))`` sees a sequence's generated ids one at a
time; ``push(token_id) -> StopStep(text, finish)`` returns the newly releasable text and, when
the sequence is finished, its ``FinishReason``:
  * ``stop``: a stop id (the tokenizer's end ids unless ``ignore_eos``, plus ``stop_ids``) or a
    stop string (matched on the detokenized text, across token boundaries);
  * ``length``: ``max_tokens`` generated.
Stop ids and strings are ignored until ``min_tokens`` ids have been generated. ``stop_reason``:
the matched stop string or the asked-for stop id (``stop_ids``; not the tokenizer's own end
ids), else None; ``include_stop_str`` keeps a matched stop string in the text.
Output accounting (as JetStream and vLLM): ``token_ids`` include the id that ended the sequence
(``all_ids``); the text excludes a stop id's text and everything from a matched stop string on.
Text is released only once it can no longer be the start of a stop string, and never with a
partial UTF-8 character (``models.text.tokenizer.StreamDecoder``). The concatenated ``text`` of every
step is the final text.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

from models.text.tokenizer import StreamDecoder, Tokenizer


class FinishReason(str, enum.Enum):
  STOP = "stop"
  LENGTH = "length"
  CANCELLED = "cancelled"
  REJECTED = "rejected"
  ERROR = "error"


@dataclasses.dataclass(frozen=True)
class StopCriteria:
  max_tokens: int
  stop_ids: tuple[int, ...] = ()
  stop_strings: tuple[str, ...] = ()
  min_tokens: int = 0
  ignore_eos: bool = False
  include_stop_str: bool = False  # the text keeps a matched stop string (vLLM's option)
  keep_special: bool = False  # special tokens' texts in the text (skip_special_tokens: false)

  def __post_init__(self):
    if self.max_tokens < 1:
      raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
    if not 0 <= self.min_tokens <= self.max_tokens:
      raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
    if any(not s for s in self.stop_strings):
      raise ValueError("stop strings must be non-empty")


@dataclasses.dataclass(frozen=True)
class StopStep:
  text: str
  finish: FinishReason | None = None


def _held_suffix(text: str, stops: Sequence[str]) -> int:
  """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
  best = 0
  for s in stops:
    for n in range(min(len(s) - 1, len(text)), best, -1):
      if text.endswith(s[:n]):
        best = n
        break
  return best


class StopChecker:
  """Per-sequence stop logic and text streaming; see the module contract."""

  def __init__(self, tokenizer: Tokenizer, criteria: StopCriteria):
    self.criteria = criteria
    ends = () if criteria.ignore_eos else tuple(tokenizer.eos_ids)
    self._stop_ids = frozenset(ends + tuple(criteria.stop_ids))
    self._asked_ids = frozenset(criteria.stop_ids)
    self._decoder = StreamDecoder(tokenizer, criteria.keep_special)
    self._pending = ""  # decoded text not yet released (may start a stop string)
    self.all_ids: list[int] = []
    self.finish: FinishReason | None = None
    self.stop_reason: str | int | None = None  # the stop string or asked-for stop id that ended it

  def push(self, token_id: int) -> StopStep:
    if self.finish is not None:
      raise RuntimeError("push() after the sequence finished")
    self.all_ids.append(int(token_id))
    n = len(self.all_ids)
    armed = n > self.criteria.min_tokens
    if armed and int(token_id) in self._stop_ids:
      if int(token_id) in self._asked_ids:
        self.stop_reason = int(token_id)
      return self._flush_end(FinishReason.STOP, armed)
    self._pending += self._decoder.push(token_id)
    cut = self._stop_at(self._pending) if armed else -1
    if cut >= 0:
      return self._end(FinishReason.STOP, self._pending[:cut])
    if n >= self.criteria.max_tokens:
      return self._flush_end(FinishReason.LENGTH, armed)
    hold = _held_suffix(self._pending, self.criteria.stop_strings) if armed else 0
    out, self._pending = self._pending[:len(self._pending) - hold], self._pending[
        len(self._pending) - hold:]
    return StopStep(out)

  def _stop_at(self, text: str) -> int:
    """Where the text ends at the first stop string in ``text`` (its start, or its end with
    ``include_stop_str``), else -1; sets ``stop_reason`` to it."""
    found = min(((i, s) for s in self.criteria.stop_strings if (i := text.find(s)) >= 0),
                default=None, key=lambda f: f[0])
    if found is None:
      return -1
    self.stop_reason = found[1]
    return found[0] + (len(found[1]) if self.criteria.include_stop_str else 0)

  def _flush_end(self, reason: FinishReason, armed: bool) -> StopStep:
    """Ends with the text the decoder still holds (a partial UTF-8 character's prefix), which
    may itself complete a stop string: then the text is cut there and the reason is ``stop``."""
    text = self._pending + self._decoder.flush()
    cut = self._stop_at(text) if armed else -1
    if cut >= 0:
      return self._end(FinishReason.STOP, text[:cut])
    return self._end(reason, text)

  def _end(self, reason: FinishReason, text: str) -> StopStep:
    self.finish = reason
    self._pending = ""
    return StopStep(text, reason)
