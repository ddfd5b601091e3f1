"""The cluster comparison of ``launch.lab.simulate``: interleaved vs disaggregated at equal chips.

Contract: ``compare(GridSpec, progress=None) -> Comparison``. For each hardware x weights dtype
x cluster size (chips), the cluster is ``instances = chips // instance chips`` model instances
(``deploy.Planner``), simulated as ``instances // cell`` identical cells of
``cell = min(instances, cell_instances)`` instances each, the load split evenly over the cells
(so a cell's result is reused by every cluster size with that cell; pooling gains beyond a cell
are not counted, and cluster sizes that are not a multiple of the cell drop the remainder,
reported as ``idle_chips``). Per cell: the interleaved capacity, and the disaggregated capacity
of every split in ``capacity.default_splits`` (or ``splits``, fractions of the cell), the best
one reported. Capacity (requests/s at the SLO's p99 TTFT and TPOT) scales by the cell count;
cost per million tokens = chips x ``chip_hour_usd[hardware]`` / tokens per hour at capacity
(output tokens, and prompt + output tokens; the mean lengths of the capacity run's requests).

A run at rate r simulates ``max(min_requests, r * duration_s)`` requests, so a run covers at
least ``duration_s`` of arrivals (a short run hides a slow overload: the queue it builds is not
long enough to show at p99); with a ``trace``, its rows, arrival times rescaled to rate r.

``CHIP_HOUR_USD``: list prices, on-demand, rounded (assumptions, not quotes): TPU v5e $1.20 and
v5p $4.20 per chip-hour, v4 $3.22, v6e $2.70 (Google Cloud us-central1 list prices); H100 SXM
$3.00 and H200 $3.80 per GPU-hour (a typical neocloud price; hyperscaler on-demand is 2-4x).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from launch.lab.loadgen_lib.slo import Slo
from launch.lab.loadgen_lib.workload import TraceRow
from launch.lab.simulator import capacity, workload
from launch.lab.simulator.deploy import ClusterSpec, Planner
from models.config import ModelConfig
from partitioning.calibration import Calibration
from partitioning.cost_model import WeightsDtype
from partitioning.hardware import Hardware

CHIP_HOUR_USD = {"tpu-v4": 3.22, "tpu-v5e": 1.20, "tpu-v5p": 4.20, "tpu-v6e": 2.70,
                 "h100": 3.00, "h200": 3.80}


@dataclasses.dataclass(frozen=True)
class GridSpec:
  model: ModelConfig
  hardware: tuple[Hardware, ...]
  chips: tuple[int, ...]
  weights: tuple[WeightsDtype, ...]
  mix: tuple[tuple[str, float], ...]
  slo: Slo
  duration_s: float = 30.0
  min_requests: int = 400
  cell_instances: int = 8
  splits: tuple[float, ...] = ()  # prefill fractions of a cell; () = capacity.default_splits
  seed: int = 0
  length_scale: float = 1.0
  prefix_hit_rate: float = 0.0
  calibrations: tuple[Calibration, ...] = ()  # applied to the hardware they name
  link_bytes_per_s_per_chip: float = 50e9
  early_reject: bool = False
  chip_hour_usd: tuple[tuple[str, float], ...] = ()  # overrides of CHIP_HOUR_USD
  trace: tuple[TraceRow, ...] = ()  # replaces the profiles: its rows, rescaled to each rate


@dataclasses.dataclass(frozen=True)
class Comparison:
  rows: tuple[dict, ...]  # one per hardware x weights x chips x mode
  splits: tuple[dict, ...]  # one per hardware x weights x cell x split
  runs: tuple[dict, ...]  # every simulated rate
  deployments: tuple[dict, ...]  # the planner's instances and layouts


def requests_at(grid: GridSpec) -> Callable[[float], tuple]:
  def make(rate: float):
    if grid.trace:
      return workload.from_trace(grid.trace, rate, grid.prefix_hit_rate)
    n = max(grid.min_requests, math.ceil(rate * grid.duration_s))
    return workload.from_profiles(grid.mix, rate, n, grid.seed, grid.length_scale,
                                  prefix_hit_rate=grid.prefix_hit_rate)
  return make


def _calibration(grid: GridSpec, hw: Hardware) -> Calibration | None:
  return next((c for c in grid.calibrations if c.hardware == hw.name), None)


def _splits(grid: GridSpec, cell: int) -> tuple[int, ...]:
  if not grid.splits:
    return capacity.default_splits(cell)
  return tuple(sorted({min(cell - 1, max(1, round(f * cell))) for f in grid.splits}))


def compare(grid: GridSpec, progress: Callable[[], None] | None = None) -> Comparison:
  prices = {**CHIP_HOUR_USD, **dict(grid.chip_hour_usd)}
  make = requests_at(grid)
  rows, split_rows, runs, deployments = [], [], [], []
  for hw in grid.hardware:
    for weights in grid.weights:
      cells: dict[int, dict] = {}
      for chips in grid.chips:
        try:
          planner = Planner(ClusterSpec(grid.model, hw, chips, weights,
                                        calibration=_calibration(grid, hw),
                                        link_bytes_per_s_per_chip=grid.link_bytes_per_s_per_chip,
                                        early_reject=grid.early_reject))
        except ValueError as e:
          rows.append({"hardware": hw.name, "weights": weights, "chips": chips,
                       "mode": "none", "note": str(e)})
          continue
        cell = min(planner.instances, grid.cell_instances)
        if cell not in cells:
          cells[cell] = _simulate_cell(grid, planner, cell, make, runs, split_rows)
          deployments.append({**planner.describe(), "cell_instances": cell})
        n_cells = planner.instances // cell
        idle = chips - n_cells * cell * planner.chips_per_instance
        for mode, res in cells[cell].items():
          rate = res["rate"] * n_cells if res["rate"] else None
          # Tokens per request of the run at capacity (its requests; a longer run has more).
          mean_prompt, mean_output = workload.mean_tokens(make(res["rate"] or 1.0))
          rows.append({
              "hardware": hw.name, "weights": weights, "chips": chips,
              "chips_per_instance": planner.chips_per_instance, "instances": planner.instances,
              "cell_instances": cell, "cells": n_cells, "idle_chips": idle, "mode": mode,
              "split": res.get("split", ""), "capacity_rps": rate,
              "output_tokens_per_s": rate * mean_output if rate else None,
              "usd_per_m_output": capacity.cost_per_million(rate, mean_output, chips,
                                                            prices[hw.name]),
              "usd_per_m_tokens": capacity.cost_per_million(rate, mean_prompt + mean_output,
                                                            chips, prices[hw.name]),
              "utilisation": res.get("utilisation"),
              "note": "" if rate else "no rate tried met the SLO"})
        if progress is not None:
          progress()
  return Comparison(tuple(rows), tuple(split_rows), tuple(runs), tuple(deployments))


def _simulate_cell(grid: GridSpec, planner: Planner, cell: int, make, runs: list,
                   split_rows: list) -> dict[str, dict]:
  """Interleaved and best-split disaggregated capacity of one ``cell``-instance cell."""
  hw, w = planner.spec.hw.name, planner.spec.weights
  cell_planner = Planner(dataclasses.replace(planner.spec,
                                             chips=cell * planner.chips_per_instance))

  def record(mode: str, split: str, cap: dict) -> None:
    for rate, s in cap["rows"].items():
      runs.append({"hardware": hw, "weights": w, "cell_instances": cell, "mode": mode,
                   "split": split, "rate_per_s": rate, **_flat(s)})

  inter = capacity.find_capacity(make, cell_planner.interleaved(), grid.slo)
  record("interleaved", "", inter)
  best_rate = inter["best_rate_per_s"]
  out = {"interleaved": {"rate": best_rate,
                         "utilisation": _util(inter["rows"].get(best_rate))}}
  best: dict | None = None
  for p in _splits(grid, cell):
    cap = capacity.find_capacity(make, cell_planner.disaggregated(p, cell - p), grid.slo)
    split = f"{p}:{cell - p}"
    record("disaggregated", split, cap)
    r = cap["best_rate_per_s"]
    split_rows.append({"hardware": hw, "weights": w, "cell_instances": cell, "prefill": p,
                       "decode": cell - p, "capacity_rps": r,
                       "utilisation": _util(cap["rows"].get(r))})
    if r and (best is None or r > best["rate"]):
      best = {"rate": r, "split": split, "utilisation": _util(cap["rows"].get(r))}
  if best is not None or cell >= 2:
    out["disaggregated"] = best or {"rate": None, "split": ""}
  return out


def _util(summary: dict | None) -> str:
  if not summary:
    return ""
  return " ".join(f"{k} {v:.2f}" for k, v in sorted(summary["utilisation"].items()))


def _flat(s: dict) -> dict:
  out = {}
  for k, v in s.items():
    if isinstance(v, dict):
      for q, x in v.items():
        out[f"{k}_{q}"] = x
    else:
      out[k] = v
  return out


def best_by_mode(rows: Sequence[dict]) -> dict[tuple[str, str, int], dict[str, float | None]]:
  """(hardware, weights, chips) -> {mode: capacity_rps}."""
  out: dict[tuple[str, str, int], dict[str, float | None]] = {}
  for r in rows:
    if r["mode"] != "none":
      out.setdefault((r["hardware"], r["weights"], r["chips"]), {})[r["mode"]] = r[
          "capacity_rps"]
  return out
