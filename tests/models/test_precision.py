"""models.precision: the int8 compute policy is chosen once, here, and both branches of
models.quant.einsum (the CPU lowering and the accelerator's plain dot) compute the same thing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import precision, quant
from models.config import get_preset
from models.cpu import router
from models.transformer import forward
from models.weights import init_params, quantize
from tests.cpu_policies import NATIVE

CFG = get_preset("tiny").replace(vocab_size=320, tie_embeddings=True)


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0), jnp.float32)


def test_default_is_weight_only_everywhere(params):
  for backend in ("cpu", "gpu", "tpu"):
    assert precision.default_int8_mode(backend) == "weight_only"
  q = precision.apply(params, CFG, "int8")
  assert precision.int8_mode_of(q) == "weight_only"
  assert precision.int8_mode_of(precision.apply(params, CFG, "int8", "w8a8")) == "w8a8"
  assert precision.apply(params, CFG, "none") is params
  assert precision.int8_mode_of(params) is None


def test_saved_mode_is_not_trusted(params):
  """An int8 tree saved as W8A8 (e.g. an int8 checkpoint made on CPU) runs in the mode chosen
  at load time, not the one it carries."""
  saved = quantize(params, CFG, act_quant=True)
  assert precision.int8_mode_of(precision.apply(saved, CFG, "none")) == "weight_only"
  assert precision.int8_mode_of(precision.apply(saved, CFG, "int8", "w8a8")) == "w8a8"
  with pytest.raises(ValueError):
    precision.apply(params, CFG, "int4")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["none", "weight_only", "w8a8"])
def test_cpu_and_accelerator_branches_agree(params, mode, monkeypatch):
  """The same model through the CPU lowering (native kernels, padded rows) and through the
  non-CPU branch (plain dot_general), forced on this CPU: within f32 summation order, except
  W8A8, whose per-token scales are the same in both (exact int32 sums), so also close."""
  p = params if mode == "none" else precision.apply(params, CFG, "int8", mode)
  toks = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 9)))
  cpu = np.asarray(jax.jit(lambda p, t: forward(p, t, cfg=CFG, backend=NATIVE))(p, toks))
  monkeypatch.setattr(router, "_on_cpu", lambda: False)
  other = np.asarray(jax.jit(lambda p, t: forward(p, t, cfg=CFG, backend=NATIVE))(p, toks))
  err = np.max(np.abs(cpu - other)) / max(1.0, np.max(np.abs(cpu)))
  assert err <= 1e-5, (mode, err)
  if mode != "none":  # and the modes really differ (the test can fail)
    other_mode = "w8a8" if mode == "weight_only" else "weight_only"
    q2 = precision.apply(params, CFG, "int8", other_mode)
    alt = np.asarray(jax.jit(lambda p, t: forward(p, t, cfg=CFG, backend=NATIVE))(q2, toks))
    assert np.max(np.abs(alt - other)) / max(1.0, np.max(np.abs(other))) > 1e-4


def test_decode_rows_take_the_native_weight_only_kernel(params):
  """At decode shapes the CPU lowering of weight-only int8 equals the plain einsum, for the
  [K, N] layers and the tied [V, D] unembedding (the native kernels where available)."""
  q = precision.apply(params, CFG, "int8", "weight_only")
  x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 1, CFG.embed_dim)), jnp.float32)
  for spec, w in (("btd,vd->btv", q["embed"]), ("btd,df->btf", q["layers"][0]["gate"])):
    got = jax.jit(lambda x, w: quant.einsum(spec, x, w, NATIVE))(x, w)
    want = jnp.einsum(spec, x, w.dequantize())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                               rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))
