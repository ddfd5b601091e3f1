"""SLO classes and prediction-based early rejection (Mooncake): refuse at arrival what would miss.

Contract: ``SloClass(name, ttft_s, tpot_s)``; ``MLPERF_CLASSES`` are MLPerf Inference v5.0's
LLM server-scenario targets (``interactive`` 450 ms / 40 ms as Llama-2-70B interactive,
``server`` 2 s / 200 ms as Llama-2-70B server, ``long`` 6 s / 175 ms as Llama-3.1-405B
server). ``parse_classes("name:ttft_s:tpot_s,...")`` reads a flag. ``predict(load) ->
Prediction`` estimates a new request's TTFT and TPOT from the measured step time and the
prefill backlog: the backlog (prompt tokens admitted but not yet prefilled) plus this
request's prompts drain at ``max_step_tokens - decoding rows`` tokens per step, plus one step for
the sampled id's copy, after the steps it waits for a decode slot (decode-only steps of the
running rows); TPOT is the current step time. ``Prediction.miss(slo, scale)`` names the
target it would miss (targets multiplied by ``scale``, for slower machines), or None. Before any
step has been measured the step time is taken as ``fallback_step_s``.
"""

from __future__ import annotations

import dataclasses
import math

from serving.step_cost import StepCostModel


@dataclasses.dataclass(frozen=True)
class SloClass:
  name: str
  ttft_s: float
  tpot_s: float

  def __post_init__(self):
    if not (self.ttft_s > 0 and self.tpot_s > 0):
      raise ValueError(f"SLO class {self.name!r}: targets must be > 0")


MLPERF_CLASSES = (SloClass("interactive", 0.45, 0.040), SloClass("server", 2.0, 0.200),
                  SloClass("long", 6.0, 0.175))


def parse_classes(spec: str) -> tuple[SloClass, ...]:
  out = []
  for part in spec.split(","):
    bits = part.strip().split(":")
    if len(bits) != 3 or not bits[0]:
      raise ValueError(f"SLO class {part!r}: expected name:ttft_s:tpot_s")
    try:
      out.append(SloClass(bits[0], float(bits[1]), float(bits[2])))
    except ValueError as e:
      raise ValueError(f"SLO class {part!r}: {e}") from None
  if len({c.name for c in out}) != len(out):
    raise ValueError(f"SLO classes {spec!r}: duplicate names")
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Load:
  step_s: float  # measured busy-step time (0: none yet)
  backlog_tokens: int  # prompt tokens admitted, not yet prefilled
  decoding: int  # rows decoding now (each takes one token of the step budget)
  max_step_tokens: int
  new_tokens: int  # this request's prompt tokens to prefill (times n), cached ones excluded
  fallback_step_s: float = 0.01
  model: StepCostModel | None = None
  slot_wait_steps: int = 0  # steps until a decode slot frees for it (Scheduler.slot_wait_steps)


@dataclasses.dataclass(frozen=True)
class Prediction:
  ttft_s: float
  tpot_s: float

  def miss(self, slo: SloClass, scale: float = 1.0) -> str | None:
    if self.ttft_s > slo.ttft_s * scale:
      return (f"predicted TTFT {self.ttft_s * 1e3:.1f} ms exceeds the {slo.name!r} target of "
              f"{slo.ttft_s * scale * 1e3:.1f} ms")
    if self.tpot_s > slo.tpot_s * scale:
      return (f"predicted TPOT {self.tpot_s * 1e3:.1f} ms exceeds the {slo.name!r} target of "
              f"{slo.tpot_s * scale * 1e3:.1f} ms")
    return None


def predict(load: Load) -> Prediction:
  per_step = max(1, load.max_step_tokens - load.decoding)
  if load.model is not None and load.model.ready:
    left = load.backlog_tokens + load.new_tokens
    # Waiting for a slot: the running rows' decode steps (a step of the backlog's prefill is
    # counted below, not here: costing every wait step as a full prefill chunk over-predicted
    # long prompts' TTFT 4-10x at low load, BUILD_NOTES "Load generator").
    t = load.slot_wait_steps * load.model.cost(0, load.decoding)
    while left > 0:
      chunk = min(per_step, left)
      t += load.model.cost(chunk, load.decoding)
      left -= chunk
    t += load.model.cost(0, load.decoding + 1)  # the step that copies the first id back
    return Prediction(ttft_s=t, tpot_s=load.model.cost(0, load.decoding + 1))
  step = load.step_s or load.fallback_step_s
  steps = math.ceil((load.backlog_tokens + load.new_tokens) / per_step) + 1 + load.slot_wait_steps
  return Prediction(ttft_s=steps * step, tpot_s=load.step_s)
