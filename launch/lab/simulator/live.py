"""The live engine on a trace, for checking the simulator against it (tests, validation runs).

Contract: ``run_live(loop, requests, vocab, seed) -> LiveRun`` drives a ``serving.loop.
ServingLoop`` in this thread on the real clock: each request (``cluster.SimRequest``: random prompt
ids of its length, ``max_tokens`` its output, EOS ignored) is submitted at its arrival time
(the loop idles until then), every loop iteration is timed with the composition of the step it
ran (prefill tokens, decode rows), and each request's TTFT (first token - scheduled arrival) and
TPOT ((last - first token) / (tokens - 1)) are read from its trace. ``fit_step_time(steps)`` is
the least-squares ``LinearStepTime`` of those iterations (the quick measurement the simulator
then runs on: the engine's own step model, ``serving.api.admission.StepCostModel``'s form, with the
host's planning time included, since it is on the path of every token).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from launch.lab.simulator.cluster import SimRequest
from launch.lab.simulator.step_time import LinearStepTime

if TYPE_CHECKING:
  from serving.loop import ServingLoop


@dataclasses.dataclass(frozen=True)
class StepSample:
  prefill_tokens: int
  decode_rows: int
  seconds: float


@dataclasses.dataclass(frozen=True)
class LiveRun:
  ttft_s: tuple[float, ...]
  tpot_s: tuple[float, ...]
  steps: tuple[StepSample, ...]
  wall_s: float


def run_live(loop: "ServingLoop", requests: Sequence[SimRequest], vocab: int, seed: int = 0
             ) -> LiveRun:
  from serving.request import Request
  from serving.stop import StopCriteria

  rng = np.random.default_rng(seed)
  prompts = [tuple(int(x) for x in rng.integers(1, vocab, r.prompt_len)) for r in requests]
  engine = loop.engine
  plans: list[tuple[int, int]] = []
  execute = engine.execute

  def timed_execute(plan):
    plans.append((sum(len(c.token_ids) for c in plan.prefill), len(plan.decode)))
    return execute(plan)

  engine.execute = timed_execute  # type: ignore[method-assign]
  steps: list[StepSample] = []
  order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
  t0 = time.monotonic()
  nxt = 0
  try:
    while nxt < len(order) or not loop.idle:
      now = time.monotonic() - t0
      while nxt < len(order) and requests[order[nxt]].arrival_s <= now:
        i = order[nxt]
        loop.submit(Request(f"r{i}", prompts[i], stop=StopCriteria(
            requests[i].output_len, ignore_eos=True)), lambda out: None)
        nxt += 1
      before, start = len(plans), time.monotonic()
      busy = loop.step()
      if busy and len(plans) > before:
        p, d = plans[-1]
        if p or d:
          steps.append(StepSample(p, d, time.monotonic() - start))
      elif not busy and nxt < len(order):
        time.sleep(max(0.0, requests[order[nxt]].arrival_s - (time.monotonic() - t0)))
  finally:
    engine.execute = execute  # type: ignore[method-assign]
  wall = time.monotonic() - t0
  ttft, tpot = [], []
  for i, r in enumerate(requests):
    toks = loop.traces[f"r{i}"].token_times()
    if not toks:
      continue
    ttft.append(toks[0] - (t0 + r.arrival_s))
    if len(toks) > 1:
      tpot.append((toks[-1] - toks[0]) / (len(toks) - 1))
  return LiveRun(tuple(ttft), tuple(tpot), tuple(steps), wall)


def fit_step_time(steps: Sequence[StepSample]) -> LinearStepTime:
  """Least squares of step seconds on (1, prefill tokens, decode rows); raises ValueError with
  fewer than 3 steps. Plain least squares keeps a shared machine's hiccups in the mean step (a
  fit without the outliers predicted 0.6-0.9x the measured p50s at load 4-5, this one
  0.9-1.06x)."""
  if len(steps) < 3:
    raise ValueError(f"{len(steps)} steps cannot fit 3 coefficients")
  x = np.array([[1.0, s.prefill_tokens, s.decode_rows] for s in steps])
  y = np.array([s.seconds for s in steps])
  a, b, c = (float(v) for v in np.linalg.lstsq(x, y, rcond=None)[0])
  return LinearStepTime(a, b, c)
