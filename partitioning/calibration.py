"""A calibration of the analytic cost model: achieved fractions of peak, fitted to measured runs.

  roofline = max(compute_s / flops_fraction, (weight_mem_s + kv_mem_s) / hbm_fraction)
  comm     = (comm_s - collective_floor_s) / link_fraction + collective_floor_s * hop_scale
  latency  = roofline + comm - overlap * min(roofline, comm) + num_layers * layer_overhead_s

Contract: ``Calibration(...).apply(cost, num_layers) -> StepCost`` (``IDENTITY`` changes
nothing); ``fit(samples, hardware, free=FREE, source=, fixed=)`` fits the ``free`` parameters by
least squares on log(calibrated / measured) within ``BOUNDS`` (``ValueError`` with fewer samples
than free parameters); ``errors`` gives calibrated / measured per ``Sample``; ``save`` / ``load``
are JSON. ``default_path(hardware)`` is where ``launch.lab.calibrate --install`` puts one;
``shipped_path(hardware)`` the one fitted by the project and shipped in the package
(``partitioning/calibrations/<hardware>.json``: TPU v4 from the paper's published runs);
``resolve(spec, hardware)`` turns ``--calibration`` into ``(calibration or None, where)``:
``auto`` (every CLI's default) the installed one, else the shipped one, else none; ``none``; a
path. A calibration for other hardware is refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Mapping, Sequence

import numpy as np

from partitioning.cost_model import StepCost

PARAMS = ("flops_fraction", "hbm_fraction", "link_fraction", "hop_scale", "layer_overhead_s",
          "overlap")
FREE = PARAMS[:5]
# (low, high) of each parameter in the fit.
BOUNDS = {"flops_fraction": (0.01, 1.0), "hbm_fraction": (0.01, 1.0),
          "link_fraction": (0.01, 1.0), "hop_scale": (0.0, 1000.0),
          "layer_overhead_s": (0.0, 0.05), "overlap": (0.0, 1.0)}


@dataclasses.dataclass(frozen=True)
class Calibration:
  hardware: str = ""  # the hardware preset it was fitted for
  flops_fraction: float = 1.0  # achieved / peak matmul FLOP/s
  hbm_fraction: float = 1.0  # achieved / peak HBM bandwidth
  link_fraction: float = 1.0  # achieved / peak collective bandwidth
  hop_scale: float = 1.0  # per-collective hop latency / the preset's
  layer_overhead_s: float = 0.0  # fixed seconds per layer and step (norms, kernels, launches)
  overlap: float = 0.0  # fraction of the communication hidden behind compute / HBM traffic
  source: str = ""  # what it was fitted on

  def apply(self, c: StepCost, num_layers: int) -> StepCost:
    compute = c.compute_s / self.flops_fraction
    mem = (c.weight_mem_s + c.kv_mem_s) / self.hbm_fraction
    roofline = max(compute, mem)
    comm = (max(0.0, c.comm_s - c.collective_floor_s) / self.link_fraction
            + c.collective_floor_s * self.hop_scale)
    latency = (roofline + comm - self.overlap * min(roofline, comm)
               + num_layers * self.layer_overhead_s)
    return dataclasses.replace(
        c, latency_s=latency, mfu=c.mfu * c.latency_s / latency,
        cost_chip_s_per_token=latency * c.n_chips / c.tokens)


IDENTITY = Calibration()


@dataclasses.dataclass(frozen=True)
class Sample:
  cost: StepCost  # uncalibrated
  num_layers: int
  measured_s: float
  label: str = ""


def _with(values: Sequence[float], free: Sequence[str], hardware: str, source: str,
          fixed: Mapping[str, float]) -> Calibration:
  return Calibration(hardware=hardware, source=source, **fixed, **dict(zip(free, values)))


def fit(samples: Sequence[Sample], hardware: str, free: Sequence[str] = FREE,
        source: str = "", fixed: Mapping[str, float] | None = None) -> Calibration:
  from scipy.optimize import least_squares
  free = tuple(free)
  fixed = dict(fixed or {})
  unknown = (set(free) | set(fixed)) - set(PARAMS)
  if unknown or set(free) & set(fixed):
    raise ValueError(f"unknown or both free and fixed parameters: "
                     f"{sorted(unknown or set(free) & set(fixed))}")
  if len(samples) < len(free):
    raise ValueError(f"{len(samples)} samples cannot fit {len(free)} parameters")
  lo = np.asarray([BOUNDS[p][0] for p in free])
  hi = np.asarray([BOUNDS[p][1] for p in free])
  x0 = np.asarray([min(max(getattr(IDENTITY, p), BOUNDS[p][0]), BOUNDS[p][1]) for p in free])
  x0 = np.where(x0 >= hi, lo + 0.5 * (hi - lo), x0)  # start inside the box

  def residuals(x):
    cal = _with(x, free, hardware, source, fixed)
    return [math.log(cal.apply(s.cost, s.num_layers).latency_s / s.measured_s)
            for s in samples]

  best = None
  for start in (x0, lo + 0.1 * (hi - lo), lo + 0.5 * (hi - lo)):  # a few starts: max() kinks
    r = least_squares(residuals, np.clip(start, lo, hi), bounds=(lo, hi), x_scale="jac")
    if best is None or r.cost < best.cost:
      best = r
  assert best is not None  # at least one start ran
  return _with(best.x.tolist(), free, hardware, source, fixed)


def errors(cal: Calibration, samples: Sequence[Sample]) -> list[float]:
  return [cal.apply(s.cost, s.num_layers).latency_s / s.measured_s for s in samples]


def save(cal: Calibration, path: str) -> None:
  with open(path, "w") as f:
    json.dump(dataclasses.asdict(cal), f, indent=1)


def load(path: str) -> Calibration:
  """The calibration saved at ``path``; ``ValueError`` for a file that is not one."""
  with open(path) as f:
    try:
      d = json.load(f)
    except ValueError as e:
      raise ValueError(f"{path}: not JSON ({e})") from None
  if not isinstance(d, dict):
    raise ValueError(f"{path}: not a calibration (a JSON object of its fields)")
  unknown = set(d) - {f.name for f in dataclasses.fields(Calibration)}
  if unknown:
    raise ValueError(f"{path}: unknown calibration fields {sorted(unknown)}")
  return Calibration(**d)


def default_path(hardware: str) -> str:
  """Where the installed calibration of ``hardware`` lives (see the module docstring)."""
  from models.cpu import env
  return os.path.join(env.calibration_dir(), f"{hardware}.json")


def shipped_path(hardware: str) -> str:
  """The calibration of ``hardware`` shipped with the package (it may not exist)."""
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibrations",
                      f"{hardware}.json")


def resolve(spec: str | None, hardware: str) -> tuple[Calibration | None, str]:
  """A ``--calibration`` flag's value for ``hardware``: ``(calibration, where it came from)``,
  ``(None, "none")`` when there is none; raises ``ValueError`` for one fitted for other
  hardware (``OSError`` for a named file that cannot be read)."""
  if not spec or spec == "none":
    return None, "none"
  path = spec
  if spec == "auto":
    found = [p for p in (default_path(hardware), shipped_path(hardware)) if os.path.exists(p)]
    if not found:
      return None, "none"
    path = found[0]
  cal = load(path)
  if cal.hardware and cal.hardware != hardware:
    raise ValueError(f"{path}: a calibration for {cal.hardware}, not {hardware}")
  return cal, path


__all__ = ["Calibration", "IDENTITY", "Sample", "fit", "errors", "save", "load", "PARAMS",
           "BOUNDS", "default_path", "shipped_path", "resolve"]
