"""partitioning.deployment: the planner's layouts are chosen, and costed, on the meshes that run them."""

from __future__ import annotations

import jax

from models.config import get_preset
from partitioning import cost_model
from partitioning.hardware import get_hardware
from partitioning.mesh import mesh_shape
from partitioning.planner import plan
from partitioning.deployment import Deployment, make_steps


CFG = get_preset("small")


def _interleaved(prefill_layout: str, devices: int):
  """(steps, the decode step) of an interleaved deployment of ``small`` on H100 presets."""
  steps = make_steps(CFG, Deployment("interleaved", prefill_layout=prefill_layout,
                                     hardware="h100"),
                     max_slots=64, max_chunk=256, max_context=2048, quantized=False,
                     devices=jax.devices()[:devices])
  return steps, steps.decode.step if steps.decode else steps.step


def test_interleaved_choice_is_valid_and_costed_on_the_live_mesh():
  # 6 devices: make_mesh builds (1, 2, 3); the planner's unrestricted decode pick, ws_1d+batch_z
  # on (1, 3, 2), would need batch 64 split over z = 3 there.
  steps, dec = _interleaved("ws_1d:heads", 6)
  mesh = mesh_shape(dec.mesh)
  assert cost_model.check_layout(dec.ffn.name, dec.attn.name, mesh, 64) is None
  # One mesh, one resident params copy: decode is chosen among the layouts storing the weights
  # as prefill's ws_1d does (only ws_1d), so the pair that runs is the one the planner costed.
  want = plan(CFG, get_hardware("h100"), 6, "decode", 64, 2048, meshes=[mesh],
              layouts=["ws_1d"]).best
  assert (dec.ffn.name, dec.attn.name) == (want.layout, want.attention)
  assert f"{want.latency_s * 1e3:.3f} ms" in steps.description["decode_choice"]


def test_interleaved_decode_is_chosen_in_the_prefill_layouts_family():
  """Prefill given as ws_2d (weights E_x F_yz): decode is planned among ws_2d and the
  weight-gathered layouts, which store the weights the same way, so no layout is swapped for
  another after planning and one params copy serves both phases."""
  steps, dec = _interleaved("ws_2d:heads", 8)
  assert dec.ffn.name in ("ws_2d", "wg_x", "wg_xy", "wg_xyz")
  assert steps.description["param_copies"] == 1
  assert not any("kept in the prefill layout's family" in n for n in steps.description["notes"])
  want = plan(CFG, get_hardware("h100"), 8, "decode", 64, 2048, meshes=[mesh_shape(dec.mesh)],
              layouts=["ws_2d", "wg_x", "wg_xy", "wg_xyz"]).best
  assert (dec.ffn.name, dec.attn.name) == (want.layout, want.attention)


def test_the_layout_choice_uses_an_installed_calibration(tmp_path, monkeypatch):
  """``calibration="auto"`` (the default) plans with the calibration installed for the hardware
  when there is one, and says so; ``"none"`` and an empty store plan uncalibrated."""
  from partitioning import calibration
  monkeypatch.setenv("PHASESERVE_CALIBRATION_DIR", str(tmp_path))
  slow = calibration.Calibration(hardware="h100", hbm_fraction=0.1, link_fraction=0.05,
                                 layer_overhead_s=1e-3)

  def decode_choice(cal: str) -> str:
    return make_steps(CFG, Deployment("interleaved", prefill_layout="ws_2d:heads",
                                      hardware="h100", calibration=cal),
                      max_slots=64, max_chunk=256, max_context=2048, quantized=False,
                      devices=jax.devices()[:8]).description["decode_choice"]

  plain = decode_choice("auto")  # nothing installed yet
  assert "calibrated" not in plain
  calibration.save(slow, calibration.default_path("h100"))
  auto = decode_choice("auto")
  assert f"calibrated by {calibration.default_path('h100')}" in auto
  # The calibrated prediction is the one reported (1 ms per layer alone is 4 ms on `small`).
  assert float(auto.split("predicted ")[1].split(" ms")[0]) > 4.0
  assert decode_choice("none") == plain
