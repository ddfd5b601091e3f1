"""models.cpu.lowering: the per-machine lowering policy. Disabled -> the defaults without
measuring; measured -> written to the disk cache and read back from it; the report's content;
and every candidate lowering computes the reference einsum (float: within a stated relative
tolerance; int8 W8A8: bit-identical across candidates)."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.cpu import kernels as cpu_kernels, lowering as cpu_lowering
from models import quant
from models.quant import quantize_array

# A measurement small enough for the suite (well under a second on the 2-core dev machine).
SMALL = dict(rounds=1, k=64, n=128, prefill_rows=48, stream_bytes=2**20, rows=(1, 8))


@pytest.fixture(autouse=True)
def _fresh_state():
  cpu_lowering.set_policy(None)
  yield
  cpu_lowering.set_policy(None)


def test_disabled_is_the_default_and_measures_nothing(monkeypatch, tmp_path):
  monkeypatch.setenv("PHASESERVE_CPU_AUTOTUNE", "0")
  monkeypatch.setenv("PHASESERVE_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(cpu_lowering, "autotune", lambda **kw: pytest.fail("measured"))
  assert cpu_lowering.policy() == cpu_lowering.DEFAULT
  r = cpu_lowering.report()
  assert r["source"] == "default" and r["measurements"] == {}
  assert not os.path.exists(os.path.join(tmp_path, cpu_lowering.CACHE_FILE))


def test_measured_once_cached_and_read_back(monkeypatch, tmp_path):
  if jax.default_backend() != "cpu":
    pytest.skip("the policy is measured on CPU only")
  monkeypatch.setenv("PHASESERVE_CPU_AUTOTUNE", "1")
  monkeypatch.setenv("PHASESERVE_CACHE_DIR", str(tmp_path))
  calls = []
  real = functools.partial(cpu_lowering.autotune, **SMALL)

  def counted(**kw):
    calls.append(1)
    return real()

  monkeypatch.setattr(cpu_lowering, "autotune", counted)
  p = cpu_lowering.policy()
  assert cpu_lowering.policy() is p and len(calls) == 1  # decided once per process
  r = cpu_lowering.report()
  assert r["source"] == "measured" and r["policy"] == dataclasses.asdict(p)
  assert r["key"] == cpu_lowering.cache_key() and cpu_lowering.cpu_model() in r["key"]
  assert jax.__version__ in r["key"]
  assert "float_prefill_bfloat16" in r["measurements"]
  assert set(r["measurements"]["float_prefill_bfloat16"]) == set(cpu_lowering.FLOAT_PREFILL)
  assert set(r["measurements"]["float_prefill_float32"]) == set(cpu_lowering.F32_PREFILL)
  if cpu_kernels.available():
    assert {"int8_kn_decode_1rows", "int8_nk_decode_8rows", "float_decode_bfloat16_8rows",
            "int8_kn_prefetch_l1_1rows"} <= set(r["measurements"])
  # AMX is raced only where the CPU has it (the Xeon); elsewhere its ranges stay 0 / 0.
  amx = {f"amx_{w}_{m}rows" for w in ("bf16", "int8") for m in (8, 16, 32, 64, 128, 256, 512)}
  if cpu_kernels.available() and cpu_kernels.amx_available():
    assert amx <= set(r["measurements"])
    assert all(set(r["measurements"][k]) == {"amx", "incumbent"} for k in amx)
  else:
    assert not amx & set(r["measurements"])
    assert (p.amx_min_rows, p.amx_max_rows, p.amx_int8_min_rows, p.amx_int8_max_rows) == (0,) * 4
  json.dumps(r)  # JSON-able
  with open(os.path.join(tmp_path, cpu_lowering.CACHE_FILE)) as f:
    stored = json.load(f)[r["key"]]
  assert stored["policy"] == r["policy"] and stored["seconds"] > 0
  # A new process (state reset) reads the cache instead of measuring.
  cpu_lowering.set_policy(None)
  assert cpu_lowering.policy() == p and len(calls) == 1
  assert cpu_lowering.report()["source"] == "cache"


def test_failure_falls_back_to_default(monkeypatch, tmp_path):
  if jax.default_backend() != "cpu":
    pytest.skip("the policy is measured on CPU only")
  monkeypatch.setenv("PHASESERVE_CPU_AUTOTUNE", "1")
  monkeypatch.setenv("PHASESERVE_CACHE_DIR", str(tmp_path))

  def boom(**kw):
    raise RuntimeError("no")

  monkeypatch.setattr(cpu_lowering, "autotune", boom)
  assert cpu_lowering.policy() == cpu_lowering.DEFAULT
  assert cpu_lowering.report()["source"] == "default"


def test_fixed_policy_wins_and_is_restored():
  p = dataclasses.replace(cpu_lowering.DEFAULT, float_prefill="wt", int8_row_multiple=32)
  with cpu_lowering.use_policy(p):
    assert cpu_lowering.policy() is p and cpu_lowering.report()["source"] == "fixed"
  with pytest.raises(ValueError):
    cpu_lowering.CpuPolicy(float_prefill="nope")
  with pytest.raises(ValueError):
    cpu_lowering.CpuPolicy(f32_prefill="xw_nacc")


# Relative tolerance of a float candidate against the f64 einsum of the same (rounded) operands:
# |got - ref| <= C * max(1, max|ref|); f32: summation order only; bf16: one bf16 rounding of the
# f32 result (2^-8) plus summation order.
C_FLOAT = {jnp.float32: 1e-5, jnp.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("method", cpu_lowering.FLOAT_PREFILL)
@pytest.mark.parametrize("spec,x_shape,w_shape", [
    ("btd,df->btf", (2, 24, 64), (64, 96)), ("btnh,nhd->btd", (3, 20, 4, 16), (4, 16, 64)),
    ("btd,vd->btv", (2, 20, 64), (40, 64)), ("btd,df->btf", (1, 1, 64), (64, 96))])
def test_float_candidates_equal_the_einsum(dtype, method, spec, x_shape, w_shape):
  x = jax.random.normal(jax.random.key(0), x_shape, jnp.float32).astype(dtype)
  w = jax.random.normal(jax.random.key(1), w_shape, jnp.float32).astype(dtype)
  f32_method = method if method in cpu_lowering.F32_PREFILL else "xw"
  p = dataclasses.replace(cpu_lowering.DEFAULT, float_prefill=method, f32_prefill=f32_method,
                          float_native_max_rows=4,
                          f32_native_max_rows=4, bf16_min_rows=8)
  with cpu_lowering.use_policy(p):
    got = jax.jit(lambda x, w: quant.einsum(spec, x, w))(x, w)
  assert got.dtype == dtype
  ref = np.einsum(spec, np.asarray(x, np.float64), np.asarray(w, np.float64))
  got = np.asarray(got, np.float64)
  bound = C_FLOAT[dtype] * max(1.0, float(np.abs(ref).max()))
  assert float(np.abs(got - ref).max()) <= bound


@pytest.mark.parametrize("spec,x_shape,w_shape,contract", [
    ("btd,df->btf", (3, 7, 64), (64, 96), (0,)), ("btd,vd->btv", (1, 5, 64), (40, 64), (1,)),
    ("btd,vd->btv", (3, 1, 64), (40, 64), (1,))])
def test_int8_candidates_are_bit_identical(spec, x_shape, w_shape, contract):
  x = jax.random.normal(jax.random.key(0), x_shape, jnp.float32)
  w = quantize_array(jax.random.normal(jax.random.key(1), w_shape), contract, act_quant=True)
  outs = []
  for native_rows in (0, 16):
    for mult in (1, 8, 32):
      p = dataclasses.replace(cpu_lowering.DEFAULT, int8_native_max_rows=native_rows,
                              int8_nk_native_max_rows=native_rows, int8_row_multiple=mult,
                              int8_prefetch_l1=mult == 8)
      with cpu_lowering.use_policy(p):
        outs.append(np.asarray(jax.jit(lambda x, w: quant.einsum(spec, x, w))(x, w)))
  for o in outs[1:]:
    np.testing.assert_array_equal(o, outs[0])
  ref = np.einsum(spec, np.asarray(x, np.float64), np.asarray(w.dequantize(), np.float64))
  # W8A8: per-token int8 activations, error ~ 1/127 of each row's amax per term.
  assert float(np.abs(outs[0] - ref).max()) <= 0.05 * float(np.abs(ref).max())
