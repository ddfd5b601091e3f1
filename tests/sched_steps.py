"""One plan -> execute -> update round of a scheduler over an engine (the ServingLoop's step without
its threads), for tests that interleave arrivals, cancellations and checks between steps."""

from __future__ import annotations


def step(sched, engine) -> list:
  """Plans one step, runs it, applies what came back (everything, when nothing was planned)."""
  plan = sched.schedule()
  res = engine.execute(plan)
  got = sched.drain_outputs() + (sched.update(res) if res is not None else [])
  if plan.empty:
    for x in engine.flush():
      got += sched.update(x)
  return got
