"""partitioning.calibration: identity changes nothing; a fit recovers known fractions from
synthetic measurements (made by a known calibration) and generalises to held-out workloads;
save / load round-trips; the planner and launch.lab.calibrate use it. Tolerances: the recovered
latencies within 1% of the synthetic ones (the fit is exact up to the optimiser's tolerance).
TPU v4: the fit on the paper's PaLM 540B runs only, validated on its PaLM 62B runs (held out)
against the issue's 25% criterion and layout agreement, asserting the measured outcome."""

from tests import paths
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from models.config import get_preset
from partitioning import calibration as cal
from partitioning import cost_model, planner
from launch.lab import published
from partitioning.hardware import get_hardware
from tests.cli_env import CLI_XLA_FLAGS

ROOT = str(paths.REPO)
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
    t = TRUE.apply(c, M.num_layers).latency_s
    rows.append({"phase": ph, "batch": b, "seq": ctx, "weights": w, "ffn": f, "attn": a,
                 "measured_s": t, "reps_s": [t, 1.01 * t], "same_as": ""})
    if (ph, b, ctx, w) not in [(x["phase"], x["batch"], x["seq"], x["weights"]) for x in cells]:
      cells.append({"phase": ph, "batch": b, "seq": ctx, "weights": w})
  (tmp_path / "sw").mkdir()
  (tmp_path / "sw" / "sweep.json").write_text(json.dumps(
      {"model": "palm-62b", "mesh": [2, 2, 4], "hardware_spec": hw, "rows": rows,
       "cells": cells}))
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  out = str(tmp_path / "cal")
  r = subprocess.run([sys.executable, "-m", "launch.lab.calibrate", "--sweep", str(tmp_path / "sw"),
                      "--out", out], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0, r.stderr
  rep = json.loads(r.stdout.strip().splitlines()[-1])
  assert rep["held_out_samples"] > 0
  assert rep["calibrated"]["held_out"]["median_abs_log"] < 0.01
  assert rep["uncalibrated"]["held_out"]["median_abs_log"] > 0.3
  # Judged against the calls' 1% spread: the fitted model orders every resolved pair right.
  noise = rep["calibrated"]["held_out_measured_noise"]
  assert noise["pairs_resolved"] > 0 and noise["pairs_agree"] == noise["pairs_resolved"]
  assert noise["pick_within_measured_noise"] == noise["cells"] > 0
  assert cal.load(os.path.join(out, "calibration.json")).hardware == "tpu-v4"
  assert json.load(open(os.path.join(out, "report.json")))["source"] == "sweep"
  r = subprocess.run([sys.executable, "-m", "launch.lab.calibrate", "--sweep", str(tmp_path / "sw"),
                      "--out", out + ".json"], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=120)
  assert r.returncode == 2 and "--out is a directory" in r.stderr
  r = subprocess.run([sys.executable, "-m", "launch.lab.calibrate", "--published", "tpu-v4"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  rep = json.loads(r.stdout.strip().splitlines()[-1])
  assert [h["run"] for h in rep["held_out"]] == [p.label for p in published.PALM_62B_TPU_V4]
  assert rep["held_out_summary"]["calibrated"]["paper_layout_within_25pct"] == 4
  assert rep["held_out_summary"]["uncalibrated"]["paper_layout_within_25pct"] == 1
  assert rep["held_out_summary"]["calibrated"]["layout_agrees"] == 4
  assert [v["variant"] for v in rep["overlap_sensitivity"]] == [
      f"overlap {o:g} (fixed)" for o in published.OVERLAPS] + ["overlap fitted"]
  assert [v["variant"] for v in rep["collective_sensitivity"] if v["selected"]] == [
      "ring volumes, W for all"]


# --- TPU v4: the paper's published configurations (launch.lab.published). -----------------


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
  the paper's tables"): times within 25% (met, calibrated; missed by 2x uncalibrated) and layout
  agreement, 4 of 4 exactly. On 16 chips ws_2d moves fewer activation bytes than ws_1d and
  splits the k / v projections ws_1d holds, reads and computes whole on every chip. On 8 chips
  (X = 2, YZ = 4) the two move exactly the same bytes once each collective is charged its ring
  share (g-1)/g (tests/partitioning/test_cost_model.py), so the k / v split alone puts the paper's ws_2d
  ahead, by under 1%: the model calls them near-equal, and the paper's choice is its pick."""
  rows = published.judge(published.fit_tpu_v4(), published.PALM_62B_TPU_V4)
  pre1, dec32, pre512, dec512 = rows
  for r in rows:
    assert 0.75 <= r["calibrated"]["ratio"] <= 1.25, r["run"]
    assert 0.75 <= r["calibrated"]["pick_ratio"] <= 1.25, r["run"]
    assert r["calibrated"]["layout_agrees"] and not r["calibrated"]["tie"], r["run"]
  assert sum(r["uncalibrated"]["ratio"] < 0.75 for r in rows) == 3  # the criterion can fail
  assert pre1["calibrated"]["pick"] == "ws_2d+heads"  # the paper's layouts exactly
  assert dec32["calibrated"]["pick"] == "ws_2d+batch_xyz"
  assert pre512["calibrated"]["pick"] == "wg_xyz+batch_xyz"
  assert dec512["calibrated"]["pick"] == "ws_2d+batch_xyz"
  assert dec512["calibrated"]["pick_mesh"] == [2, 2, 2]
  # The 8-chip margin: ws_1d's best program on the same 8 chips is within 1% of the pick.
  m, hw = get_preset("palm-62b"), get_hardware("tpu-v4")
  p = planner.plan(m, hw, 8, "decode", 512, 2048, "bf16", calibration=published.fit_tpu_v4())
  one_d = min(c.latency_s for c in p.candidates if c.layout == "ws_1d")
  assert 1.0 < one_d / p.best.latency_s < 1.01
  # Uncalibrated the layouts agree too, but three of the four times are off by 2x (above).
  assert all(r["uncalibrated"]["layout_agrees"] for r in rows)


def test_collective_sensitivity_selects_the_hardware_defaults():
  """How collectives are charged, chosen on the 540B fit set alone: each ring's exact (g-1)/g
  share or the paper's App. A.1 D/W, and every collective at the paper's W or a torus
  collective on its own axes' links only. With the paper's volumes, per-axis links mispick the
  paper's layout for 2 of the 5 fitted 540B runs; with ring volumes they pick all 5 but predict
  the left-out runs worse; of the admissible variants ring volumes at W have the lowest
  leave-one-out error (by a small margin over the paper's volumes), and they are the
  ``Hardware`` defaults. The held-out 62B layouts then agree 4 / 4 (3 / 4 with the paper's
  volumes; 1-2 with per-axis links)."""
  rows = {r["variant"]: r for r in published.collective_sensitivity()}
  assert [n for n, r in rows.items() if r["selected"]] == ["ring volumes, W for all"]
  defaults = get_hardware("tpu-v4")
  assert defaults.ring_volumes and not defaults.axis_links
  ring, paper = rows["ring volumes, W for all"], rows["paper volumes, W for all"]
  assert rows["paper volumes, axis links"]["fit_layout_agrees"] < 5
  for r in rows.values():
    if r["axis_links"]:
      assert r["leave_one_out_rms_log"] > 1.3 * ring["leave_one_out_rms_log"]
  assert ring["leave_one_out_rms_log"] < paper["leave_one_out_rms_log"]
  assert ring["fit_layout_agrees"] == paper["fit_layout_agrees"] == 5
  assert ring["held_out_layout_agrees"] == 4 and paper["held_out_layout_agrees"] == 3
  assert paper["eight_chip_pick"].startswith("ws_1d")
  for r in rows.values():  # every variant meets the 25% time criterion held out
    assert r["held_out_within_25pct"] == 4


def test_overlap_sensitivity_of_the_tpu_v4_validation():
  """Overlapping communication with compute (the paper's Looped CollectiveEinsum, Sec. 3.5) is
  rejected by the 540B fit set: fitted freely it goes to 0, and held at 1 each 540B run left
  out is predicted more than twice as badly (RMS log error) as with none. With ring volumes the
  held-out layouts agree 4 / 4 at every overlap, so this choice no longer decides them; with
  overlap the held-out times would miss 25% once (BUILD_NOTES)."""
  rows = {r["variant"]: r for r in published.overlap_sensitivity()}
  none, full, free = rows["overlap 0 (fixed)"], rows["overlap 1 (fixed)"], rows["overlap fitted"]
  assert free["overlap"] < 0.05
  assert full["leave_one_out_rms_log"] > 2 * none["leave_one_out_rms_log"]
  assert full["fit_rms_log"] > 1.5 * none["fit_rms_log"]
  for r in rows.values():  # the layouts agree at every overlap ...
    assert r["held_out_layout_agrees"] == 4 and r["eight_chip_pick"].startswith("ws_2d")
  # ... and the times only without it: with overlap the 16-chip prefill falls below 0.75.
  assert none["held_out_within_25pct"] == free["held_out_within_25pct"] == 4
  assert full["held_out_within_25pct"] == 3


def test_installed_calibrations_are_found_by_hardware(tmp_path, monkeypatch):
  """``launch.lab.calibrate --install`` saves where ``resolve("auto", hardware)`` looks, and
  ``launch.lab.plan`` then plans calibrated by default (``--calibration none``: uncalibrated); a
  calibration for other hardware is refused."""
  monkeypatch.setenv("PHASESERVE_CALIBRATION_DIR", str(tmp_path))
  assert cal.resolve("auto", "tpu-v4")[1] == cal.shipped_path("tpu-v4")  # nothing installed
  assert cal.resolve("none", "tpu-v4") == (None, "none")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CLI_XLA_FLAGS)
  r = subprocess.run([sys.executable, "-m", "launch.lab.calibrate", "--published", "tpu-v4",
                      "--install"], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0, r.stderr
  path = cal.default_path("tpu-v4")
  assert json.loads(r.stdout.strip().splitlines()[-1])["installed"] == path
  found, where = cal.resolve("auto", "tpu-v4")
  assert where == path and found == published.fit_tpu_v4()
  assert cal.resolve("auto", "h100") == (None, "none")
  with pytest.raises(ValueError, match="for tpu-v4, not h100"):
    cal.resolve(path, "h100")
  args = [sys.executable, "-m", "launch.lab.plan", "--model", "palm-62b", "--hardware", "tpu-v4",
          "--chips", "8", "--phase", "decode", "--batch", "512", "--context", "2048", "--json",
          "--collective_matmul", "off"]  # the plain layouts, as the paper ran them
  plans = {}
  for extra in ([], ["--calibration", "none"]):
    r = subprocess.run(args + extra, cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    plans[bool(extra)] = json.loads(r.stdout)
  assert plans[False]["calibration"] == path and plans[True]["calibration"] == "none"
  want = planner.plan(get_preset("palm-62b"), get_hardware("tpu-v4"), 8, "decode", 512, 2048,
                      calibration=found).best
  got = plans[False]["candidates"][0]
  assert got["latency_s"] == pytest.approx(want.latency_s)
  assert plans[True]["candidates"][0]["latency_s"] < 0.6 * got["latency_s"]


def test_the_shipped_tpu_v4_calibration_is_the_published_fit_and_the_default(tmp_path,
                                                                              monkeypatch):
  """The package ships ``partitioning/calibrations/tpu-v4.json``, the fit to the paper's 540B
  runs (regenerate: ``python -m launch.lab.calibrate --published tpu-v4 --out DIR``, copy its
  calibration.json): ``auto`` (every CLI's default) plans with it when nothing is installed,
  an installed one wins, ``none`` turns it off, and other hardware has none."""
  monkeypatch.setenv("PHASESERVE_CALIBRATION_DIR", str(tmp_path))
  shipped = cal.shipped_path("tpu-v4")
  assert cal.load(shipped) == published.fit_tpu_v4()
  assert cal.resolve("auto", "tpu-v4") == (published.fit_tpu_v4(), shipped)
  assert cal.resolve("none", "tpu-v4") == (None, "none")
  assert cal.resolve("auto", "h100") == (None, "none")
  mine = dataclasses.replace(published.fit_tpu_v4(), hbm_fraction=0.3, source="mine")
  cal.save(mine, cal.default_path("tpu-v4"))
  assert cal.resolve("auto", "tpu-v4") == (mine, cal.default_path("tpu-v4"))
  # The shipped calibration is what turns the planner from 2-2.5x optimistic to within 25% on
  # the held-out 62B runs (test_62b_held_out_validation); here, the default plan is calibrated.
  import pathlib
  pathlib.Path(cal.default_path("tpu-v4")).unlink()
  from partitioning.deployment import _choose
  _, why = _choose(get_preset("palm-62b"), None, "decode", (2, 2, 2), 512, 2048, False,
                   "tpu-v4")
  assert f"calibrated by {shipped}" in why


def test_the_540b_batch_512_prefill_pick_is_the_models_crossover():
  """The one layout the calibrated planner does not share with the paper (PaLM 540B prefill at
  batch 512: wg_xy+heads, the paper's wg_xyz+batch_xyz), explained by the cost terms on the
  paper's own 4x4x4 slice: the FLOPs are the same (within 1%), and gathering the weights over
  all 64 chips moves 1.5x the bytes of gathering them over xy and the activations over z. Under
  the model the paper's layout takes over at batch 1024 (tokens ~ the square of the gathered
  chips), one octave later than the paper's run; the calibrated times of the two differ by 10%
  (87.7 s for the paper's layout against its measured 85.2 s)."""
  m, hw = get_preset("palm-540b"), get_hardware("tpu-v4")
  mesh = (4, 4, 4)
  xy = cost_model.step_cost(m, hw, "wg_xy", "heads", mesh, "prefill", 512, 2048, "bf16")
  xyz = cost_model.step_cost(m, hw, "wg_xyz", "batch_xyz", mesh, "prefill", 512, 2048, "bf16")
  assert xyz.compute_s == pytest.approx(xy.compute_s, rel=0.01)
  assert xyz.comm_s > 1.5 * xy.comm_s
  fitted = published.fit_tpu_v4()
  pick = {b: planner.plan(m, hw, 64, "prefill", b, 2048, "bf16", meshes=[mesh],
                          calibration=fitted).best for b in (512, 1024)}
  assert (pick[512].layout, pick[512].attention) == ("wg_xy", "heads")
  assert (pick[1024].layout, pick[1024].attention) == ("wg_xyz", "batch_xyz")
  paper = fitted.apply(xyz, m.num_layers).latency_s
  assert paper == pytest.approx(85.2, rel=0.05) and paper / pick[512].latency_s < 1.12
