"""models.cpu.lowering / backend: the per-machine lowering policy, chosen at start-up. Not
allowed -> the defaults without measuring; measured -> written to the disk cache and read back
from it; the report's content; ``resolve`` reads the switches;
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

from models.cpu import backend as cpu_backend, cpuinfo, lowering as cpu_lowering
from models.cpu import paged_attention as cpa
from models import quant
from models.quant import quantize_array
from tests.cpu_policies import NATIVE

# A measurement small enough for the suite (well under a second on the 2-core dev machine).
SMALL = dict(rounds=1, k=64, n=128, prefill_rows=48, stream_bytes=2**20, rows=(1, 8),
             kernel_rows=(8, 16))


def test_not_allowed_is_the_default_and_measures_nothing(monkeypatch, tmp_path):
  monkeypatch.setattr(cpu_lowering, "measure", lambda **kw: pytest.fail("measured"))
  c = cpu_lowering.choose(False, NATIVE.matmul_kernels, NATIVE.amx, str(tmp_path))
  assert c.policy == cpu_lowering.DEFAULT and c.source == "default" and c.measurements == {}
  assert not os.path.exists(os.path.join(tmp_path, cpu_lowering.CACHE_FILE))


def test_resolve_reads_the_switches_once(monkeypatch, tmp_path):
  """``models.cpu.backend.resolve``: PHASESERVE_CPU_AUTOTUNE=0 -> the defaults, nothing measured;
  PHASESERVE_AMX=0 -> no AMX; PHASESERVE_NATIVE_KERNELS=0 -> no native kernel; a resolved value is frozen and hashable."""
  monkeypatch.setenv("PHASESERVE_CPU_AUTOTUNE", "0")
  monkeypatch.setenv("PHASESERVE_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(cpu_lowering, "measure", lambda **kw: pytest.fail("measured"))
  r = cpu_backend.resolve()
  assert r.backend == NATIVE and r.report()["source"] == "default"
  json.dumps(r.report())
  # PHASESERVE_AMX=0: the AMX library is never asked for (so the process never requests the
  # AMX tile state), the other kernels stay.
  from models.cpu import kernels
  monkeypatch.setattr(kernels, "amx_available", lambda: pytest.fail("AMX asked for"))
  monkeypatch.setenv("PHASESERVE_AMX", "0")
  no_amx = cpu_backend.resolve().backend
  assert no_amx == dataclasses.replace(NATIVE, amx=False)
  monkeypatch.setenv("PHASESERVE_NATIVE_KERNELS", "0")
  off = cpu_backend.resolve().backend
  assert off == cpu_backend.CpuBackend() and hash(off) == hash(cpu_backend.CpuBackend())
  with pytest.raises(dataclasses.FrozenInstanceError):
    off.amx = True  # type: ignore[misc]


def test_measured_once_cached_and_read_back(monkeypatch, tmp_path):
  if jax.default_backend() != "cpu":
    pytest.skip("the policy is measured on CPU only")
  calls = []
  real = functools.partial(cpu_lowering.measure, **SMALL)

  def counted(**kw):
    calls.append(1)
    return real(**kw)

  monkeypatch.setattr(cpu_lowering, "measure", counted)
  native, amx = NATIVE.matmul_kernels, NATIVE.amx
  c = cpu_lowering.choose(True, native, amx, str(tmp_path))
  p = c.policy
  assert c.source == "measured" and len(calls) == 1
  r = cpu_backend.Resolved(dataclasses.replace(NATIVE, policy=p), c).report()
  assert r["policy"] == dataclasses.asdict(p)
  assert r["key"] == cpu_lowering.cache_key(native, amx) and cpuinfo.key() in r["key"]
  assert jax.__version__ in r["key"]
  assert "float_prefill_bfloat16" in r["measurements"]
  assert set(r["measurements"]["float_prefill_bfloat16"]) == set(cpu_lowering.FLOAT_PREFILL)
  assert set(r["measurements"]["float_prefill_float32"]) == set(cpu_lowering.F32_PREFILL)
  if native:
    assert {"int8_kn_decode_1rows", "int8_nk_decode_8rows", "float_decode_bfloat16_8rows",
            "int8_kn_prefetch_l1_1rows"} <= set(r["measurements"])
  if native and cpa.available():  # the paged attention's prefetch target, L2 vs L1
    att = r["measurements"]["attention_prefetch_16rows_200keys"]
    assert set(att) == {"l1", "l2"} and min(att.values()) > 0
    assert p.attention_prefetch_l2 == (not att["l1"] * (1 + cpu_lowering.MARGIN) < att["l2"])
  # AMX is raced only where the CPU has it (the Xeon); elsewhere its ranges stay 0 / 0.
  amx_keys = {f"amx_{w}_{m}rows" for w in ("bf16", "int8") for m in SMALL["kernel_rows"]}
  amx_keys |= {f"amx_{kind}_bf16_{m}rows" for kind in ("nk", "tiled")
               for m in SMALL["kernel_rows"]}
  blocks_key = "attention_blocks_128tokens"  # the AMX attention blocks against the rows
  if native and amx:
    assert amx_keys <= set(r["measurements"])
    assert all(set(r["measurements"][k]) in ({"amx", "incumbent"}, {"amx_tiled", "incumbent"})
               for k in amx_keys)
    if cpa.available() and cpa.bf16_dot_supported():
      blocks = r["measurements"][blocks_key]
      assert set(blocks) == {"blocks", "rows"}
      assert p.attention_amx_blocks == (blocks["blocks"] * (1 + cpu_lowering.MARGIN)
                                        < blocks["rows"])
  else:
    assert not (amx_keys | {blocks_key}) & set(r["measurements"])
    assert (p.amx_min_rows, p.amx_max_rows, p.amx_int8_min_rows, p.amx_int8_max_rows,
            p.amx_nk_min_rows, p.amx_nk_max_rows, p.amx_tiled_min_rows,
            p.amx_tiled_max_rows) == (0,) * 8
    assert not p.attention_amx_blocks
  json.dumps(r)  # JSON-able
  with open(os.path.join(tmp_path, cpu_lowering.CACHE_FILE)) as f:
    stored = json.load(f)[r["key"]]
  assert stored["policy"] == r["policy"] and stored["seconds"] > 0
  # The next start-up reads the cache instead of measuring.
  again = cpu_lowering.choose(True, native, amx, str(tmp_path))
  assert again.policy == p and again.source == "cache" and len(calls) == 1


def test_failure_falls_back_to_default(monkeypatch, tmp_path):
  if jax.default_backend() != "cpu":
    pytest.skip("the policy is measured on CPU only")

  def boom(**kw):
    raise RuntimeError("no")

  monkeypatch.setattr(cpu_lowering, "measure", boom)
  c = cpu_lowering.choose(True, NATIVE.matmul_kernels, NATIVE.amx, str(tmp_path))
  assert c.policy == cpu_lowering.DEFAULT and c.source == "default"


def test_bad_policies_are_refused():
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
  b = dataclasses.replace(NATIVE, policy=p)
  got = jax.jit(lambda x, w: quant.einsum(spec, x, w, b))(x, w)
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
      b = dataclasses.replace(NATIVE, policy=p)
      outs.append(np.asarray(jax.jit(lambda x, w: quant.einsum(spec, x, w, b))(x, w)))
  for o in outs[1:]:
    np.testing.assert_array_equal(o, outs[0])
  ref = np.einsum(spec, np.asarray(x, np.float64), np.asarray(w.dequantize(), np.float64))
  # W8A8: per-token int8 activations, error ~ 1/127 of each row's amax per term.
  assert float(np.abs(outs[0] - ref).max()) <= 0.05 * float(np.abs(ref).max())
