"""SLO classes and prediction-based early rejection (Mooncake): refuse at arrival what would miss.

Contract: ``SloClass(name, ttft_s, tpot_s)``; ``MLPERF_CLASSES`` are MLPerf Inference v5.0's
LLM server-scenario targets (``interactive`` 450 ms / 40 ms as Llama-2-70B interactive,
``server`` 2 s / 200 ms as Llama-2-70B server, ``long`` 6 s / 175 ms as Llama-3.1-405B
server). ``parse_classes("name:ttft_s:tpot_s,...")`` reads a flag. ``StepCostModel`` is the live
engine's measured step time, ``a + b * prefill_tokens + c * decode_rows`` (seconds), fitted online
by least squares with exponential forgetting (``forget`` per step), so it follows the machine
as it runs; ``observe(prefill_tokens, decode_rows, seconds)`` after each busy step,
``cost(prefill_tokens, decode_rows)`` predicts one, ``prefill_room(decode_rows, seconds)``
inverts it. ``tpot_prefill_limit(model, tpot_s, floor)`` is the scheduler's TPOT-aware
prefill budget built on it (``ServingConfig.tpot_target_ms``). ``predict(load) ->
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
from typing import Callable

import numpy as np


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


class StepCostModel:
  """Online ridge regression of step seconds on (1, prefill tokens, decode rows).

  The ridge term ``prior * I`` is added at every solve and never forgotten, so the system stays
  positive definite whatever the steps (thousands of identical ones included) and ``observe``
  cannot raise. A sample that is not a finite duration >= 0 is ignored; once the fit is
  ``ready``, a sample above ``clamp`` times the fit's prediction counts as that bound (a step
  that compiled or stalled moves the fit by a bounded amount, not by its own length)."""

  def __init__(self, forget: float = 0.995, prior: float = 1e-3, clamp: float = 4.0):
    self.forget = forget
    self.prior = prior
    self.clamp = clamp
    self._xtx = np.zeros((3, 3))
    self._xty = np.zeros(3)
    self.steps = 0
    self.ignored = 0  # samples dropped as not a duration
    self._coef = np.zeros(3)

  def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
    seconds = float(seconds)
    if not (math.isfinite(seconds) and seconds >= 0):
      self.ignored += 1
      return
    if self.ready:
      seconds = min(seconds, self.clamp * max(self.cost(prefill_tokens, decode_rows), 1e-4))
    x = np.array([1.0, prefill_tokens, decode_rows], dtype=np.float64)
    self._xtx = self.forget * self._xtx + np.outer(x, x)
    self._xty = self.forget * self._xty + x * seconds
    self.steps += 1
    try:
      coef = np.linalg.solve(self._xtx + self.prior * np.eye(3), self._xty)
    except np.linalg.LinAlgError:  # not reachable with the ridge; kept so nothing escapes
      return
    if np.all(np.isfinite(coef)):
      self._coef = coef

  @property
  def ready(self) -> bool:
    return self.steps >= 8

  @property
  def coef(self) -> tuple[float, float, float]:
    return tuple(float(c) for c in self._coef)  # type: ignore[return-value]

  def cost(self, prefill_tokens: int, decode_rows: int) -> float:
    a, b, c = self._coef
    return max(0.0, float(a + b * prefill_tokens + c * decode_rows))

  def prefill_room(self, decode_rows: int, seconds: float) -> int | None:
    """The most prefill tokens a step with ``decode_rows`` decodes can carry and still take at
    most ``seconds`` by the fit (0 when the decodes alone take longer); None before the fit is
    ``ready`` or when it gives prefill tokens no positive cost."""
    a, b, c = self._coef
    if not self.ready or b <= 0:
      return None
    return max(0, int((seconds - a - c * decode_rows) / b))


def tpot_prefill_limit(model: StepCostModel, tpot_s: float, floor: int
                       ) -> Callable[[int], int | None]:
  """``Scheduler.prefill_limit`` for a TPOT target: a step that decodes carries only the
  prefill tokens that keep it within ``tpot_s`` by ``model`` (the step time is the decodes'
  TPOT), rounded down to a power of two, but at least ``floor`` so that prompts still advance
  when decode alone is slower; no limit while ``model`` is not fitted."""
  if tpot_s <= 0 or floor < 1:
    raise ValueError(f"want tpot_s > 0 and floor >= 1, got {tpot_s}, {floor}")

  def limit(decode_rows: int) -> int | None:
    room = model.prefill_room(decode_rows, tpot_s)
    if room is None:
      return None
    # The engine pads a chunk to a power-of-two length: a budget between two powers would run
    # (and cost) as the larger one.
    return max(floor, 1 << (room.bit_length() - 1) if room else 0)

  return limit


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
