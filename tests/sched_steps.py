"""A scheduler over an engine without the ServingLoop's threads: ``step`` runs one plan -> execute ->
update round (for tests that interleave arrivals, cancellations and checks between steps);
``serve_all`` runs requests to the end."""

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


def serve_all(sched, engine, reqs) -> dict[str, list[int]]:
  """Adds every request (each must be admitted), runs to completion, returns the ids each got."""
  from serving.lifecycle import RequestTrace
  from serving.scheduler import run_to_completion
  for r in reqs:
    assert sched.add(r, RequestTrace(r.request_id)) is None
  outs = run_to_completion(sched, engine.execute)
  for res in engine.flush():
    outs += sched.update(res)
  got: dict[str, list[int]] = {}
  for o in outs:
    got.setdefault(o.request_id, []).extend(o.token_ids)
  return got
