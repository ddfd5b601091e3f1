"""partitioning.collective_matmul: the paper's looped collective einsum (Sec. 3.5) in the
weight-stationary FFN layouts, on 8 fake CPU devices (sequential and parallel blocks).

``--collective_matmul`` loops ws_1d's and ws_2d's activation all-gather into the FFN's first
einsums (gate, up) and its reduce-scatter into the last (down): n partial einsums with n - 1
``ppermute`` steps. Checked: equal to the unsharded reference (and so to the plain layout, which
test_paged_layouts checks against the same reference) within the same tolerance
(``max |got - ref| <= 1e-5 * max(1, max |ref|)``), for ws_1d and ws_2d x f32 and int8 weights x
prefill (two ragged chunks) and decode, in one program (int8 in ws_1d in `make test-slow`); the
compiled step really permutes (collective-permute in its HLO) and the plain one does not; layouts
it does not apply to say so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from partitioning import paged_step as PS
from partitioning.layouts import make_plan
from tests.partitioning.test_paged_layouts import (B, CFG, M, NP, S, Z, _case, _check, _run, _table,
                                                  mesh8)  # noqa: F401  (the fixture)

# int8 weights in ws_1d run in `make test-slow` (12 s of the suite); int8 in ws_2d stays.
CASES = [pytest.param(ffn, q, id=f"{'int8' if q else 'f32'}-{ffn}",
                      marks=[pytest.mark.slow] if q and ffn == "ws_1d" else [])
         for q in (False, True) for ffn in ("ws_1d", "ws_2d")]


@pytest.mark.parametrize("ffn,quantized", CASES)
def test_looped_ffn_equals_the_reference(mesh8, ffn, quantized):
  params, x, ref = _case(quantized)
  step = PS.PagedShardedStep.make(CFG, mesh8, ffn, "batch_xyz", collective_matmul=True)
  assert step.plan(B).looped
  kv = step.init_kv(B, NP, Z, M, jnp.float32).replace(page_table=jnp.asarray(_table()))
  got = _run(step, step, step.place_params(params), kv, x)
  _check(got, ref, f"{ffn} looped")


def test_the_looped_step_permutes_and_the_plain_one_does_not(mesh8):
  params, x, _ = _case(False)

  def hlo(step) -> str:
    kv = step.init_kv(B, NP, Z, M, jnp.float32)
    return jax.jit(lambda p, kv: step.decode(p, x["nxt"], kv, x["active"], attend_len=S)).lower(
        step.place_params(params), kv).compile().as_text()

  looped = hlo(PS.PagedShardedStep.make(CFG, mesh8, "ws_2d", "heads", collective_matmul=True))
  plain = hlo(PS.PagedShardedStep.make(CFG, mesh8, "ws_2d", "heads"))
  assert "collective-permute" in looped and "collective-permute" not in plain


@pytest.mark.parametrize("ffn,quantized", CASES)
def test_a_parallel_block_loops_all_its_einsums(mesh8, ffn, quantized):
  """PaLM's parallel block: one all-gather looped into q, k, v, gate and up, one reduce-scatter
  into o and down; equal to the unsharded parallel-block model."""
  from models.step import UnshardedStep
  from models.weights import init_params, quantize
  from models.paged_kv import init_paged
  palm = CFG.replace(parallel_block=True)
  params = init_params(palm, jax.random.key(0))
  if quantized:
    params = quantize(params, palm)
  _, x, _ = _case(False)
  kv0 = init_paged(palm, B, NP, Z, M).replace(page_table=jnp.asarray(_table()))
  ref = _run(UnshardedStep(palm), UnshardedStep(palm), params, kv0, x)
  step = PS.PagedShardedStep.make(palm, mesh8, ffn, "batch_xyz", collective_matmul=True)
  assert step.plan(B).looped
  kv = step.init_kv(B, NP, Z, M, jnp.float32).replace(page_table=jnp.asarray(_table()))
  _check(_run(step, step, step.place_params(params), kv, x), ref, f"{ffn} parallel looped")


def test_layouts_it_does_not_apply_to_say_why(mesh8):
  plan = make_plan(CFG, mesh8, "wg_xyz", "batch_xyz", B, collective_matmul=True)
  assert not plan.looped and any("collective matmul" in r for r in plan.reasons)
  assert make_plan(CFG, mesh8, "ws_2d", "heads", B).key() != make_plan(
      CFG, mesh8, "ws_2d", "heads", B, collective_matmul=True).key()


def test_the_cost_model_hides_the_looped_collectives_under_the_ffn():
  """With ``collective_matmul`` the FFN's activation all-gather and reduce-scatter of ws_1d /
  ws_2d hide under the FFN's matmul time (only the excess stays exposed); nothing else changes,
  and a weight-gathered layout costs the same; a parallel-block model (PaLM: its one pair of
  collectives looped) gains too. The planner reports both variants when asked for both
  (``collective_matmul=None``)."""
  from models.config import get_preset
  from partitioning import cost_model, planner
  from partitioning.hardware import get_hardware
  m, hw = get_preset("small"), get_hardware("h100")
  assert not m.parallel_block
  args = ("prefill", 8, 2048, "bf16")
  for layout in ("ws_1d", "ws_2d"):
    plain = cost_model.step_cost(m, hw, layout, "heads", (2, 2, 2), *args)
    looped = cost_model.step_cost(m, hw, layout, "heads", (2, 2, 2), *args,
                                  collective_matmul=True)
    assert looped.comm_s < plain.comm_s and looped.latency_s < plain.latency_s
    assert (looped.compute_s, looped.weight_mem_s, looped.hbm_bytes_per_chip) == (
        plain.compute_s, plain.weight_mem_s, plain.hbm_bytes_per_chip)
    assert looped.comm_s >= looped.all_to_all_s  # only the FFN's part is hidden
  same = [cost_model.step_cost(m, hw, "wg_xyz", "heads", (2, 2, 2), *args,
                                collective_matmul=cm) for cm in (False, True)]
  assert same[0] == same[1]
  palm = [cost_model.step_cost(get_preset("palm-8b"), hw, "ws_2d", "heads", (2, 2, 2), *args,
                               collective_matmul=cm) for cm in (False, True)]
  assert palm[1].latency_s < palm[0].latency_s
  both = planner.plan(m, hw, 8, *args, meshes=[(2, 2, 2)], collective_matmul=None)
  ws = [(c.layout, c.attention, c.collective_matmul) for c in both.candidates
        if c.layout.startswith("ws")]
  assert ("ws_2d", "heads", True) in ws and ("ws_2d", "heads", False) in ws
  assert not any(c.collective_matmul for c in both.candidates if c.layout.startswith("wg"))
  only = planner.plan(m, hw, 8, *args, meshes=[(2, 2, 2)], collective_matmul=True)
  assert all(c.collective_matmul == c.layout.startswith("ws") for c in only.candidates)
  assert not any(c.collective_matmul for c in planner.plan(
      m, hw, 8, *args, meshes=[(2, 2, 2)]).candidates)  # the default: plain


def test_the_deployment_runs_what_it_costed(mesh8):
  from partitioning.deployment import Deployment, make_steps
  with pytest.raises(ValueError, match="runs on a mesh"):
    Deployment("single", collective_matmul=True)
  steps = make_steps(CFG, Deployment("interleaved", prefill_layout="ws_2d:heads",
                                     collective_matmul=True, hardware="h100"),
                     max_slots=8, max_chunk=16, max_context=CFG.max_seq_len, quantized=False,
                     devices=jax.devices()[:8])
  assert steps.step.collective_matmul and steps.description["prefill"]["collective_matmul"]
  dec = steps.decode.step if steps.decode else steps.step
  assert dec.collective_matmul
  assert ("collective matmul" in steps.description["decode_choice"]) == dec.plan(8).looped
