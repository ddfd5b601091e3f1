"""Where the phases run: one device, one mesh with a layout per phase, or two sub-meshes.

Contract: ``Deployment`` names the mode and (optionally) each phase's layout ``"ffn:attn"``;
``make_steps(cfg, deployment, *, max_slots, max_chunk, max_context, quantized, devices=,
backend=)`` returns ``Steps(step, decode, kv_shards, describe)`` for ``serving.engine.Engine``,
every step on ``backend`` (a static ``models.cpu.backend.CpuBackend``, resolved by the caller):
  * ``single``: ``models.step.UnshardedStep`` on the first device (``scan_layers``: stacked).
  * ``interleaved``: one mesh over ``devices``, each phase in its own layout
    (``partitioning.paged_step.phase_steps``); one KV pool when both shard it alike (decode's
    own program over it when its layout differs: ``PhaseDecode(step)``), else decode gets its
    own pool and inserted pages move (``transfer_pages``).
  * ``disaggregated`` (Splitwise): ``prefill_devices`` (default half) prefill, the rest decode,
    each with its own params copy and pool.
An unset layout is chosen by ``partitioning.planner`` (on ``hardware``, calibrated by
``calibration``) and the reason reported; under several processes process 0's choice is used
everywhere. ``check_multiprocess`` says which deployments run over processes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Sequence

import jax

from models.config import ModelConfig
from models.cpu.backend import CpuBackend
from models.step import PhaseDecode, Step, UnshardedStep


Mode = Literal["single", "interleaved", "disaggregated"]
MODES: tuple[Mode, ...] = ("single", "interleaved", "disaggregated")


@dataclasses.dataclass(frozen=True)
class Deployment:
  mode: Mode = "single"
  prefill_layout: str | None = None  # "ffn:attn", e.g. "ws_2d:heads"; None = planner
  decode_layout: str | None = None
  prefill_devices: int | None = None  # disaggregated: devices for prefill (default half)
  hardware: str = "local"
  scan_layers: bool = False  # single: one lax.scan over stacked layers (models.transformer)
  # The planner's calibration (``partitioning.calibration.resolve``): "auto" = the one installed
  # for ``hardware`` if any, "none", or a launch.lab.calibrate JSON path.
  calibration: str = "auto"
  # The weight-stationary layouts' FFN collectives looped into its matmuls
  # (``partitioning.collective_matmul``); the planner costs them so.
  collective_matmul: bool = False

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
    if self.collective_matmul and self.mode == "single":
      raise ValueError("collective_matmul runs on a mesh (modes interleaved / disaggregated, "
                       "more than one device)")
    if self.scan_layers and self.mode != "single":
      raise ValueError("scan_layers runs in mode single only (the sharded step loops)")
    for name in ("prefill_layout", "decode_layout"):
      v = getattr(self, name)
      if v is not None and len(v.split(":")) != 2:
        raise ValueError(f"{name} must be 'ffn:attn' (e.g. ws_2d:batch_xyz), got {v!r}")


@dataclasses.dataclass(frozen=True)
class Steps:
  step: Step
  decode: PhaseDecode | None
  description: dict[str, object]

  @property
  def kv_shards(self) -> int:
    """Sub-pools for the host allocator: the least common multiple of the pools' shard counts
    (``partitioning.paged_step.PhaseSteps.kv_shards``)."""
    return math.lcm(self.step.kv_shards, (self.decode.step if self.decode else self.step).kv_shards)


def _choose(cfg: ModelConfig, given: str | None, phase: str, mesh: tuple[int, int, int],
            batch: int, context: int, quantized: bool, hardware: str,
            family: str | None = None, calibration: str = "auto",
            collective_matmul: bool = False) -> tuple[tuple[str, str], str]:
  """The given layout, or the planner's best on ``mesh``, the shape that will run it (another
  ordering of the same chips could make the pair invalid there, or cost it differently); with
  ``family`` (an FFN layout), only the layouts storing the weights as it does, so one resident
  params copy serves both phases and the pair that runs is the pair that was costed."""
  if given is not None:
    ffn, attn = given.split(":")
    return (ffn, attn), "given"
  from partitioning.calibration import resolve
  from partitioning.hardware import get_hardware
  from partitioning.planner import plan
  chips = mesh[0] * mesh[1] * mesh[2]
  hw = get_hardware(hardware)
  cal, calibrated_by = resolve(calibration, hw.name)
  ffns = None
  if family is not None:
    from partitioning.layouts import FFN_LAYOUTS, get_ffn_layout
    stored = get_ffn_layout(family).stored
    ffns = [name for name, lay in FFN_LAYOUTS.items() if lay.stored == stored]
  best = plan(cfg, hw, chips, phase, batch, context,  # type: ignore[arg-type]  # phase: a str
              weights="int8" if quantized else "bf16", meshes=[mesh],
              layouts=ffns,  # type: ignore[arg-type]  # layout names from FFN_LAYOUTS' keys
              calibration=cal, collective_matmul=collective_matmul).best
  how = ("" if cal is None else f", calibrated by {calibrated_by}") + (
      ", collective matmul" if best.collective_matmul else "")
  return (best.layout, best.attention), (
      f"planner ({hardware}{how}): {best.layout}+{best.attention}, predicted "
      f"{best.latency_s * 1e3:.3f} ms, MFU {best.mfu:.2f}")


def check_multiprocess(deployment: Deployment, host_tier_bytes: int = 0) -> None:
  """Under several processes (``jax.distributed``): ``interleaved`` only, no host tier
  (``ValueError`` naming why). ``single`` runs on one device; ``disaggregated`` copies KV pages
  between two disjoint device sets, which multi-controller JAX does between processes only on
  TPU's TFRT runtime (XLA:CPU: "input and target sharding should have the same set of
  devices"); the host tier reads pool pages into this process's memory."""
  if jax.process_count() == 1:
    return
  if deployment.mode != "interleaved":
    raise ValueError(f"mode {deployment.mode!r} does not run over {jax.process_count()} "
                     "processes: use --mode interleaved (one mesh over every process's devices)")
  if host_tier_bytes:
    raise ValueError("the host tier (--host_tier_bytes) does not run over several processes")


def make_steps(cfg: ModelConfig, deployment: Deployment, *, max_slots: int, max_chunk: int,
               max_context: int, quantized: bool,
               devices: Sequence[jax.Device] | None = None,
               backend: CpuBackend = CpuBackend()) -> Steps:
  if deployment.mode == "single":
    step = UnshardedStep(cfg, deployment.scan_layers, backend)
    return Steps(step, None, {"mode": "single", "step": step.describe()})
  from partitioning import paged_step as PS
  from partitioning.mesh import make_mesh, make_submeshes, mesh_shape
  devices = list(jax.devices() if devices is None else devices)
  if deployment.mode == "interleaved":
    pre_mesh = dec_mesh = make_mesh(devices)
  else:
    n_pre = deployment.prefill_devices or len(devices) // 2
    pre_mesh, dec_mesh = make_submeshes(devices, n_pre)
  from partitioning.distributed import agree

  def choose() -> list[object]:
    pre = _choose(cfg, deployment.prefill_layout, "prefill", mesh_shape(pre_mesh), 1,
                  max_chunk, quantized, deployment.hardware,
                  calibration=deployment.calibration,
                  collective_matmul=deployment.collective_matmul)
    # One mesh: decode shares prefill's resident params, so it is chosen in that family.
    family = pre[0][0] if deployment.mode == "interleaved" else None
    return [pre, _choose(cfg, deployment.decode_layout, "decode", mesh_shape(dec_mesh),
                         max_slots, max_context, quantized, deployment.hardware, family,
                         deployment.calibration, deployment.collective_matmul)]

  # A bad --calibration fails on every process here, not on process 0 alone inside ``agree``
  # (the others would wait for its answer until the timeout).
  if deployment.prefill_layout is None or deployment.decode_layout is None:
    from partitioning.calibration import resolve
    resolve(deployment.calibration, deployment.hardware)
  # Process 0's choice everywhere (``hardware="local"`` is measured: it could differ).
  (pre, pre_why), (dec, dec_why) = agree("deployment_layouts", choose)
  pre, dec = tuple(pre), tuple(dec)
  steps = PS.phase_steps(cfg, pre_mesh, pre, dec,
                         decode_mesh=dec_mesh if deployment.mode == "disaggregated" else None,
                         backend=backend, collective_matmul=deployment.collective_matmul)
  one_pool = deployment.mode == "interleaved" and not steps.relayout and steps.shared_params
  # One pool: decode runs its own program (its layout's collectives) over prefill's params and
  # pages, unless the two layouts are one.
  same = (steps.decode.ffn, steps.decode.attn) == (steps.prefill.ffn, steps.prefill.attn)
  decode = (None if same else PhaseDecode(steps.decode)) if one_pool else \
      PhaseDecode(steps.decode, PS.transfer_pages)
  desc = {"mode": deployment.mode, "prefill_choice": pre_why, "decode_choice": dec_why,
          "kv_pools": 1 if one_pool else 2, "decode_program": "prefill's" if decode is None
          else f"{steps.decode.ffn.name}+{steps.decode.attn.name}", **steps.describe(quantized)}
  return Steps(steps.prefill, decode, desc)
