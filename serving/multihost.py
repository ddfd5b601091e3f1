"""One engine over many processes: process 0 plans, every process runs the same device calls.

JAX's multi-controller model needs every process to launch the same programs, with the same
arguments, in the same order. phaseserve keeps ONE scheduler (process 0's); its engine calls are
broadcast (``partitioning.distributed.Broadcast``, ``serving.plan_codec``'s JSON form).

Contract:
  * ``LeaderEngine(engine, broadcast)`` (process 0) is an ``serving.engine_api.EngineApi``: each
    call that launches device programs or changes which program runs (``execute``, ``flush``,
    ``reset``, ``warmup``, ``seal``) is published, then run on the local engine; the reads
    (``programs``, ``lag``, ``describe``) are the local engine's. ``stop()`` publishes the end.
  * ``follow(engine, broadcast, should_stop=None) -> int`` (every other process) runs the
    published calls on its own engine, built like process 0's, until ``stop``; returns the
    number run. A call that raises is logged and the next one runs (process 0 fails the same way
    and publishes its ``reset``). It returns early when ``should_stop()`` is true (checked every
    ``POLL_S``); a dead process 0 ends this process through the runtime's heartbeats.
"""

from __future__ import annotations

import logging
from typing import Callable

from partitioning.distributed import Broadcast
from serving import plan_codec
from serving.engine_api import EngineApi
from serving.scheduler import StepPlan, StepResult

POLL_S = 1.0  # a follower waits for the next call this long before looking at should_stop
_log = logging.getLogger(__name__)


class LeaderEngine(EngineApi):
  """Process 0's engine: publishes each device call before running it (see the contract)."""

  def __init__(self, engine: EngineApi, broadcast: Broadcast):
    self.engine = engine
    self.broadcast = broadcast
    self.calls = 0

  def _publish(self, call: str, *args: object) -> None:
    self.broadcast.publish(plan_codec.encode((call, args)))
    self.calls += 1

  def execute(self, plan: StepPlan) -> StepResult | None:
    self._publish("execute", plan)
    return self.engine.execute(plan)

  def flush(self) -> list[StepResult]:
    self._publish("flush")
    return self.engine.flush()

  def reset(self) -> None:
    self._publish("reset")
    self.engine.reset()

  def warmup(self, max_prefill_rows: int = 1, max_chunk: int | None = None,
             threads: int | None = None, max_tokens: int | None = None) -> int:
    """Every process compiles the same programs (each with its own default threads)."""
    self._publish("warmup", max_prefill_rows, max_chunk, None, max_tokens)
    return self.engine.warmup(max_prefill_rows, max_chunk, threads, max_tokens)

  def seal(self) -> None:
    """Every process seals: after it, a shape may run as a larger warmed one (the same on all)."""
    self._publish("seal")
    self.engine.seal()

  @property
  def programs(self) -> int:
    return self.engine.programs

  @property
  def lag(self) -> int:
    return self.engine.lag

  def describe(self) -> dict[str, object]:
    return self.engine.describe()

  def stop(self) -> None:
    self._publish("stop")


def follow(engine: EngineApi, broadcast: Broadcast,
           should_stop: Callable[[], bool] | None = None) -> int:
  """Runs process 0's published engine calls here until it publishes ``stop``."""
  calls = 0
  while True:
    data = broadcast.receive(POLL_S)
    if data is None:
      if should_stop is not None and should_stop():
        _log.warning("follower stopping on request before process 0 said stop")
        return calls
      continue
    message = plan_codec.decode(data)
    assert isinstance(message, (list, tuple)) and len(message) == 2, message
    call, args = message
    if call == "stop":
      return calls
    calls_by_name: dict[str, Callable[..., object]] = {
        "execute": engine.execute, "flush": engine.flush, "reset": engine.reset,
        "warmup": engine.warmup, "seal": engine.seal}
    run = calls_by_name.get(call)
    if run is None:
      raise ValueError(f"unknown engine call {call!r} from process 0")
    try:
      run(*args)
    except Exception:  # as on process 0, whose loop handles it and publishes ``reset``
      _log.exception("engine call %s failed (process 0's loop handles the fault)", call)
    calls += 1
