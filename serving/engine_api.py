"""The engine protocol: what the serving loop, the stack and the server call on an engine.

Contract: ``EngineApi`` is an ABC that ``serving.engine.Engine``, ``serving.fake_engine.FakeEngine``
and ``serving.multihost.LeaderEngine`` subclass; the loop is typed against it and reads nothing
else of an engine.
  * ``execute(plan) -> StepResult | None``: runs a ``StepPlan``; returns the result of the step
    ``lag`` steps back (None while fewer are in flight). ``flush()`` returns every held result;
    ``reset()`` drops them (after a fault).
  * ``warmup(max_prefill_rows, max_chunk, threads, max_tokens) -> int`` compiles every program a
    plan can reach (``max_tokens``: a step's prefill tokens in all; returns how many); ``seal()`` closes the program set at readiness.
  * ``read_pages(pages)``: those KV pages' data on the host, every leaf ``[L, P, ...]`` (for a
    transfer to another process); an engine that cannot raises ``NotImplementedError``.
  * ``programs``: programs dispatched so far (a call that grew it compiled one); ``lag``: steps
    a result trails its plan; ``describe()``: a JSON-able description of what runs the steps.
"""

from __future__ import annotations

import abc
from typing import Sequence

import numpy as np

from serving.scheduler import StepPlan, StepResult


class EngineApi(abc.ABC):
  """See the module contract."""

  @abc.abstractmethod
  def execute(self, plan: StepPlan) -> StepResult | None: ...

  @abc.abstractmethod
  def flush(self) -> list[StepResult]: ...

  @abc.abstractmethod
  def reset(self) -> None: ...

  @abc.abstractmethod
  def warmup(self, max_prefill_rows: int = 1, max_chunk: int | None = None,
             threads: int | None = None, max_tokens: int | None = None) -> int: ...

  @abc.abstractmethod
  def seal(self) -> None: ...

  @property
  @abc.abstractmethod
  def programs(self) -> int: ...

  @property
  @abc.abstractmethod
  def lag(self) -> int: ...

  @abc.abstractmethod
  def describe(self) -> dict[str, object]: ...

  def read_pages(self, pages: Sequence[int]) -> tuple[np.ndarray, ...]:
    raise NotImplementedError(f"{type(self).__name__} cannot export KV pages")
