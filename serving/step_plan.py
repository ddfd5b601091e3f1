"""The per-step plan the scheduler hands the engine, and the result the engine hands back.

Contract: a ``StepPlan`` is plain data (no JAX): the ``prefill`` chunks and ``decode`` rows of
one step, the ``setups`` of slots (re)assigned in it (a penalised request's with its ids), the
device ``page_table`` of every slot (``[max_slots, max_pages_per_seq]``; free slots hold the
null page), and the page work to run before the step, in this order: ``copies`` (prefix pages copied across sub-pools), ``spills``
(device pages copied to the host tier), ``forget`` (host entries dropped) and ``loads`` (host
entries back onto device pages). A ``StepResult`` maps request ids to the id each sampled
(with logprobs when asked), after the draft ids it accepted (``DecodeRow.draft``). ``serving.plan_codec`` is its wire form.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from serving.kv_pages import PageCopy
from serving.lora import LoraLoad
from serving.prefix_cache import PageLoad, PageSpill
from serving.request import Sinks, TokenLogprobs
from serving.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
  request_id: str
  slot: int
  token_ids: tuple[int, ...]
  start: int  # absolute position of token_ids[0]
  sample: bool  # the context ends with this chunk: sample the sequence's next id


@dataclasses.dataclass(frozen=True)
class DecodeRow:
  request_id: str
  slot: int
  position: int  # where the slot's last sampled id (held on the device) is written
  # Speculative decoding: proposed ids to verify after it, at position + 1, ...; the step
  # returns the longest prefix the target itself samples (``StepResult.accepted``) and one id
  # after it, and the scheduler gives back the positions of the rest.
  draft: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class SlotSetup:
  slot: int
  request_id: str
  sampling: SamplingParams
  sinks: Sinks | None = None  # the slot's cache policy (a sink pool's per-row sinks/window)
  # Only where ``sampling.penalized`` or constrained (``sampling.grammar``): the ids the slot's
  # penalty counts and grammar start from (the prompt, and the ids generated before a
  # preemption), whatever the prefix cache reuses.
  prompt_ids: tuple[int, ...] = ()
  output_ids: tuple[int, ...] = ()
  lora: int = -1  # the device slot of its LoRA adapter (``serving.lora``; -1: the base model)


@dataclasses.dataclass(frozen=True)
class StepPlan:
  step: int
  prefill: tuple[PrefillChunk, ...]
  decode: tuple[DecodeRow, ...]
  setups: tuple[SlotSetup, ...]  # slots (re)assigned this step: reset their sampling state
  page_table: np.ndarray  # [max_slots, max_pages_per_seq] int32; free slots hold the null page
  copies: tuple[PageCopy, ...] = ()
  # Host tier, in this order before the step: device pages to copy out, host entries to drop,
  # host entries to load onto device pages.
  spills: tuple[PageSpill, ...] = ()
  forget: tuple[int, ...] = ()
  loads: tuple[PageLoad, ...] = ()
  lora_loads: tuple[LoraLoad, ...] = ()  # adapters into device slots, before the step

  @property
  def num_tokens(self) -> int:
    return (sum(1 + len(r.draft) for r in self.decode)
            + sum(len(c.token_ids) for c in self.prefill))

  @property
  def empty(self) -> bool:
    return not self.prefill and not self.decode


@dataclasses.dataclass(frozen=True)
class StepResult:
  step: int
  tokens: dict[str, int]  # request id -> id sampled by this step
  logprobs: dict[str, TokenLogprobs] = dataclasses.field(default_factory=dict)
  wait_s: float = 0.0  # host time spent waiting for these ids (device time not hidden)
  # request id -> the draft ids the step accepted, which come before ``tokens[id]`` (speculative
  # decoding; absent: none accepted)
  accepted: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)


__all__ = ["PrefillChunk", "DecodeRow", "SlotSetup", "StepPlan", "StepResult"]
