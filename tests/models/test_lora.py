"""LoRA adapters in the model, checked against transformers + peft (the reference interpreter).

Contract: ``tests/reference/make_peft_reference.py`` (run under ``.venv-ref``, cached in
``tests/_ref_artifacts/peft/``) writes a tiny random Llama (GQA), three PEFT adapters (every
target at r 8; q / v of one layer with rsLoRA scaling at r 4; the MLP at r 16) and torch's
logits with each. phaseserve loads the base with ``load_hf_checkpoint`` and the adapters with
``load_peft_adapter`` into three slots of rank 16 (the smaller ranks zero-padded) and runs one
batch mixing every adapter and none, row by row.
Tolerance: logits are O(1) (up to ~4.4); both sides compute in float32 (observed max |diff|
6e-6; each adapter moves the logits by 1.7-5.9), so
``atol = rtol = 1e-4``. A wrong scaling (alpha ignored) or a transposed factor is O(1) off: the
controls check that such a change is caught.
"""

from __future__ import annotations

from tests import paths  # noqa: F401

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import lora
from models.io.hf_import import load_hf_checkpoint
from models.io.peft import load_peft_adapter
from models.transformer import forward
from models.weights import stack_layers
from tests import refenv

GENERATOR = refenv.REPO / "tests" / "reference" / "make_peft_reference.py"
ADAPTERS = ("all_r8", "qv_rslora", "mlp_r16")
ATOL = RTOL = 1e-4
RANK = 16


def _complete(d: Path) -> bool:
  try:
    return tuple(json.loads((d / "manifest.json").read_text())["adapters"]) == ADAPTERS
  except (OSError, ValueError, KeyError):
    return False


@pytest.fixture(scope="module")
def ref() -> Path:
  return refenv.cached_artifacts("peft", GENERATOR, [], _complete, timeout_s=300)


@pytest.fixture(scope="module")
def model(ref):
  cfg, params = load_hf_checkpoint(ref / "base", jnp.float32)
  adapters = {n: load_peft_adapter(ref / n, cfg) for n in ADAPTERS}
  w = lora.empty_weights(cfg, len(ADAPTERS), RANK, jnp.float32)
  for s, ad in enumerate(adapters.values()):
    a, b = ad.padded(RANK)
    w = lora.place(w, jnp.int32(s), a, b)
  return cfg, params, adapters, w


def _batch(ref: Path):
  """Every reference row under every slot and none: rows [slot -1 x B, slot 0 x B, ...]."""
  tokens = np.load(ref / "tokens.npy")
  names = ("base",) + ADAPTERS
  want = np.concatenate([np.load(ref / f"logits_{n}.npy") for n in names])
  slots = np.repeat(np.arange(-1, len(ADAPTERS)), tokens.shape[0])
  return np.tile(tokens, (len(names), 1)), slots, want


def test_adapter_files_read_as_saved(model):
  cfg, _, adapters, _ = model
  assert {n: ad.rank for n, ad in adapters.items()} == {"all_r8": 8, "qv_rslora": 4,
                                                        "mlp_r16": 16}
  assert adapters["all_r8"].targets == lora.TARGETS
  assert adapters["qv_rslora"].targets == ("q", "v")
  assert not adapters["qv_rslora"].b["q"][0].any() and adapters["qv_rslora"].b["q"][1].any()
  assert adapters["mlp_r16"].targets == ("gate", "up", "down")


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "scan"])
def test_mixed_batch_equals_torch_peft(model, ref, stacked):
  cfg, params, _, w = model
  tokens, slots, want = _batch(ref)
  p = stack_layers(params) if stacked else params
  batch = lora.LoraBatch(w, jnp.asarray(np.repeat(slots[:, None], tokens.shape[1], 1)))
  got = np.asarray(forward(p, jnp.asarray(tokens), cfg=cfg, lora=batch))
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
  base = np.asarray(forward(p, jnp.asarray(tokens[:2]), cfg=cfg))
  np.testing.assert_allclose(base, want[:2], atol=ATOL, rtol=RTOL)


def test_merged_weights_equal_the_gathered_path(model, ref):
  cfg, params, adapters, w = model
  tokens = jnp.asarray(np.load(ref / "tokens.npy"))
  for s, (name, ad) in enumerate(adapters.items()):
    ref_logits = np.asarray(forward(lora.merged(params, ad.a, ad.b), tokens, cfg=cfg))
    slot_BT = jnp.full(tokens.shape, s, jnp.int32)
    got = np.asarray(forward(params, tokens, cfg=cfg, lora=lora.LoraBatch(w, slot_BT)))
    np.testing.assert_allclose(got, ref_logits, atol=ATOL, rtol=RTOL, err_msg=name)


def test_controls_a_wrong_scaling_or_slot_is_caught(model, ref):
  cfg, params, adapters, w = model
  tokens, slots, want = _batch(ref)
  slot_BT = jnp.asarray(np.repeat(slots[:, None], tokens.shape[1], 1))
  doubled = lora.LoraWeights(w.a, jax.tree.map(lambda x: 2 * x, w.b))
  got = np.asarray(forward(params, jnp.asarray(tokens), cfg=cfg,
                           lora=lora.LoraBatch(doubled, slot_BT)))
  n = tokens.shape[0] // (len(ADAPTERS) + 1)
  for k in range(1, len(ADAPTERS) + 1):  # every adapter's rows move by far more than the bound
    assert np.abs(got[k * n:(k + 1) * n] - want[k * n:(k + 1) * n]).max() > 100 * ATOL
  shifted = jnp.where(slot_BT >= 0, (slot_BT + 1) % len(ADAPTERS), -1)
  got = np.asarray(forward(params, jnp.asarray(tokens), cfg=cfg,
                           lora=lora.LoraBatch(w, shifted)))
  assert np.abs(got[n:] - want[n:]).max() > 100 * ATOL
  np.testing.assert_allclose(got[:n], want[:n], atol=ATOL, rtol=RTOL)  # no adapter: unchanged


def test_unsupported_adapters_are_refused_by_name(model, ref, tmp_path):
  cfg = model[0]
  conf = json.loads((ref / "all_r8" / "adapter_config.json").read_text())
  for key, value in (("use_dora", True), ("modules_to_save", ["lm_head"]),
                     ("peft_type", "IA3")):
    d = tmp_path / key
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({**conf, key: value}))
    (d / "adapter_model.safetensors").write_bytes(
        (ref / "all_r8" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=key if key != "peft_type" else "IA3"):
      load_peft_adapter(d, cfg)
  with pytest.raises(FileNotFoundError, match="adapter_config.json"):
    load_peft_adapter(tmp_path, cfg)
  with pytest.raises(ValueError, match="rank 16 > the slots' 8"):
    load_peft_adapter(ref / "mlp_r16", cfg).padded(8)


def test_native_kernel_path_equals_the_dense_path(model, ref):
  """Where the backend has it, the native kernel computes the adapters' terms: the same
  logits as the dense XLA form within f32 summation-order noise (decode-sized and a full
  batch)."""
  from models.cpu import backend as cpu_backend
  be = cpu_backend.native()
  if not be.lora:
    pytest.skip("the native LoRA kernel needs AVX-512 and a C++ compiler")
  cfg, params, _, w = model
  tokens, slots, want = _batch(ref)
  for t in (1, tokens.shape[1]):
    batch = lora.LoraBatch(w, jnp.asarray(np.repeat(slots[:, None], t, 1)))
    dense = np.asarray(forward(params, jnp.asarray(tokens[:, :t]), cfg=cfg, lora=batch))
    native = np.asarray(forward(params, jnp.asarray(tokens[:, :t]), cfg=cfg, lora=batch,
                                backend=be))
    np.testing.assert_allclose(native, dense, atol=ATOL, rtol=RTOL)
  np.testing.assert_allclose(native, want, atol=ATOL, rtol=RTOL)  # and torch + peft's
