"""Chooses a partitioning layout by enumerating the analytic cost model (Pope et al. 2023).

Contract: ``plan(model, hardware, chips, phase, batch, context, weights, objective,
latency_bound_s, calibration, meshes, layouts)`` evaluates every FFN layout x
attention layout x mesh ``(x, y, z)`` with x*y*z = chips, skipping shapes that duplicate another
(``cost_model.structural_reason``, ``cost_model.canonical_attention``) and dropping with a reason
what is invalid for the batch, does not fit in HBM or misses ``latency_bound_s``. It returns a
frozen ``Plan``: the candidates best first (equal-cost meshes collapsed to the most cubic) and the
dropped combinations. ``layouts`` / ``meshes`` restrict the FFN layouts / mesh shapes considered;
``calibration`` (``partitioning.calibration``) makes every cost the calibrated one.
Objectives: ``latency`` minimises step latency on exactly ``chips`` chips; ``cost`` minimises
chip-seconds per token and may use a sub-slice (any divisor of ``chips``). Ties break on the other
metric, then the most cubic mesh, then layout order. Raises ``ValueError`` for bad arguments and
``NoFeasiblePlan`` (a ValueError) when nothing is left.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

from models.config import ModelConfig
from partitioning import cost_model
from partitioning.cost_model import (
    ATTN_LAYOUT_NAMES, FFN_LAYOUT_NAMES, AttnLayoutName, FfnLayoutName, MeshShape, Phase, StepCost,
    WeightsDtype)
from partitioning.calibration import Calibration
from partitioning.hardware import Hardware

Objective = Literal["latency", "cost"]
OBJECTIVES: tuple[Objective, ...] = ("latency", "cost")


class NoFeasiblePlan(ValueError):
  """No layout is valid, fits in HBM and meets the latency bound."""


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One evaluated (layout, attention, mesh) with its predicted cost."""

  layout: FfnLayoutName
  attention: AttnLayoutName
  mesh: MeshShape
  cost: StepCost
  collective_matmul: bool = False  # costed with the FFN's collectives looped into its einsums

  @property
  def latency_s(self) -> float:
    return self.cost.latency_s

  @property
  def mfu(self) -> float:
    return self.cost.mfu

  @property
  def cost_chip_s_per_token(self) -> float:
    return self.cost.cost_chip_s_per_token

  @property
  def fits(self) -> bool:
    return self.cost.fits

  @property
  def attention_batch_axes(self) -> str:
    """Mesh axes attention and the KV cache shard the batch over (wg_* keep theirs)."""
    return cost_model.attention_batch_axes(self.layout, self.attention, self.mesh)

  def to_dict(self) -> dict[str, object]:
    c = self.cost
    return {
        "layout": self.layout, "attention": self.attention, "mesh": list(self.mesh),
        "collective_matmul": self.collective_matmul,
        "attention_batch_axes": self.attention_batch_axes, "n_chips": c.n_chips,
        "latency_s": c.latency_s, "mfu": c.mfu,
        "cost_chip_s_per_token": c.cost_chip_s_per_token, "fits": c.fits,
        "compute_s": c.compute_s, "weight_mem_s": c.weight_mem_s, "kv_mem_s": c.kv_mem_s,
        "comm_s": c.comm_s, "collective_floor_s": c.collective_floor_s,
        "all_to_all_s": c.all_to_all_s,
        "hbm_bytes_per_chip": c.hbm_bytes_per_chip,
    }


@dataclasses.dataclass(frozen=True)
class Dropped:
  """A combination the planner rejected, and why."""

  layout: str
  attention: str
  mesh: MeshShape
  reason: str


@dataclasses.dataclass(frozen=True)
class Plan:
  """The planner's answer: ``best`` is ``candidates[0]``."""

  objective: Objective
  phase: Phase
  batch: int
  context: int
  weights: WeightsDtype
  candidates: tuple[Candidate, ...]
  dropped: tuple[Dropped, ...]

  @property
  def best(self) -> Candidate:
    return self.candidates[0]

  def to_dict(self, top: int = 10) -> dict[str, object]:
    best = self.best
    return {
        "layout": best.layout, "attention": best.attention, "mesh": list(best.mesh),
        "collective_matmul": best.collective_matmul,
        "attention_batch_axes": best.attention_batch_axes, "n_chips": best.cost.n_chips,
        "latency_s": best.latency_s, "mfu": best.mfu,
        "cost_chip_s_per_token": best.cost_chip_s_per_token, "objective": self.objective,
        "phase": self.phase, "batch": self.batch, "context": self.context,
        "weights": self.weights, "num_candidates": len(self.candidates),
        "num_dropped": len(self.dropped),
        "candidates": [c.to_dict() for c in self.candidates[:top]],
    }


def mesh_shapes(chips: int) -> tuple[MeshShape, ...]:
  """Every ordered factorisation ``(x, y, z)`` of ``chips``, sorted."""
  shapes = []
  for x in range(1, chips + 1):
    if chips % x:
      continue
    rest = chips // x
    for y in range(1, rest + 1):
      if rest % y == 0:
        shapes.append((x, y, rest // y))
  return tuple(shapes)


def _sort_key(objective: Objective,
              cand: Candidate) -> tuple[float, float, tuple[int, ...], int, int, MeshShape]:
  """Objective, then the other metric, then the most cubic mesh, then layout order."""
  primary, secondary = cand.latency_s, cand.cost_chip_s_per_token
  if objective == "cost":
    primary, secondary = secondary, primary
  return (primary, secondary, tuple(sorted(cand.mesh, reverse=True)),
          FFN_LAYOUT_NAMES.index(cand.layout), ATTN_LAYOUT_NAMES.index(cand.attention), cand.mesh)


def plan(model: ModelConfig, hardware: Hardware, chips: int, phase: Phase, batch: int,
         context: int, weights: WeightsDtype = "bf16", objective: Objective = "latency",
         latency_bound_s: float | None = None, calibration: Calibration | None = None,
         meshes: "Sequence[MeshShape] | None" = None,
         layouts: "Sequence[FfnLayoutName] | None" = None,
         collective_matmul: bool | None = False) -> Plan:
  """Best layout for the workload; see the module docstring. ``collective_matmul``: None costs
  both variants of each layout it changes (``cost_model.loops_ffn``), a bool only that one."""
  if chips < 1:
    raise ValueError(f"chips must be >= 1, got {chips}")
  if chips > hardware.max_chips:
    raise ValueError(f"chips={chips} exceeds {hardware.name}'s interconnect domain "
                     f"({hardware.max_chips} chips)")
  if objective not in OBJECTIVES:
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
  if latency_bound_s is not None and not latency_bound_s > 0:
    raise ValueError(f"latency_bound_s must be > 0, got {latency_bound_s}")
  cost_model.validate_workload(phase, batch, context, weights)

  sizes = [chips] if objective == "latency" else [d for d in range(1, chips + 1) if chips % d == 0]
  kept: list[Candidate] = []
  dropped: list[Dropped] = []
  for n in sizes:
    shapes = mesh_shapes(n) if meshes is None else [
        (m[0], m[1], m[2]) for m in meshes if m[0] * m[1] * m[2] == n]
    for mesh in shapes:
      for layout in (FFN_LAYOUT_NAMES if layouts is None else
                     [name for name in FFN_LAYOUT_NAMES if name in layouts]):
        for attention in ATTN_LAYOUT_NAMES:
          if (cost_model.structural_reason(layout, attention, mesh)
              or cost_model.canonical_attention(layout, attention, mesh) != attention):
            continue  # not a distinct plan on this mesh (e.g. batch_z with z = 1 is heads)
          reason = cost_model.check_layout(layout, attention, mesh, batch)
          if reason is not None:
            dropped.append(Dropped(layout, attention, mesh, reason))
            continue
          loops = cost_model.loops_ffn(layout)
          variants = [False, True] if collective_matmul is None and loops else \
              [bool(collective_matmul) and loops]
          for looped in variants:
            cost = cost_model.step_cost(model, hardware, layout, attention, mesh, phase, batch,
                                        context, weights, collective_matmul=looped)
            if calibration is not None:
              cost = calibration.apply(cost, model.num_layers)
            if not cost.fits:
              reason = (f"does not fit in HBM: {cost.hbm_bytes_per_chip / 2**30:.1f} GiB per "
                        f"chip > {hardware.hbm_bytes / 2**30:.1f} GiB")
            elif latency_bound_s is not None and cost.latency_s > latency_bound_s:
              reason = f"latency {cost.latency_s:.4g} s > bound {latency_bound_s:.4g} s"
            else:
              kept.append(Candidate(layout, attention, mesh, cost, looped))
              continue
            dropped.append(Dropped(layout, attention, mesh, reason))
  if not kept:
    raise NoFeasiblePlan(
        f"no layout for {model.name} on {chips} x {hardware.name} ({phase}, batch {batch}, "
        f"context {context}, {weights} weights): {_summarise(dropped)}")
  kept.sort(key=lambda c: _sort_key(objective, c))
  unique: list[Candidate] = []
  seen: set[tuple[str, str, StepCost, bool]] = set()
  for cand in kept:  # meshes the model cannot tell apart (y <-> z, ...): keep the most cubic
    key = (cand.layout, cand.attention, cand.cost, cand.collective_matmul)
    if key not in seen:
      seen.add(key)
      unique.append(cand)
  return Plan(objective=objective, phase=phase, batch=batch, context=context, weights=weights,
              candidates=tuple(unique), dropped=tuple(dropped))


def _summarise(dropped: list[Dropped]) -> str:
  """One line: how many combinations were dropped for which reason, with an example each."""
  groups: dict[str, list[Dropped]] = {}
  for d in dropped:
    kind = ("HBM" if d.reason.startswith("does not fit") else
            "latency bound" if d.reason.startswith("latency") else "batch divisibility")
    groups.setdefault(kind, []).append(d)
  if not groups:
    return "no layout applies to this mesh size"
  parts = []
  for kind, items in groups.items():
    if kind == "HBM":
      example = min(items, key=lambda d: float(d.reason.split(": ")[1].split(" GiB")[0]))
    elif kind == "latency bound":
      example = min(items, key=lambda d: float(d.reason.split()[1]))
    else:
      example = items[0]
    parts.append(f"{len(items)} fail {kind} (best: {example.layout}/{example.attention} "
                 f"{'x'.join(map(str, example.mesh))}: {example.reason})")
  return "; ".join(parts)
