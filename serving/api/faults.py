"""Test-only fault injection into engine steps (``launch.server --fault_injection``).

Contract: ``FaultInjector(frontend)`` is a ``ServingLoop.fault_hook``. With the front end's
``fault_injection`` on, a request whose client_request_id is ``fault:<kind>`` arms a fault that
fires in the first engine step planning any of its samples: ``raise`` (a ``RuntimeError``: the
step's sequences fail, the engine goes on), ``fatal`` (``FatalEngineError``: the engine cannot
continue) or ``hang:<seconds>`` (the step sleeps: the watchdog's case); each of these fires once.
``slow:<seconds>`` sleeps in every step planning the request (a long-running request on a fast
model: the drain tests). Never on by default; nothing else reads these ids.
"""

from __future__ import annotations

import time

from serving.api.frontend import Frontend
from serving.loop import FatalEngineError
from serving.scheduler import StepPlan


class FaultInjector:
  def __init__(self, frontend: Frontend):
    self.frontend = frontend
    self.fired = 0

  def __call__(self, plan: StepPlan) -> None:
    armed = self.frontend.fault_ids
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
