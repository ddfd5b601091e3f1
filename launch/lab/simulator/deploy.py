"""Deployments of a model on a cluster from the cost model: instances, layouts, pools, links.

Contract: ``ClusterSpec`` names the model shape, hardware preset, total chips, weights dtype,
chips per model instance (0: ``step_time.instance_chips``, the smallest power of two keeping the
weights under 60% of HBM), the engine settings of the interleaved instances, of the prefill
pool and of the decode pool, the KV link per chip (bytes/s) and an optional calibration.
``Planner(spec)`` builds the step-time models once (one per pool: the planner picks each
pool's layouts for its own batch and token budget) and then
* ``instances`` = total chips // instance chips (the rest of the chips idle: reported);
* ``interleaved()``: every instance mixed;
* ``disaggregated(p, d)``: ``p`` prefill and ``d`` decode instances of the same size, the
  prefill instance's link = ``link_bytes_per_s_per_chip`` x its chips (H100: the GPUs' NICs,
  e.g. 400 Gb/s InfiniBand = 50 GB/s each; TPU: the data-centre network or ICI between
  sub-slices), KV bytes per token from the model (bf16 cache).
H100/H200 instances stay within one 8-GPU NVSwitch board (``Hardware.max_chips``); a larger
cluster is replicas of such instances (the cost model has no inter-node tensor parallelism).
"""

from __future__ import annotations

import dataclasses

from models.config import ModelConfig
from partitioning.calibration import Calibration
from partitioning.cost_model import WeightsDtype
from partitioning.hardware import Hardware
from launch.lab.simulator.cluster import Pool, SimDeployment
from launch.lab.simulator.instance import EngineSpec
from launch.lab.simulator.step_time import CostModelStepTime, instance_chips, kv_bytes

# Defaults. Interleaved: the live engine's token budget and chunk (serving.stack.ServingConfig)
# with a 70B-sized batch; prefill pool: a bigger budget (prefill-only steps are compute-bound,
# no TPOT to protect); decode pool: decode rows only.
MIXED = EngineSpec(max_slots=64, max_step_tokens=512, max_chunk=256, max_prefill_chunks=4)
PREFILL = EngineSpec(max_slots=16, max_step_tokens=2048, max_chunk=2048, max_prefill_chunks=8)
DECODE = EngineSpec(max_slots=128, max_step_tokens=128, max_chunk=1, max_prefill_chunks=1)


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  model: ModelConfig
  hw: Hardware
  chips: int
  weights: WeightsDtype = "bf16"
  instance_chips: int = 0  # 0: instance_chips(model, hw, weights)
  mixed: EngineSpec = MIXED
  prefill: EngineSpec = PREFILL
  decode: EngineSpec = DECODE
  link_bytes_per_s_per_chip: float = 50e9
  link_latency_s: float = 1e-4
  kv_reserve: float = 0.1  # HBM kept for activations and programs
  calibration: Calibration | None = None
  early_reject: bool = False


class Planner:
  def __init__(self, spec: ClusterSpec):
    self.spec = spec
    self.chips_per_instance = spec.instance_chips or instance_chips(spec.model, spec.hw,
                                                                    spec.weights)
    if self.chips_per_instance > spec.chips:
      raise ValueError(f"{spec.chips} chips cannot hold one {self.chips_per_instance}-chip "
                       f"instance of {spec.model.name} ({spec.weights})")
    self.instances = spec.chips // self.chips_per_instance
    self._pools: dict[str, tuple[CostModelStepTime, int]] = {}

  def _pool(self, role: str, eng: EngineSpec) -> tuple[CostModelStepTime, int]:
    if role not in self._pools:
      s = self.spec
      st = CostModelStepTime.build(
          s.model, s.hw, self.chips_per_instance, s.weights, max_slots=eng.max_slots,
          prefill_tokens=eng.max_step_tokens, calibration=s.calibration)
      kv = st.kv_capacity_tokens(s.kv_reserve)
      if kv < 1:
        raise ValueError(f"{s.model.name} ({s.weights}) leaves no HBM for KV on "
                         f"{self.chips_per_instance} x {s.hw.name}")
      self._pools[role] = (st, kv)
    return self._pools[role]

  def interleaved(self) -> SimDeployment:
    st, kv = self._pool("mixed", self.spec.mixed)
    return SimDeployment.interleaved(self.instances, self.spec.mixed, st, kv,
                                  self.chips_per_instance, self.spec.early_reject)

  def disaggregated(self, prefill: int, decode: int) -> SimDeployment:
    if prefill + decode > self.instances:
      raise ValueError(f"{prefill} + {decode} instances > the cluster's {self.instances}")
    s = self.spec
    pst, pkv = self._pool("prefill", s.prefill)
    dst, dkv = self._pool("decode", s.decode)
    n = self.chips_per_instance
    return SimDeployment.disaggregated(
        Pool("prefill", prefill, s.prefill, pst, pkv, n), Pool("decode", decode, s.decode, dst,
                                                                dkv, n),
        link_bytes_per_s=s.link_bytes_per_s_per_chip * n,
        kv_bytes_per_token=kv_bytes(s.model, 1), link_latency_s=s.link_latency_s,
        early_reject=s.early_reject)

  def describe(self) -> dict[str, object]:
    out: dict[str, object] = {"model": self.spec.model.name, "hardware": self.spec.hw.name,
                              "chips": self.spec.chips, "weights": self.spec.weights,
                              "chips_per_instance": self.chips_per_instance,
                              "instances": self.instances}
    for role, (st, kv) in self._pools.items():
      out[role] = {**st.describe(), "kv_tokens": kv}
    return out
