"""partitioning.calibration: identity changes nothing; a fit recovers known fractions from
synthetic measurements (made by a known calibration) and generalises to held-out workloads;
save / load round-trips; the planner and launch.calibrate use it. Tolerances: the recovered
latencies within 1% of the synthetic ones (the fit is exact up to the optimiser's tolerance).
TPU v4: the fit on the paper's PaLM 540B runs only, validated on its PaLM 62B runs (held out)
against the issue's 25% criterion and layout agreement, asserting the measured outcome."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from models.config import get_preset
from partitioning import calibration as cal
from partitioning import cost_model, planner, published
from partitioning.hardware import get_hardware

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HW = get_hardware("tpu-v4")
M = get_preset("palm-62b")
TRUE = cal.Calibration("tpu-v4", flops_fraction=0.6, hbm_fraction=0.4, link_fraction=0.5,
                       hop_scale=3.0, layer_overhead_s=2e-5)


def _samples(workloads):
  out = []
  for layout, attn, mesh, phase, batch, ctx, w in workloads:
    c = cost_model.step_cost(M, HW, layout, attn, mesh, phase, batch, ctx, w)
    out.append(cal.Sample(c, M.num_layers, TRUE.apply(c, M.num_layers).latency_s))
  return out


WORK = [(f, a, mesh, ph, b, 2048, w)
        for f, a, mesh in (("ws_2d", "batch_yz", (2, 2, 4)), ("ws_1d", "heads", (2, 2, 4)),
                           ("wg_xyz", "batch_xyz", (2, 2, 4)), ("ws_2d", "heads", (2, 2, 2)))
        for ph, b in (("decode", 1), ("decode", 64), ("prefill", 1), ("prefill", 32))
        for w in ("bf16", "int8") if cost_model.check_layout(f, a, mesh, b) is None]


def test_identity_changes_nothing():
  c = cost_model.step_cost(M, HW, "ws_2d", "batch_yz", (2, 2, 4), "decode", 64, 2048, "int8")
  assert cal.IDENTITY.apply(c, M.num_layers) == c


def test_fit_recovers_a_known_calibration_and_generalises():
  train, test = WORK[::2], WORK[1::2]
  fitted = cal.fit(_samples(train), "tpu-v4")
  for r in cal.errors(fitted, _samples(test)):  # workloads the fit never saw
    assert r == pytest.approx(1.0, rel=0.01)
  assert fitted.flops_fraction == pytest.approx(0.6, rel=0.05)
  assert fitted.hbm_fraction == pytest.approx(0.4, rel=0.05)
  # Uncalibrated, the same workloads are off by far more than 1%: the check can fail.
  assert max(abs(r - 1) for r in cal.errors(cal.IDENTITY, _samples(test))) > 0.3


def test_overlap_hides_communication_behind_the_roofline():
  c = cost_model.step_cost(M, HW, "ws_1d", "batch_xyz", (2, 2, 2), "decode", 512, 2048, "bf16")
  roof, comm = max(c.compute_s, c.weight_mem_s + c.kv_mem_s), c.comm_s
  assert comm > 0.1 * roof  # both terms matter in this step
  none, half, full = (cal.Calibration(overlap=o).apply(c, M.num_layers).latency_s
                      for o in (0.0, 0.5, 1.0))
  assert none == pytest.approx(c.latency_s, rel=1e-12)  # overlap 0 is the uncalibrated sum
  assert full == pytest.approx(max(roof, comm), rel=1e-12)
  assert half == pytest.approx(roof + comm - 0.5 * min(roof, comm), rel=1e-12)


def test_fit_recovers_a_known_overlap():
  true = dataclasses.replace(TRUE, overlap=0.7)
  train = [cal.Sample(s.cost, s.num_layers, true.apply(s.cost, s.num_layers).latency_s)
           for s in _samples(WORK)]
  fitted = cal.fit(train, "tpu-v4", free=("flops_fraction", "hbm_fraction", "link_fraction",
                                          "overlap"),
                   fixed={"hop_scale": 3.0, "layer_overhead_s": 2e-5})
  assert fitted.overlap == pytest.approx(0.7, abs=0.02)
  for r in cal.errors(fitted, train):
    assert r == pytest.approx(1.0, rel=0.01)
  # Fitted without it, the same data are matched worse: the parameter is identifiable.
  without = cal.fit(train, "tpu-v4", free=("flops_fraction", "hbm_fraction", "link_fraction"),
                    fixed={"hop_scale": 3.0, "layer_overhead_s": 2e-5})
  assert max(abs(r - 1) for r in cal.errors(without, train)) > 0.03
  with pytest.raises(ValueError, match="both free and fixed"):
    cal.fit(train, "tpu-v4", free=("overlap",), fixed={"overlap": 0.5})
  with pytest.raises(ValueError, match="unknown"):
    cal.fit(train, "tpu-v4", free=("flops_fraction",), fixed={"typo": 1.0})


def test_too_few_samples_and_save_load(tmp_path):
  with pytest.raises(ValueError, match="cannot fit"):
    cal.fit(_samples(WORK[:2]), "tpu-v4")
  path = str(tmp_path / "c.json")
  cal.save(TRUE, path)
  assert cal.load(path) == TRUE
  (tmp_path / "bad.json").write_text(json.dumps({"flops_fraction": 1, "typo": 2}))
  with pytest.raises(ValueError, match="unknown calibration fields"):
    cal.load(str(tmp_path / "bad.json"))


def test_the_planner_uses_a_calibration():
  raw = planner.plan(M, HW, 16, "decode", 64, 2048, "int8").best
  calibrated = planner.plan(M, HW, 16, "decode", 64, 2048, "int8", calibration=TRUE).best
  assert calibrated.latency_s > 1.5 * raw.latency_s
  assert calibrated.mfu < raw.mfu


def test_calibrate_cli_on_a_sweep_and_on_the_published_runs(tmp_path):
  hw = dataclasses.asdict(HW)
  rows, cells = [], []
  for f, a, mesh, ph, b, ctx, w in WORK:
    if mesh != (2, 2, 4):
      continue
    c = cost_model.step_cost(M, HW, f, a, mesh, ph, b, ctx, w)
    rows.append({"phase": ph, "batch": b, "seq": ctx, "weights": w, "ffn": f, "attn": a,
                 "measured_s": TRUE.apply(c, M.num_layers).latency_s, "same_as": ""})
    if (ph, b, ctx, w) not in [(x["phase"], x["batch"], x["seq"], x["weights"]) for x in cells]:
      cells.append({"phase": ph, "batch": b, "seq": ctx, "weights": w})
  (tmp_path / "sw").mkdir()
  (tmp_path / "sw" / "sweep.json").write_text(json.dumps(
      {"model": "palm-62b", "mesh": [2, 2, 4], "hardware_spec": hw, "rows": rows,
       "cells": cells}))
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  out = str(tmp_path / "cal.json")
  r = subprocess.run([sys.executable, "-m", "launch.calibrate", "--sweep", str(tmp_path / "sw"),
                      "--out", out], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0, r.stderr
  rep = json.loads(r.stdout.strip().splitlines()[-1])
  assert rep["held_out_samples"] > 0
  assert rep["calibrated"]["held_out"]["median_abs_log"] < 0.01
  assert rep["uncalibrated"]["held_out"]["median_abs_log"] > 0.3
  assert cal.load(out).hardware == "tpu-v4"
  r = subprocess.run([sys.executable, "-m", "launch.calibrate", "--published", "tpu-v4"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  rep = json.loads(r.stdout.strip().splitlines()[-1])
  assert [h["run"] for h in rep["held_out"]] == [p.label for p in published.PALM_62B_TPU_V4]
  assert rep["held_out_summary"]["calibrated"]["paper_layout_within_25pct"] == 4
  assert rep["held_out_summary"]["uncalibrated"]["paper_layout_within_25pct"] == 1
  assert rep["held_out_summary"]["calibrated"]["layout_agrees"] == 3
  assert [v["variant"] for v in rep["overlap_sensitivity"]] == [
      f"overlap {o:g} (fixed)" for o in published.OVERLAPS] + ["overlap fitted"]


# --- TPU v4: the paper's published configurations (partitioning.published). -----------------


def test_published_mfu_and_latency_agree():
  # Each transcribed row states both an MFU and a latency; under this project's FLOP count
  # they must agree (a transcription error in either shows). The 540B model runs with 48
  # heads here (the paper padded to 64 and counts MFU on the unpadded model).
  hw = get_hardware("tpu-v4")
  rows = [p for p in published.PALM_540B_TPU_V4 + published.PALM_62B_TPU_V4 if p.mfu]
  assert len(rows) == 8
  for p, s in zip(rows, published.samples(rows)):
    implied = s.cost.flops / (p.measured_s * p.chips * hw.peak_flops_bf16)
    assert implied == pytest.approx(p.mfu, rel=0.06), p.label


def test_tpu_v4_fit_uses_only_the_540b_runs():
  fitted = published.fit_tpu_v4()
  assert {p.model for p in published.PALM_540B_TPU_V4} == {"palm-540b"}
  assert {p.model for p in published.PALM_62B_TPU_V4} == {"palm-62b"}
  # The same fit from the 540B samples alone: nothing of the 62B rows enters it.
  again = cal.fit(published.samples(published.PALM_540B_TPU_V4), "tpu-v4",
                  free=published.TPU_V4_FREE, source=fitted.source)
  assert again == fitted
  assert fitted.hop_scale == 1.0 and fitted.layer_overhead_s == 0.0  # not fitted
  for r in cal.errors(fitted, published.samples(published.PALM_540B_TPU_V4)):
    assert 0.85 < r < 1.15  # three parameters, five runs: a fit, not an interpolation


def test_62b_held_out_validation():
  """The issue's criteria on the held-out PaLM 62B runs (BUILD_NOTES "TPU v4 calibration from
  the paper's tables"): times within 25% (met, calibrated; missed by 2x uncalibrated), layout
  agreement (3 of 4 exactly: on 16 chips ws_1d and ws_2d move the same activations, and what
  separates them is the k / v projections ws_1d holds, reads and computes whole on every chip:
  decode, bound by weight reads, and prefill, bound by compute, both pick the paper's ws_2d; on
  8 chips it picks ws_1d, predicting the paper's ws_2d 14% slower: the documented miss)."""
  rows = published.judge(published.fit_tpu_v4(), published.PALM_62B_TPU_V4)
  pre1, dec32, pre512, dec512 = rows
  for r in rows:
    assert 0.75 <= r["calibrated"]["ratio"] <= 1.25, r["run"]
    assert 0.75 <= r["calibrated"]["pick_ratio"] <= 1.25, r["run"]
  assert sum(r["uncalibrated"]["ratio"] < 0.75 for r in rows) == 3  # the criterion can fail
  # 16 chips: X=2, YZ=8 makes E/X + F/YZ = E, ws_1d's volume; the k / v terms decide.
  assert pre1["calibrated"]["pick"] == "ws_2d+heads"  # the paper's layout exactly
  assert dec32["calibrated"]["pick"] == "ws_2d+batch_xyz"
  for r in (pre1, dec32):
    assert not r["calibrated"]["tie"] and r["calibrated"]["layout_agrees"]
  assert pre512["calibrated"]["pick"] == "wg_xyz+batch_xyz"  # the paper's layout exactly
  assert not pre512["calibrated"]["tie"]
  assert dec512["calibrated"]["pick"].startswith("ws_1d")
  assert not dec512["calibrated"]["layout_agrees"]
  assert 1.10 < dec512["calibrated"]["paper_layout_vs_pick"] < 1.20  # 1.14
  assert dec512["calibrated"]["ratio"] == pytest.approx(1.0, abs=0.05)


def test_overlap_sensitivity_of_the_tpu_v4_validation():
  """The one communication / compute overlap that reproduces the paper's 8-chip ws_2d choice
  (full overlap: 1D's smaller collectives are then hidden, and 2D's k / v split decides) is the
  one the 540B fit set rejects: fitted freely the overlap goes to 0, and held at 1 each 540B run
  left out is predicted more than twice as badly (RMS log error) as with no overlap. So the used
  calibration keeps overlap 0 and the 8-chip miss stays (BUILD_NOTES)."""
  rows = {r["variant"]: r for r in published.overlap_sensitivity()}
  none, full, free = rows["overlap 0 (fixed)"], rows["overlap 1 (fixed)"], rows["overlap fitted"]
  assert free["overlap"] < 0.05
  assert none["eight_chip_pick"].startswith("ws_1d") and none["held_out_layout_agrees"] == 3
  assert full["eight_chip_pick"].startswith("ws_2d") and full["held_out_layout_agrees"] == 4
  assert full["leave_one_out_rms_log"] > 2 * none["leave_one_out_rms_log"]
  assert full["fit_rms_log"] > 1.5 * none["fit_rms_log"]
  for r in rows.values():  # every variant still meets the 25% time criterion held out
    assert r["held_out_within_25pct"] == 4
