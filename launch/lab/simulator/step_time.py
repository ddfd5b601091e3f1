"""Step times for the capacity simulator: a measured linear model, or the (calibrated) cost model.

Contract: a ``StepTime`` answers ``seconds(prefill_tokens, decode_rows, decode_context)``, the
wall time of one engine step that prefills ``prefill_tokens`` prompt tokens (chunks of any
requests) and decodes ``decode_rows`` rows attending to ``decode_context`` cached tokens on
average. Two kinds:

* ``LinearStepTime(a, b, c)``: ``a + b * prefill_tokens + c * decode_rows``, the live engine's
  own step model (``serving.api.admission.StepCostModel``), fitted to a measured run.
* ``CostModelStepTime.build(model, hw, chips, weights, ...)``: the analytic cost model
  (``partitioning.cost_model``) on one model instance of ``chips`` chips, with the planner's
  best layout per phase (``partitioning.planner.plan``, latency objective: prefill at batch 1 x
  ``prefill_tokens`` budget, decode at ``max_slots`` rows), and a ``Calibration`` applied when
  one is given (``partitioning.calibration.load``: fractions of peak measured on real devices by
  ``launch.lab.calibrate`` / ``launch.lab.sweep_partitioning``). A step's prefill and decode are two
  calls, as in the live engine (``Engine.execute`` runs ``prefill`` then ``generate``), so their
  latencies add (each reads the weights once). Decode rows are padded to the engine's
  power-of-two bucket (at least the layout's batch-sharding unit); prefill tokens and context
  are rounded up to 64 for memoisation.

``kv_capacity_tokens`` is the KV cache one instance holds in the HBM left after weights (the
decode layout's attention batch axes shard the cache; other chips replicate it, as in the cost
model), less ``reserve`` of HBM for activations and programs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Protocol

from models.config import ModelConfig
from partitioning import cost_model, planner
from partitioning.calibration import Calibration
from partitioning.cost_model import AttnLayoutName, FfnLayoutName, MeshShape, StepCost, WeightsDtype
from partitioning.hardware import Hardware


class StepTime(Protocol):
  def seconds(self, prefill_tokens: int, decode_rows: int, decode_context: float) -> float:
    ...


@dataclasses.dataclass(frozen=True)
class LinearStepTime:
  a: float  # seconds per step
  b: float  # seconds per prefill token
  c: float  # seconds per decode row

  def seconds(self, prefill_tokens: int, decode_rows: int, decode_context: float) -> float:
    if not prefill_tokens and not decode_rows:
      return 0.0
    return max(0.0, self.a + self.b * prefill_tokens + self.c * decode_rows)


@dataclasses.dataclass(frozen=True)
class PhaseLayout:
  layout: FfnLayoutName
  attention: AttnLayoutName
  mesh: MeshShape

  @property
  def unit(self) -> int:
    """Smallest batch the layout divides: the FFN's and the attention's batch-sharding chips."""
    return math.lcm(cost_model.ffn_batch_chips(self.layout, self.mesh),
                    cost_model.attention_batch_chips(self.layout, self.attention, self.mesh))

  def describe(self) -> str:
    return f"{self.layout}/{self.attention} {'x'.join(map(str, self.mesh))}"


_ROUND = 64


def _up(x: float, k: int) -> int:
  return max(k, int(math.ceil(x / k)) * k)


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=200_000)
def _cost(model: ModelConfig, hw: Hardware, lay: PhaseLayout, phase: str, batch: int,
          context: int, weights: WeightsDtype, cal: Calibration | None) -> StepCost:
  c = cost_model.step_cost(model, hw, lay.layout, lay.attention, lay.mesh,
                           phase, batch, context, weights)  # type: ignore[arg-type]
  return cal.apply(c, model.num_layers) if cal is not None else c


@dataclasses.dataclass(frozen=True)
class CostModelStepTime:
  model: ModelConfig
  hw: Hardware
  weights: WeightsDtype
  prefill: PhaseLayout
  decode: PhaseLayout
  calibration: Calibration | None = None

  @classmethod
  def build(cls, model: ModelConfig, hw: Hardware, chips: int, weights: WeightsDtype = "bf16",
            max_slots: int = 64, prefill_tokens: int = 512, decode_context: int = 1024,
            calibration: Calibration | None = None) -> "CostModelStepTime":
    """The planner's best layouts for one instance; raises ``planner.NoFeasiblePlan``."""
    pre = planner.plan(model, hw, chips, "prefill", 1, prefill_tokens, weights,
                       calibration=calibration).best
    dec = planner.plan(model, hw, chips, "decode", max_slots, decode_context, weights,
                       calibration=calibration).best
    return cls(model, hw, weights, PhaseLayout(pre.layout, pre.attention, pre.mesh),
               PhaseLayout(dec.layout, dec.attention, dec.mesh), calibration)

  @property
  def chips(self) -> int:
    return math.prod(self.decode.mesh)

  def prefill_s(self, tokens: int) -> float:
    return _cost(self.model, self.hw, self.prefill, "prefill", 1, _up(tokens, _ROUND),
                 self.weights, self.calibration).latency_s

  def decode_s(self, rows: int, context: float) -> float:
    batch = max(_pow2(rows), self.decode.unit)
    return _cost(self.model, self.hw, self.decode, "decode", batch, _up(context, _ROUND),
                 self.weights, self.calibration).latency_s

  def seconds(self, prefill_tokens: int, decode_rows: int, decode_context: float) -> float:
    t = self.prefill_s(prefill_tokens) if prefill_tokens else 0.0
    return t + (self.decode_s(decode_rows, decode_context) if decode_rows else 0.0)

  def kv_capacity_tokens(self, reserve: float = 0.1) -> int:
    return kv_capacity_tokens(self.model, self.hw, self.decode, self.weights, reserve)

  def describe(self) -> dict[str, object]:
    return {"chips": self.chips, "weights": self.weights, "prefill_layout": self.prefill.describe(),
            "decode_layout": self.decode.describe(),
            "calibration": self.calibration.source if self.calibration else None}


def kv_capacity_tokens(model: ModelConfig, hw: Hardware, lay: PhaseLayout, weights: WeightsDtype,
                       reserve: float = 0.1) -> int:
  """Tokens of bf16 KV one instance holds: per chip, HBM * (1 - reserve) - resident weights,
  times the chips the cache is batch-sharded over; 0 when the weights alone do not fit."""
  n = math.prod(lay.mesh)
  per_chip = hw.hbm_bytes * (1 - reserve) - (
      model.param_count(include_embedding=True) * cost_model.WEIGHT_BYTES[weights] / n)
  if per_chip <= 0:
    return 0
  shards = cost_model.attention_batch_chips(lay.layout, lay.attention, lay.mesh)
  return int(per_chip * shards // cost_model.kv_cache_bytes(model, 1, 1))


def kv_bytes(model: ModelConfig, tokens: int) -> float:
  """bf16 KV bytes of ``tokens`` positions of one sequence (what a KV transfer moves)."""
  return cost_model.kv_cache_bytes(model, 1, tokens)


def instance_chips(model: ModelConfig, hw: Hardware, weights: WeightsDtype,
                   max_weight_fraction: float = 0.6) -> int:
  """Smallest power-of-two chip count (up to ``hw.max_chips``) whose HBM holds the weights in at
  most ``max_weight_fraction`` of it (the rest is KV); raises ``ValueError`` if none does."""
  need = model.param_count(include_embedding=True) * cost_model.WEIGHT_BYTES[weights]
  n = 1
  while n <= hw.max_chips:
    if need <= max_weight_fraction * n * hw.hbm_bytes:
      return n
    n *= 2
  raise ValueError(f"{model.name} ({weights}) needs more than {hw.max_chips} {hw.name} chips "
                   f"to keep its weights under {max_weight_fraction:.0%} of HBM")
