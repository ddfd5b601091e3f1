"""What a client asks for and what it gets back, as the scheduler and engine see it.

Contract: ``Request`` is immutable: the prompt as token ids (text is tokenized before the
scheduler), sampling (``serving.sampling.SamplingParams``; every request has its own seed: one
without a seed gets ``fresh_seed()`` here, when the ``Request`` is created, so its recomputation
after preemption draws the same tokens),
stop criteria (``serving.stop.StopCriteria``) and a priority (lower runs first; FCFS within one
priority). ``RequestOutput`` is one update of one request: the token ids and text released since
the previous update, and, on the last one, the finish reason, a message where useful and the usage
counts. ``token_ids`` include the id that ended a sequence; ``text`` excludes it and any matched
stop string (``serving.stop``).
"""

from __future__ import annotations

import dataclasses

from serving.lora import LoraRef
from serving.sampling import SamplingParams, fresh_seed
from serving.stop import FinishReason, StopCriteria

__all__ = ["Request", "RequestOutput", "Sinks", "Usage", "fresh_seed", "MAX_STREAM_TOKENS"]


MAX_STREAM_TOKENS = 1 << 24  # a sink stream's max_tokens (positions stay far below PAD_POS)


@dataclasses.dataclass(frozen=True)
class Sinks:
  """The attention-sink cache policy (StreamingLLM): keep the first ``sinks`` tokens and the
  last ``window``; the stream may run far past the context with KV of a fixed size. Needs an
  engine over a sink pool (``launch.server --attention_sinks``)."""
  window: int
  sinks: int = 4

  def __post_init__(self):
    if self.window < 1 or self.sinks < 0:
      raise ValueError(f"attention sinks need window >= 1 and sinks >= 0, got {self}")


@dataclasses.dataclass(frozen=True)
class Request:
  request_id: str
  prompt_ids: tuple[int, ...]
  sampling: SamplingParams = SamplingParams()
  stop: StopCriteria = StopCriteria(max_tokens=16)
  priority: int = 0
  session_id: str = ""  # multi-turn: this turn's KV stays pinned for the next (serving.sessions)
  sinks: Sinks | None = None  # the attention-sink cache policy; None: the whole context
  speculate: bool = True  # False: never verify draft ids for it (serving.speculative)
  lora: LoraRef | None = None  # the LoRA adapter it runs under (serving.lora); None: the base

  def __post_init__(self):
    if self.sampling.seed is None:  # the client gave no seed: draw one now, once
      object.__setattr__(self, "sampling", self.sampling.resolved())
    if not self.prompt_ids:
      raise ValueError("the prompt is empty")
    if any(not isinstance(t, int) or t < 0 for t in self.prompt_ids):
      raise ValueError("prompt token ids must be non-negative integers")


@dataclasses.dataclass(frozen=True)
class Usage:
  prompt_tokens: int
  completion_tokens: int
  cached_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
  """Log-probabilities (of the raw model distribution) of a generated id and the top ids."""
  token_id: int
  logprob: float
  top: tuple[tuple[int, float], ...] = ()  # (id, logprob), best first


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  request_id: str
  token_ids: tuple[int, ...] = ()
  text: str = ""
  finish_reason: FinishReason | None = None
  message: str = ""
  usage: Usage | None = None
  logprobs: tuple[TokenLogprobs, ...] = ()  # one per id of token_ids, when asked for
  stop_reason: str | int | None = None  # on a ``stop`` finish: the stop string or id, if asked

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None
