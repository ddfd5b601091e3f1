"""Analytic cost of one inference step of a partitioned decoder (Pope et al., MLSys 2023).

Contract: ``step_cost(model, hw, layout, attention, mesh, phase, batch, context, weights)``
returns a frozen ``StepCost`` (seconds, bytes, MFU) for one forward pass of the whole model, or
raises ``ValueError`` for an invalid combination; ``check_layout`` (and its structural part
``structural_reason``) returns the reason a combination is invalid (``None`` when valid). Pure
arithmetic, no JAX. Layout names are shared with ``partitioning.layouts``: FFN
``ws_1d ws_2d wg_x wg_xy wg_xyz``, attention ``heads batch_z batch_yz batch_xyz``; the mesh is
``MeshShape (x, y, z)``. ``prefill``: ``batch`` sequences of ``context`` tokens in one pass;
``decode``: one token per sequence attending to ``context`` cached ones.
latency = max(compute_s, weight_mem_s + kv_mem_s) + comm_s (collectives not overlapped, as the
paper's analysis; per-layer collective volumes with exact ring fractions and a per-hop floor).
The formulas, assumptions and what is not modelled: BUILD_NOTES.md, "Analytic cost model".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from models.config import ModelConfig
from partitioning.hardware import Hardware

Phase = Literal["prefill", "decode"]
WeightsDtype = Literal["bf16", "int8"]
FfnLayoutName = Literal["ws_1d", "ws_2d", "wg_x", "wg_xy", "wg_xyz"]
AttnLayoutName = Literal["heads", "batch_z", "batch_yz", "batch_xyz"]
MeshShape = tuple[int, int, int]

FFN_LAYOUT_NAMES: tuple[FfnLayoutName, ...] = ("ws_1d", "ws_2d", "wg_x", "wg_xy", "wg_xyz")
ATTN_LAYOUT_NAMES: tuple[AttnLayoutName, ...] = ("heads", "batch_z", "batch_yz", "batch_xyz")
PHASES: tuple[Phase, ...] = ("prefill", "decode")
WEIGHT_BYTES: dict[str, int] = {"bf16": 2, "int8": 1}

ACT_BYTES = 2  # bf16 activations and KV cache
_AXES = "xyz"
# Mesh axes the batch is sharded over by each FFN layout (``layouts.FFN_LAYOUTS[...].residual``),
# and the axes each attention layout names (``layouts.ATTN_LAYOUTS[...].batch_axes``).
_FFN_BATCH_AXES: dict[str, str] = {
    "ws_1d": "", "ws_2d": "", "wg_x": "x", "wg_xy": "xy", "wg_xyz": "xyz"}
_ATTN_BATCH_AXES: dict[str, str] = {
    "heads": "", "batch_z": "z", "batch_yz": "yz", "batch_xyz": "xyz"}


@dataclasses.dataclass(frozen=True)
class StepCost:
  """Predicted cost of one step (prefill: the whole prompt pass; decode: one token)."""

  n_chips: int
  tokens: int  # tokens produced/processed by the step: B*context (prefill) or B (decode)
  flops: float  # model FLOPs of the step
  compute_s: float
  weight_mem_s: float
  kv_mem_s: float
  comm_s: float  # all collectives: bandwidth terms + latency floors
  collective_floor_s: float  # the latency-floor part of comm_s
  all_to_all_s: float  # the attention all-to-all part of comm_s (bandwidth + floor)
  latency_s: float
  mfu: float
  cost_chip_s_per_token: float
  weight_bytes_per_chip: float  # resident weights
  kv_bytes_per_chip: float
  hbm_bytes_per_chip: float  # everything resident: weights + KV + gather buffer + activations
  fits: bool


def _axes_size(mesh: MeshShape, axes: str) -> int:
  return math.prod(mesh[_AXES.index(a)] for a in axes)


def ffn_batch_chips(layout: str, mesh: MeshShape) -> int:
  """Chips the FFN layout shards the batch over (1 for weight-stationary layouts)."""
  return _axes_size(mesh, _FFN_BATCH_AXES[layout])


# The attention batch axes re-derive ``layouts._make_plan`` (``rb``, ``move``, ``ab = rb + move``)
# for the no-fallback case the cost model assumes (every sharded dimension divides; then every
# mesh axis shards either the query heads or the residual batch, so no named axis is idle).
# layouts.py imports JAX and needs a real Mesh, so it is not imported here;
# tests/partitioning/test_cost_model.py::test_attention_axes_agree_with_make_plan checks the agreement.


def _live(mesh: MeshShape, axes: str) -> str:
  return "".join(a for a in axes if mesh[_AXES.index(a)] > 1)


def all_to_all_axes(layout: str, attention: str, mesh: MeshShape) -> str:
  """Axes the attention all-to-all moves Q over (``LayoutPlan.move``): the attention layout's named
  axes that are not already batch axes of the FFN layout (size-1 axes dropped)."""
  rb = _FFN_BATCH_AXES[layout]
  return "".join(a for a in _live(mesh, _ATTN_BATCH_AXES[attention]) if a not in rb)


def attention_batch_axes(layout: str, attention: str, mesh: MeshShape) -> str:
  """Axes the attention core and the KV cache shard the batch over (``LayoutPlan.ab``): the FFN's
  batch axes (kept: no layout moves the batch back to heads), then ``all_to_all_axes``."""
  return _live(mesh, _FFN_BATCH_AXES[layout]) + all_to_all_axes(layout, attention, mesh)


def attention_batch_chips(layout: str, attention: str, mesh: MeshShape) -> int:
  """Chips the attention core shards the batch (and the KV cache) over."""
  return _axes_size(mesh, attention_batch_axes(layout, attention, mesh))


def structural_reason(layout: str, attention: str, mesh: MeshShape) -> str | None:
  """Why ``(layout, attention, mesh)`` is not a distinct plan on that mesh, or None.

  Covers unknown names, malformed meshes, and degenerate shapes that duplicate another layout
  (``batch_z`` with z = 1 is ``heads``; ``wg_x`` with y*z = 1 is ``wg_xyz``; ...; ``wg_xyz``
  itself is valid on any mesh of more than one chip), so a planner
  enumerating every mesh can skip these silently and still see each plan once.
  """
  if layout not in FFN_LAYOUT_NAMES:
    return f"unknown ffn layout {layout!r}"
  if attention not in ATTN_LAYOUT_NAMES:
    return f"unknown attention layout {attention!r}"
  if len(mesh) != 3 or any(int(d) != d or d < 1 for d in mesh):
    return f"mesh must be three positive ints, got {mesh!r}"
  x, y, z = mesh
  if x * y * z == 1:
    if layout != "ws_1d" or attention != "heads":
      return "one chip: only ws_1d with heads (no partitioning) applies"
    return None
  if layout == "ws_2d" and (x == 1 or y * z == 1):
    return "ws_2d needs x > 1 and y*z > 1"
  if layout in ("wg_x", "wg_xy"):  # wg_xyz (gather over every chip) applies to any mesh
    gathered = _FFN_BATCH_AXES[layout]
    if any(mesh[_AXES.index(a)] == 1 for a in gathered):
      return f"{layout} needs every gathered axis ({gathered}) > 1"
    rest = "".join(a for a in _AXES if a not in gathered)
    if _axes_size(mesh, rest) == 1:
      return f"{layout} with the remaining axes of size 1 is wg_xyz"
  degenerate = {"batch_z": ("z", "heads"), "batch_yz": ("y", "batch_z"),
                "batch_xyz": ("x", "batch_yz")}
  if attention in degenerate:
    axis, same_as = degenerate[attention]
    if mesh[_AXES.index(axis)] == 1:
      return f"{attention} with {axis} = 1 is {same_as}"
  return None


def check_layout(layout: str, attention: str, mesh: MeshShape, batch: int) -> str | None:
  """Why ``(layout, attention, mesh)`` is invalid for ``batch`` sequences, or None if valid.

  ``structural_reason`` first, then divisibility: the batch must split evenly over the
  weight-gathered chips (wg_*) and over the attention batch chips (``attention_batch_chips``).
  """
  reason = structural_reason(layout, attention, mesh)
  if reason:
    return reason
  if batch < 1:
    return f"batch must be >= 1, got {batch}"
  chips = ffn_batch_chips(layout, mesh)
  if batch % chips:
    return f"batch {batch} is not divisible by the {chips} weight-gathered chips of {layout}"
  chips = attention_batch_chips(layout, attention, mesh)
  if batch % chips:
    axes = attention_batch_axes(layout, attention, mesh)
    return (f"batch {batch} is not divisible by the {chips} attention batch chips "
            f"({axes}) of {layout}+{attention}")
  return None


def canonical_attention(layout: str, attention: str, mesh: MeshShape) -> str:
  """The attention name of the program ``(layout, attention)`` runs on ``mesh``.

  Pairs with the same attention batch axes run the same program (e.g. ``wg_xyz`` + any attention
  layout; ``wg_xy`` + ``batch_z/yz/xyz``); among the structurally valid names the one naming the
  most axes is canonical (its name then matches the attention batch axes: ``wg_xyz`` +
  ``batch_xyz``). The planner reports each program once, under this name.
  """
  axes = set(attention_batch_axes(layout, attention, mesh))
  same = [a for a in ATTN_LAYOUT_NAMES if not structural_reason(layout, a, mesh)
          and set(attention_batch_axes(layout, a, mesh)) == axes]
  return same[-1] if same else attention


def optimal_2d_x(model: ModelConfig, n_chips: int) -> float:
  """The paper's optimal E-axis size for ws_2d: X = sqrt(n*E/F) (0.5*sqrt(n) when F = 4E)."""
  return math.sqrt(n_chips * model.embed_dim / model.mlp_dim)


def optimal_wg_chips(model: ModelConfig, tokens: int, n_chips: int,
                     weights: WeightsDtype = "bf16") -> float:
  """Weight-gathered size N minimising 2EFwN/(nW) + 2TEa/(NW): N = sqrt(T*n*a/(F*w))."""
  w = WEIGHT_BYTES[weights]
  return math.sqrt(tokens * n_chips * ACT_BYTES / (model.mlp_dim * w))


def _layer_params(model: ModelConfig) -> float:
  # param_count(False) = L * per_layer + final norm (E); remove the final norm.
  return (model.param_count(include_embedding=False) - model.embed_dim) / model.num_layers


def step_flops(model: ModelConfig, phase: Phase, batch: int, context: int) -> float:
  """Model FLOPs of one step (matmuls + attention scores/values), see module docstring."""
  tokens = batch * context if phase == "prefill" else batch
  mean_context = (context + 1) / 2 if phase == "prefill" else float(context)
  attention = model.num_layers * 4.0 * model.num_heads * model.head_dim * mean_context
  return tokens * (model.flops_per_token(0) + attention)


def kv_cache_bytes(model: ModelConfig, batch: int, context: int) -> float:
  """Total (unsharded) bf16 KV cache of ``batch`` sequences of ``context`` tokens."""
  return (model.num_layers * batch * context * 2.0 * model.num_kv_heads * model.head_dim
          * ACT_BYTES)


def validate_workload(phase: str, batch: int, context: int, weights: str) -> None:
  """Raises ValueError unless phase/batch/context/weights describe a valid step."""
  if phase not in PHASES:
    raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
  if weights not in WEIGHT_BYTES:
    raise ValueError(f"weights must be one of {tuple(WEIGHT_BYTES)}, got {weights!r}")
  if batch < 1:
    raise ValueError(f"batch must be >= 1, got {batch}")
  if context < (1 if phase == "prefill" else 0):
    raise ValueError(f"context must be >= {1 if phase == 'prefill' else 0} for {phase}")


def loops_ffn(layout: str) -> bool:
  """Whether ``--collective_matmul`` changes ``layout``'s program: the weight-stationary
  layouts' activation collectives around the FFN (a parallel block's one pair, shared with
  attention; ``partitioning.layouts.LayoutPlan.looped``)."""
  return layout in ("ws_1d", "ws_2d")


def step_cost(model: ModelConfig, hw: Hardware, layout: FfnLayoutName, attention: AttnLayoutName,
              mesh: MeshShape, phase: Phase, batch: int, context: int,
              weights: WeightsDtype = "bf16", collective_matmul: bool = False) -> StepCost:
  """Predicted cost of one ``phase`` step; raises ValueError for invalid inputs.
  ``collective_matmul``: where ``loops_ffn``, the FFN's activation all-gather and
  reduce-scatter run under its matmuls (the looped einsum): only what exceeds the FFN's compute
  time stays exposed, the rest of the communication as before."""
  validate_workload(phase, batch, context, weights)
  reason = check_layout(layout, attention, mesh, batch)
  if reason:
    raise ValueError(reason)
  x, y, z = mesh
  n = x * y * z
  e, f = model.embed_dim, model.mlp_dim
  w = WEIGHT_BYTES[weights]
  a = ACT_BYTES
  tokens = batch * context if phase == "prefill" else batch
  serial = 1 if model.parallel_block else 2  # serial blocks: attention has its own collectives

  layer_weight_bytes = _layer_params(model) * w
  total_weight_bytes = model.param_count(include_embedding=True) * w
  embed_weight_bytes = total_weight_bytes - model.num_layers * layer_weight_bytes
  # The k / v projections [E, K, H]: kv heads are never sharded (``layouts``), so each chip holds
  # them whole under ws_1d (E unsharded) and split over x only under the E_x layouts; a
  # weight-gathered layout gathers them whole (its gather axes include x).
  kv_proj_bytes = 2.0 * e * model.num_kv_heads * model.head_dim * w  # per layer
  kv_proj_resident = kv_proj_bytes / (1 if layout == "ws_1d" else x)
  kv_proj_read = kv_proj_bytes if layout == "ws_1d" or layout.startswith("wg") else \
      kv_proj_bytes / x

  # --- Feed-forward (and fused attention projection) collectives, per layer.
  comm = 0.0  # bytes/W seconds
  steps = 0  # ring hops
  gathered = 1  # N, chips the weights are all-gathered over
  ring = hw.ring_fraction

  def wire(axes: str) -> float:  # bytes/s of a collective over these mesh axes
    return hw.collective_bandwidth(len(_live(mesh, axes)))

  looped = 0.0  # bytes/W seconds per layer hidden under the FFN's matmuls (collective matmul)
  if layout == "ws_1d":  # a single chip communicates nothing: ring(1) = 0
    comm += serial * 2 * tokens * e * a * ring(n) / wire("xyz")
    steps += serial * 2 * hw.collective_steps(n)
    looped = 2 * tokens * e * a * ring(n) / wire("xyz")
  elif layout == "ws_2d":
    yz = y * z
    comm += serial * 2 * tokens * a * (e / x * ring(yz) / wire("yz") + f / yz * ring(x) / wire("x"))
    steps += serial * 2 * (hw.collective_steps(yz) + hw.collective_steps(x))
    looped = 2 * tokens * a * e / x * ring(yz) / wire("yz")
  else:
    gathered = ffn_batch_chips(layout, mesh)
    gathered_axes = _FFN_BATCH_AXES[layout]
    rest = n // gathered
    comm += layer_weight_bytes * gathered / n * ring(gathered) / wire(gathered_axes)
    steps += serial * 2 * hw.collective_steps(gathered)
    if rest > 1:
      rest_axes = "".join(ax for ax in _AXES if ax not in gathered_axes)
      comm += serial * 2 * (tokens / gathered) * e * a * ring(rest) / wire(rest_axes)
      steps += serial * 2 * hw.collective_steps(rest)

  # --- Attention all-to-all, per layer: Q heads -> batch and the output back over
  # all_to_all_axes (collectives._attention); K/V are sliced, not moved.
  a2a_axes = all_to_all_axes(layout, attention, mesh)
  a2a_group = _axes_size(mesh, a2a_axes)
  a2a = a2a_steps = 0.0
  if a2a_group > 1:
    qo = tokens * 2 * model.num_heads * model.head_dim * a
    a2a = hw.all_to_all_time(qo * a2a_group / n, a2a_group, len(a2a_axes))
    a2a_steps = 2 * hw.collective_steps(a2a_group)

  step_s = hw.collective_step_latency_s
  floor_s = model.num_layers * (steps + a2a_steps) * step_s
  comm_s = model.num_layers * (comm + a2a) + floor_s
  all_to_all_s = model.num_layers * (a2a + a2a_steps * step_s)

  # --- Memory. KV cache [L, B.ab, K, S, H]: batch-sharded over the attention batch axes,
  # kv heads never sharded (replicated over the other chips).
  kv_per_chip = (kv_cache_bytes(model, batch, context)
                 / attention_batch_chips(layout, attention, mesh))
  rest_layer = layer_weight_bytes - kv_proj_bytes
  resident_weights = ((total_weight_bytes - model.num_layers * kv_proj_bytes) / n
                      + model.num_layers * kv_proj_resident)
  weights_read = (model.num_layers * (rest_layer * gathered / n + kv_proj_read)
                  + embed_weight_bytes / n)
  gather_buffer = layer_weight_bytes * gathered / n if gathered > 1 else 0.0
  activations = tokens * 2 * e * a / n  # residual stream in + out; see module docstring
  hbm_needed = resident_weights + kv_per_chip + gather_buffer + activations

  flops = step_flops(model, phase, batch, context)
  # The k / v projections' FLOPs are repeated on every chip holding the same slice of them and
  # of the tokens: split over x (E_x) under ws_2d, over the batch chips under the weight-gathered
  # layouts, not at all under ws_1d (the compute side of the placement above).
  kv_split = x if layout == "ws_2d" else ffn_batch_chips(layout, mesh)
  kv_flops = model.num_layers * 2.0 * tokens * e * 2 * model.num_kv_heads * model.head_dim
  redundant = kv_flops * (1.0 / kv_split - 1.0 / n)  # per chip, beyond its even share
  compute_s = (flops / n + redundant) / hw.peak_flops_bf16
  if collective_matmul and loops_ffn(layout):
    # The FFN's share of the matmul FLOPs (gate, up, down of E x F each) is the time its looped
    # collectives can hide under; what they need beyond it stays exposed.
    glu_mats = 3 if model.activation in ("swiglu", "geglu") else 2
    ffn_s = model.num_layers * 2.0 * tokens * glu_mats * e * f / n / hw.peak_flops_bf16
    hidden = min(model.num_layers * looped, ffn_s)
    comm_s -= hidden
  weight_mem_s = weights_read / hw.hbm_bandwidth
  kv_mem_s = kv_per_chip / hw.hbm_bandwidth
  latency_s = max(compute_s, weight_mem_s + kv_mem_s) + comm_s
  return StepCost(
      n_chips=n, tokens=tokens, flops=flops, compute_s=compute_s, weight_mem_s=weight_mem_s,
      kv_mem_s=kv_mem_s, comm_s=comm_s, collective_floor_s=floor_s, all_to_all_s=all_to_all_s,
      latency_s=latency_s,
      mfu=flops / (latency_s * n * hw.peak_flops_bf16),
      cost_chip_s_per_token=latency_s * n / tokens,
      weight_bytes_per_chip=resident_weights, kv_bytes_per_chip=kv_per_chip,
      hbm_bytes_per_chip=hbm_needed, fits=hbm_needed <= hw.hbm_bytes)
