"""The offline driver: plan -> execute -> update until the scheduler is idle (tests and
benchmarks; the server's loop is ``serving.loop``).

Contract: ``run_to_completion(scheduler, execute, max_steps, flush)`` returns every
``RequestOutput``; ``execute`` is an engine's (a lagged engine returns an earlier step's result
or None); while ``scheduler.synchronous`` (speculation) the driver collects the step's own
result with ``flush`` before the next plan.
"""

from __future__ import annotations

from typing import Callable

from serving.request import RequestOutput
from serving.scheduler import Scheduler
from serving.step_plan import StepPlan, StepResult


def run_to_completion(scheduler: Scheduler, execute: Callable[[StepPlan], StepResult | None],
                      max_steps: int = 1_000_000,
                      flush: Callable[[], list[StepResult]] | None = None
                      ) -> list[RequestOutput]:
  """See the module contract."""
  outs: list[RequestOutput] = []
  for _ in range(max_steps):
    outs += scheduler.drain_outputs()
    if scheduler.idle:
      return outs
    plan = scheduler.schedule()
    sync = scheduler.synchronous
    outs += scheduler.drain_outputs()
    result = execute(plan)
    results = [result] if result is not None else []
    if sync and flush is not None:
      results += flush()
    for res in results:
      outs += scheduler.update(res)
  raise RuntimeError(f"not idle after {max_steps} steps")


__all__ = ["run_to_completion"]
