"""The live engine's measured step time and the TPOT-aware prefill budget built on it.

Contract: ``StepCostModel`` fits ``a + b * prefill_tokens + c * decode_rows`` (seconds) online by
ridge least squares with exponential forgetting; ``observe(prefill_tokens, decode_rows, seconds)``
after each busy step, ``cost(...)`` predicts one, ``prefill_room(decode_rows, seconds)`` inverts
it. ``tpot_prefill_limit(model, tpot_s, floor)`` is ``Scheduler.prefill_limit`` for a TPOT target
(``ServingConfig.tpot_target_ms``). Admission (``serving.api.admission``) predicts from the same fit.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np


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
    return float(self._coef[0]), float(self._coef[1]), float(self._coef[2])

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
