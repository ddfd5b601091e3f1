"""Accelerator descriptions for the analytic cost model, plus tiny on-device micro-benchmarks.

Contract:
  * ``Hardware`` is a frozen, hashable description of ONE chip and the interconnect it sits in.
    All rates are per chip: FLOP/s, bytes/s, bytes. ``network_bandwidth`` is the paper's W
    (Pope et al. 2023, Appendix A.1): the per-chip bandwidth a collective runs at.
  * ``get_hardware(name)`` returns a preset (``HARDWARE_NAMES``); ``"local"`` runs
    ``measure_local()`` on the current default JAX device (seconds of benchmarking).
  * ``measure_matmul_peak(dtype, size) -> FLOP/s`` and ``measure_read_bandwidth(nbytes) -> bytes/s``
    time jitted work on the default device (best of a few repetitions); the lab's
    ``bench_model`` uses them too.
JAX is imported lazily inside the measuring functions, so the cost model and planner (pure
arithmetic) import without initialising a backend. The presets' published sources (decimal
units) are listed in BUILD_NOTES "Design: Partitioning".
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from jax.typing import DTypeLike


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One accelerator chip and its interconnect (all figures per chip)."""

  name: str
  peak_flops_bf16: float  # dense matmul FLOP/s
  peak_flops_int8: float  # dense int8 OP/s (unused by weight-only int8; kept for reference)
  hbm_bandwidth: float  # bytes/s
  hbm_bytes: float  # HBM capacity, bytes
  # Torus: one-way bytes/s of ONE link (one axis, one direction). Switch: one-way bytes/s of the
  # chip's whole NVLink port (the fabric is non-blocking, so axes do not matter).
  ici_bandwidth: float
  torus_dims: int  # 3 = 3D torus, 2 = 2D torus, 0 = switched fabric (NVSwitch)
  collective_step_latency_s: float  # fixed cost of one collective step (one ring hop)
  max_chips: int  # largest slice / NVLink domain the interconnect model covers
  # How collectives are charged (``ring_fraction``, ``collective_bandwidth``). The defaults are
  # the ones the TPU v4 fit set selects (BUILD_NOTES "Collective volumes and links").
  ring_volumes: bool = True  # a g-chip all-gather moves (g-1)/g of its tensor; False: all of it
  axis_links: bool = False  # torus: a collective gets only its axes' links; False: W for every one

  def __post_init__(self):
    for field in ("peak_flops_bf16", "peak_flops_int8", "hbm_bandwidth", "hbm_bytes",
                  "ici_bandwidth"):
      if not getattr(self, field) > 0:
        raise ValueError(f"Hardware.{field} must be > 0, got {getattr(self, field)!r}")
    if self.torus_dims not in (0, 1, 2, 3):
      raise ValueError(f"torus_dims must be 0..3, got {self.torus_dims}")
    if self.collective_step_latency_s < 0 or self.max_chips < 1:
      raise ValueError("collective_step_latency_s must be >= 0 and max_chips >= 1")

  @property
  def network_bandwidth(self) -> float:
    """The paper's W: per-chip bytes/s of an all-gather / reduce-scatter.

    Torus: every link of the chip, both directions (bidirectional rings on every axis):
    2 * links_per_axis_direction * dims, e.g. 2 * 45 GB/s * 3 = 270 GB/s on TPU v4 [pope].
    Switch: the one-way port bandwidth (a ring over a switch sends and receives at that rate).
    Following the paper (A.1) every collective is charged at W regardless of which mesh axes it
    spans; on a real torus a single-axis collective only gets 2 * ici_bandwidth.
    """
    if self.torus_dims == 0:
      return self.ici_bandwidth
    return 2.0 * self.ici_bandwidth * self.torus_dims

  def ring_fraction(self, group: int) -> float:
    """Share of the full tensor each chip receives in an all-gather (sends in a reduce-scatter)
    over ``group`` chips: (group-1)/group for a ring, exact on every group size; 1 with
    ``ring_volumes=False`` (the paper's App. A.1 approximation, D/W); 0 for one chip."""
    if group <= 1:
      return 0.0
    return (group - 1) / group if self.ring_volumes else 1.0

  def collective_bandwidth(self, axes: int) -> float:
    """Bytes/s of a collective over ``axes`` live mesh axes: ``network_bandwidth`` (the paper's
    W for every collective), or with ``axis_links`` on a torus the links of those axes only,
    ``axes / torus_dims`` of W (one axis: 2 * ici_bandwidth). Mesh axes are taken as the
    torus's physical axes (a (1, 1, 8) mesh gets one axis' links, though an 8-chip slice is a
    2x2x2 cube)."""
    if not self.axis_links or self.torus_dims == 0:
      return self.network_bandwidth
    return self.network_bandwidth * min(max(axes, 1), self.torus_dims) / self.torus_dims

  def collective_steps(self, group: int) -> int:
    """Sequential steps (hops) of a collective over ``group`` chips; 0 when group <= 1.

    Torus: the group is laid out on ``d = min(dims, ceil(log2(group) / 2))`` axes, as evenly as
    possible (8 -> 4x2, 32 -> 4x4x2; other sizes are rounded up to a power of two); a
    bidirectional ring of length l needs floor(l/2) hops (at least 1). Switch: recursive doubling, ceil(log2(group)).
    Counting hops (not a flat per-collective constant) keeps a 64-chip 1D collective as slow as
    a 16-chip plus a 4-chip one, as it is on a 4x4x4 torus.
    """
    if group <= 1:
      return 0
    bits = math.ceil(math.log2(group))  # a non-power-of-two group costs as its power-of-two cover
    if self.torus_dims == 0:
      return bits
    dims = min(self.torus_dims, max(1, math.ceil(bits / 2)))
    lengths = [2 ** (bits // dims + (i < bits % dims)) for i in range(dims)]
    return sum(max(1, length // 2) for length in lengths)

  def all_to_all_time(self, group_bytes: float, group: int, axes: int | None = None) -> float:
    """Seconds for an all-to-all of a tensor of ``group_bytes`` (total over the group) spanning
    ``axes`` live mesh axes (None: all of them; it matters only with ``axis_links``).

    Torus: a quarter of the paper's D/W all-gather of the same tensor (bidirectional ring, mean
    distance group/4) [book]; exact for a ring of any even size, so no ring factor applies.
    Switch: each chip ships its (group-1)/group share of its 1/group slice.
    """
    if group <= 1:
      return 0.0
    if self.torus_dims == 0:
      return group_bytes * (group - 1) / group / group / self.network_bandwidth
    bandwidth = self.collective_bandwidth(self.torus_dims if axes is None else axes)
    return group_bytes / (4.0 * bandwidth)


_GiB = float(2**30)

_PRESETS: dict[str, Hardware] = {
    # [pope] Section 4; ICI 45 GB/s one way per link [book: v4p 4.5e10]; 4096-chip pod.
    "tpu-v4": Hardware(
        name="tpu-v4", peak_flops_bf16=275e12, peak_flops_int8=275e12, hbm_bandwidth=1.2e12,
        hbm_bytes=32 * _GiB, ici_bandwidth=45e9, torus_dims=3, collective_step_latency_s=1e-6,
        max_chips=4096),
    # [book] v5e: 1.97e14 bf16, 3.94e14 int8, 16 GB at 8.1e11 B/s, ICI 4.5e10 one way, 2D 16x16.
    "tpu-v5e": Hardware(
        name="tpu-v5e", peak_flops_bf16=197e12, peak_flops_int8=394e12, hbm_bandwidth=8.1e11,
        hbm_bytes=16e9, ici_bandwidth=45e9, torus_dims=2, collective_step_latency_s=1e-6,
        max_chips=256),
    # [book] v5p: 4.59e14 bf16, 9.18e14 int8, 96 GB at 2.8e12 B/s, ICI 9e10 one way, 3D torus,
    # 8960-chip pod (16x20x28).
    "tpu-v5p": Hardware(
        name="tpu-v5p", peak_flops_bf16=459e12, peak_flops_int8=918e12, hbm_bandwidth=2.8e12,
        hbm_bytes=96e9, ici_bandwidth=90e9, torus_dims=3, collective_step_latency_s=1e-6,
        max_chips=8960),
    # [book] v6e (Trillium): 9.2e14 bf16, 1.84e15 int8, 32 GB at 1.6e12 B/s, ICI 9e10 one way,
    # 2D 16x16.
    "tpu-v6e": Hardware(
        name="tpu-v6e", peak_flops_bf16=920e12, peak_flops_int8=1840e12, hbm_bandwidth=1.6e12,
        hbm_bytes=32e9, ici_bandwidth=90e9, torus_dims=2, collective_step_latency_s=1e-6,
        max_chips=256),
    # [h100] SXM5, dense (no sparsity); one HGX board = 8 GPUs on NVSwitch.
    "h100": Hardware(
        name="h100", peak_flops_bf16=989e12, peak_flops_int8=1979e12, hbm_bandwidth=3.35e12,
        hbm_bytes=80e9, ici_bandwidth=450e9, torus_dims=0, collective_step_latency_s=2e-6,
        max_chips=8),
    # [h200] SXM.
    "h200": Hardware(
        name="h200", peak_flops_bf16=989e12, peak_flops_int8=1979e12, hbm_bandwidth=4.8e12,
        hbm_bytes=141e9, ici_bandwidth=450e9, torus_dims=0, collective_step_latency_s=2e-6,
        max_chips=8),
}

HARDWARE_NAMES = tuple(_PRESETS) + ("local",)


def get_hardware(name: str) -> Hardware:
  """Preset by name; ``"local"`` measures the current default JAX device (takes seconds)."""
  if name == "local":
    return measure_local()
  try:
    return _PRESETS[name]
  except KeyError:
    raise ValueError(
        f"unknown hardware {name!r}; known: {', '.join(HARDWARE_NAMES)}") from None


def _best_time(fn: Callable[..., object], args: tuple[object, ...], reps: int) -> float:
  """Best wall time of ``fn(*args)`` over ``reps`` runs, after one compile/warm-up run."""
  import jax  # lazy: see module docstring

  jax.block_until_ready(fn(*args))
  best = math.inf
  for _ in range(max(1, reps)):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def measure_matmul_peak(dtype: DTypeLike = "bfloat16", size: int = 4096, reps: int = 3) -> float:
  """FLOP/s of a jitted ``size x size @ size x size`` matmul on the default device.

  Accumulates in f32 for floating inputs and int32 for integer inputs
  (``preferred_element_type``), as real bf16 / int8 kernels do.
  """
  import jax
  import jax.numpy as jnp

  dt = jnp.dtype(dtype)
  acc = jnp.int32 if jnp.issubdtype(dt, jnp.integer) else jnp.float32
  a = jnp.ones((size, size), dt)
  b = jnp.ones((size, size), dt)
  matmul = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=acc))
  seconds = _best_time(matmul, (a, b), reps)
  return 2.0 * size**3 / seconds


def measure_read_bandwidth(nbytes: int = 512 * 2**20, reps: int = 3) -> float:
  """Streaming HBM (or DRAM) read bytes/s: a jitted f32 sum over an ``nbytes`` array."""
  import jax
  import jax.numpy as jnp

  n = max(1, nbytes // 4)
  x = jnp.ones((n,), jnp.float32)
  total = jax.jit(jnp.sum)
  seconds = _best_time(total, (x,), reps)
  del x
  return 4.0 * n / seconds


def _device_memory_bytes() -> float:
  import jax

  stats = jax.devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  if limit:
    return float(limit)
  return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))  # host RAM (CPU)


def measure_local(dtype: DTypeLike = "bfloat16", matmul_size: int | None = None,
                  read_bytes: int = 512 * 2**20) -> Hardware:
  """Measures the default JAX device and returns it as a ``Hardware`` named ``"local"``.

  ``dtype`` is the matmul dtype whose peak fills ``peak_flops_bf16`` (the cost model's compute
  peak); the int8 peak is measured too. No interconnect is measured: ``ici_bandwidth`` is set to
  half the measured read bandwidth (a same-host copy reads and writes) and the fabric is modelled
  as a switch over ``jax.device_count()`` devices.
  """
  import jax

  platform = jax.devices()[0].platform
  size = matmul_size or (2048 if platform == "cpu" else 8192)
  peak = measure_matmul_peak(dtype, size)
  peak_int8 = measure_matmul_peak("int8", size)
  read = measure_read_bandwidth(read_bytes)
  return Hardware(
      name="local", peak_flops_bf16=peak, peak_flops_int8=peak_int8, hbm_bandwidth=read,
      hbm_bytes=_device_memory_bytes(), ici_bandwidth=read / 2, torus_dims=0,
      collective_step_latency_s=5e-6, max_chips=jax.device_count())
