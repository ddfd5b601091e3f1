"""The native XLA:CPU kernels (models/cpu/kernels.py) and the quant.einsum paths that use them:
bit-identical int32 sums to XLA's int8 dot, float results equal to XLA's up to summation order,
and the same model logits either way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.cpu import cpuinfo, kernels as cpu_kernels, lowering as cpu_lowering
from models import quant
from models.quant import quantize_array
from tests.cpu_policies import NATIVE, XLA_ONLY, needs_kernel



def assert_close(got, ref, c: float) -> None:
  """``max|got - ref| <= c * max(1, max|ref|)``: an absolute bound scaled by the magnitude."""
  got = np.asarray(got, np.float64)
  ref = np.asarray(ref, np.float64)
  err = float(np.max(np.abs(got - ref)))
  bound = c * max(1.0, float(np.max(np.abs(ref))))
  assert err <= bound, f"max |diff| {err:.3g} > {c:g} * max(1, max|ref|) = {bound:.3g}"


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(1, 768, 2048), (8, 2048, 768), (3, 100, 96), (5, 7, 100),
                                   (9, 33, 64), (1, 4, 32), (2, 17, 31), (16, 64, 160)])
def test_matmul_s8_exact(m, k, n):
  rng = np.random.default_rng(m * 1000 + k + n)
  x = rng.integers(-128, 128, (m, k), dtype=np.int8)  # the full int8 range, -128 included
  w = rng.integers(-128, 128, (k, n), dtype=np.int8)
  got = np.asarray(jax.jit(cpu_kernels.matmul_s8)(x, w))
  np.testing.assert_array_equal(got, x.astype(np.int64) @ w.astype(np.int64))


@needs_kernel
@pytest.mark.parametrize("wdtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 768, 2048), (8, 2048, 768), (3, 100, 96), (16, 33, 64),
                                   (2, 17, 31), (1, 1, 32)])
def test_matmul_float(m, k, n, wdtype):
  rng = np.random.default_rng(m * 1000 + k + n)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = jnp.asarray(rng.standard_normal((k, n)), wdtype)
  got = np.asarray(jax.jit(cpu_kernels.matmul_float)(x, w))
  ref = x.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("spec,x_shape,w_shape", [
    ("btd,df->btf", (1, 1, 64), (64, 96)), ("btd,dnh->btnh", (3, 1, 64), (64, 4, 16)),
    ("btnh,nhd->btd", (2, 1, 4, 16), (4, 16, 64)), ("btd,vd->btv", (2, 1, 64), (40, 64))])
def test_float_einsum_native_equals_xla(dtype, spec, x_shape, w_shape):
  x = jax.random.normal(jax.random.key(0), x_shape, jnp.float32).astype(dtype)
  w = jax.random.normal(jax.random.key(1), w_shape, jnp.float32).astype(dtype)
  native = jax.jit(lambda x, w: quant.einsum(spec, x, w, NATIVE))(x, w)
  xla = jax.jit(lambda x, w: quant.einsum(spec, x, w, XLA_ONLY))(x, w)
  assert native.dtype == xla.dtype == dtype
  # f32: summation order only; bf16: the f32 sums are rounded to bf16 (2^-8 relative).
  assert_close(native, xla, 1e-5 if dtype == jnp.float32 else 1e-2)


@needs_kernel
@pytest.mark.parametrize("spec,x_shape,w_shape,contract", [
    ("btd,df->btf", (1, 1, 64), (64, 96), (0,)),
    ("btd,df->btf", (3, 1, 64), (64, 96), (0,)),
    ("btd,dnh->btnh", (2, 1, 64), (64, 4, 16), (0,)),
    ("btnh,nhd->btd", (2, 1, 4, 16), (4, 16, 64), (0, 1)),
    ("btd,vd->btv", (2, 1, 64), (40, 64), (1,)),  # [N, K] weight: the nk kernel
    ("btd,vd->btv", (16, 1, 100), (70, 100), (1,)),
])
def test_einsum_native_equals_xla(spec, x_shape, w_shape, contract):
  x = jax.random.normal(jax.random.key(0), x_shape, jnp.float32)
  w = quantize_array(jax.random.normal(jax.random.key(1), w_shape), contract, act_quant=True)
  native = jax.jit(lambda x, w: quant.einsum(spec, x, w, NATIVE))(x, w)
  xla = jax.jit(lambda x, w: quant.einsum(spec, x, w, XLA_ONLY))(x, w)
  np.testing.assert_array_equal(np.asarray(native), np.asarray(xla))
  ref = jnp.einsum(spec, x, w.dequantize())
  np.testing.assert_allclose(native, ref, atol=0.05 * float(jnp.abs(ref).max()))


@pytest.mark.parametrize("tied", [False, True])
def test_w8a8_decode_matches_forward(tied):
  """Decode rows (the native kernels' few-row shapes; tied: the [V, D] unembedding too) give the
  one-shot forward's logits: both paths compute the same int32 sums from the same per-token int8
  activations (only the f32 attention / norms differ in summation order)."""
  from models import transformer as T
  from models.config import get_preset
  from models.kv_cache import init_cache
  from models.weights import init_params, quantize
  cfg = get_preset("tiny").replace(tie_embeddings=tied)
  params = quantize(init_params(cfg, jax.random.key(0)), cfg, act_quant=True)
  toks = jax.random.randint(jax.random.key(1), (3, 12), 0, cfg.vocab_size)
  full = T.forward(params, toks, cfg=cfg, backend=NATIVE)
  cache = init_cache(cfg, 3, 32, backend=NATIVE)
  _, cache = T.prefill(params, toks[:, :8], cache, jnp.zeros((3,), jnp.int32),
                       jnp.full((3,), 8, jnp.int32), cfg=cfg, backend=NATIVE)
  for t in range(8, 12):
    logits, cache = T.jit_decode_step(params, toks[:, t], cache, cfg=cfg, attend_len=16,
                                      backend=NATIVE)
    assert_close(logits, full[:, t], 1e-4)


@needs_kernel
@pytest.mark.parametrize("prefetch_l1", [False, True])
def test_matmul_w8a8_is_the_xla_formula_bit_for_bit(prefetch_l1):
  rng = np.random.default_rng(7)
  m, k, n = 6, 96, 64
  x = rng.standard_normal((m, k)).astype(np.float32) * 3
  x[1] = 0.0  # amax == 0: scale 1
  x[2, :] = np.arange(k) % 9 - 4.5  # half-way values: round half to even after scaling
  x[2, 0] = 127.0  # amax 127 -> scale 1, so x / scale keeps the .5 ties
  w = rng.integers(-127, 128, (k, n), dtype=np.int8)
  w_scale = rng.uniform(0.001, 0.1, (n,)).astype(np.float32)

  def xla(x, w, s):
    amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    x_scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    xq = jnp.clip(jnp.round(x / x_scale), -127, 127).astype(jnp.int8)
    acc = jax.lax.dot_general(xq, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * x_scale * s[None]

  got = np.asarray(jax.jit(lambda x, w, s: cpu_kernels.matmul_w8a8(
      x, w, s, prefetch_l1=prefetch_l1))(x, w, w_scale))
  np.testing.assert_array_equal(got, np.asarray(jax.jit(xla)(x, w, w_scale)))


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(1, 576, 4099), (8, 576, 1000), (16, 64, 33), (3, 100, 17),
                                   (5, 7, 5), (2, 130, 16), (1, 1, 1), (9, 256, 48)])
def test_matmul_w8a8_nk_is_the_xla_formula_bit_for_bit(m, k, n):
  """The [N, K] (tied unembedding) kernel: K and N tails, ties, an all-zero row."""
  rng = np.random.default_rng(m * 1000 + k + n)
  x = rng.standard_normal((m, k)).astype(np.float32) * 3
  x[0, : min(k, 5)] = 0.0
  if m > 1:
    x[1] = 0.0  # amax == 0: scale 1
  if m > 2:
    x[2, :] = np.arange(k) % 9 - 4.5
    x[2, 0] = 127.0  # scale 1: x / scale keeps the .5 ties
  w = rng.integers(-127, 128, (n, k), dtype=np.int8)
  w_scale = rng.uniform(0.001, 0.1, (n,)).astype(np.float32)

  def xla(x, w, s):
    return cpu_lowering.w8a8_xla(x, w, s[None], False, 1)

  got = np.asarray(jax.jit(cpu_kernels.matmul_w8a8_nk)(x, w, w_scale))
  np.testing.assert_array_equal(got, np.asarray(jax.jit(xla)(x, w, w_scale)))


@needs_kernel
def test_matmul_w8a8_nk_equals_kn_kernel():
  rng = np.random.default_rng(3)
  x = rng.standard_normal((4, 96)).astype(np.float32)
  w = rng.integers(-127, 128, (96, 80), dtype=np.int8)
  s = rng.uniform(0.001, 0.1, (80,)).astype(np.float32)
  a = np.asarray(jax.jit(cpu_kernels.matmul_w8a8)(x, w, s))
  b = np.asarray(jax.jit(cpu_kernels.matmul_w8a8_nk)(x, np.ascontiguousarray(w.T), s))
  np.testing.assert_array_equal(a, b)


def test_kernels_build_where_the_cpu_supports_them():
  """The skips above are for other CPUs only: where the CPU has the instructions and a C++
  compiler exists (as on the dev and CI machines), a failed build must fail the suite."""
  import shutil
  need = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi"}
  capable = (jax.default_backend() == "cpu" and need <= cpuinfo.flags()
             and any(shutil.which(c) for c in ("c++", "g++")))
  if capable:
    assert cpu_kernels.available(), "native kernels failed to build on a capable CPU"
  else:
    assert not cpu_kernels.available()


@pytest.mark.parametrize("m,k,n", [(1, 576, 1000), (3, 100, 37), (8, 64, 33), (16, 48, 70)])
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16", "int8"])
def test_float_kernels_both_layouts(m, k, n, wdtype):
  """matmul_float ([K, N]) and matmul_float_nk ([N, K], the tied unembedding), including int8
  weights (weight-only int8: raw integer values), against float64: f32 products and sums, so
  within f32 rounding of the magnitude (K and N tails included)."""
  assert cpu_kernels.available()
  rng = np.random.default_rng(m * k + n)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  if wdtype == "int8":
    w = jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8)
  else:
    w = jnp.asarray(rng.standard_normal((n, k)), wdtype)
  w64 = np.asarray(w.astype(jnp.float32), np.float64)
  ref = np.asarray(x, np.float64) @ w64.T
  scale = np.max(np.abs(ref))
  got_nk = np.asarray(jax.jit(cpu_kernels.matmul_float_nk)(x, w))
  got_kn = np.asarray(jax.jit(cpu_kernels.matmul_float)(x, jnp.asarray(w64.T).astype(w.dtype)))
  assert np.max(np.abs(got_nk - ref)) <= 1e-5 * scale
  assert np.max(np.abs(got_kn - ref)) <= 1e-5 * scale
