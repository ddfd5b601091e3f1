"""A scheduler over an engine without the ServingLoop's threads: ``step`` runs one plan -> execute ->
update round (for tests that interleave arrivals, cancellations and checks between steps);
``serve_all`` / ``serve_outputs`` run requests to the end."""

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


def serve_outputs(sched, engine, reqs, traces: dict | None = None) -> list:
  """Adds every request (each must be admitted; its trace goes in ``traces`` when given), runs
  to completion, returns every output."""
  from serving.lifecycle import RequestTrace
  from serving.drive import run_to_completion
  traces = {} if traces is None else traces
  for r in reqs:
    traces[r.request_id] = RequestTrace(r.request_id)
    assert sched.add(r, traces[r.request_id]) is None
  outs = run_to_completion(sched, engine.execute, flush=engine.flush)
  for res in engine.flush():
    outs += sched.update(res)
  return outs


def serve_all(sched, engine, reqs, traces: dict | None = None) -> dict[str, list[int]]:
  """``serve_outputs``, as the ids each request got."""
  got: dict[str, list[int]] = {}
  for o in serve_outputs(sched, engine, reqs, traces):
    got.setdefault(o.request_id, []).extend(o.token_ids)
  return got
