"""Test-only fault injection into engine steps (``launch.server --fault_injection``).

Contract: ``FaultInjector()`` is a ``ServingLoop.fault_hook`` (given to ``serving.stack.build``)
and the front end's arming point (``Frontend(..., faults=)``): a request whose
client_request_id is ``fault:<kind>`` has each sample ``arm``ed, and the fault fires in the first
engine step planning any of its samples: ``raise`` (a ``RuntimeError``: the step's sequences
fail, the engine goes on), ``fatal`` (``FatalEngineError``: the engine cannot continue) or
``hang:<seconds>`` (the step sleeps: the watchdog's case); each of these fires once.
``slow:<seconds>`` sleeps in every step planning the request (the drain tests). ``disarm``
forgets a request. ``FaultInjector(step_delay_s=S)`` sleeps S seconds in every step that plans
any work (a deliberately slow replica: the canary tests). Never on by default; nothing else
reads these ids.
"""

from __future__ import annotations

import time

from serving.loop import FatalEngineError
from serving.scheduler import StepPlan


class FaultInjector:
  def __init__(self, step_delay_s: float = 0.0) -> None:
    self.armed: dict[str, str] = {}  # request id -> fault kind
    self.fired = 0
    self.step_delay_s = step_delay_s

  def arm(self, request_id: str, kind: str) -> None:
    self.armed[request_id] = kind

  def disarm(self, request_id: str) -> None:
    self.armed.pop(request_id, None)

  def __call__(self, plan: StepPlan) -> None:
    if self.step_delay_s and (plan.prefill or plan.decode):
      time.sleep(self.step_delay_s)
    armed = self.armed
    if not armed:
      return
    rids = [c.request_id for c in plan.prefill] + [r.request_id for r in plan.decode]
    slow = [float(armed[r].split(":", 1)[1]) for r in rids if armed.get(r, "").startswith("slow:")]
    if slow:
      time.sleep(max(slow))
    kind = None
    for r in rids:
      k = armed.get(r)
      if k is not None and not k.startswith("slow:"):
        kind = armed.pop(r, None)
        break
    if kind is None:
      return
    self.fired += 1
    if kind == "raise":
      raise RuntimeError("injected fault (test hook)")
    if kind == "fatal":
      raise FatalEngineError("injected fatal fault (test hook)")
    if kind.startswith("hang:"):
      time.sleep(float(kind.split(":", 1)[1]))
