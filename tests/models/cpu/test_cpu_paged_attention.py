"""models.cpu.paged_attention: the native decode attention over the page pool equals the gather
path (``PagedKV.read`` + ``models.attention.attend``) for f32, bf16 and int8 pages (values
and per-token, per-head scales), both bf16 code paths (AVX-512 BF16 dot products, and f32
FMAs), null table entries, rows of every length from 1 key to the full table, ``max_keys``
below the table's capacity, multiquery and grouped heads; ``PagedKV.attend`` and the contiguous
``KVCache.attend`` pick it for decode and the model's decode logits agree with the gather path;
a prefill chunk (each of its queries one kernel row) equals the gather path's causal attention,
and the model's chunked prefill logits agree with it.

Tolerances, relative to the reference's magnitude ``max(1, max|ref|)``: f32 pages 1e-5 (the
same products, summed in another order); bf16 pages 2e-2 (both paths round q and the
probabilities to bf16 and the output to bf16: one bf16 rounding step is 2^-8 = 3.9e-3 relative);
int8 pages 1e-5 on the f32 path (both dequantize the same int8 values and scales and compute in
f32), and the bf16 tolerance on the AVX-512 BF16 path (int8 values are exact in bf16; q and the
probabilities are rounded to bf16 as for bf16 pages).
"""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention, paged_kv as PK, quant
from models.cpu import cpuinfo, paged_attention as cpa
from models.cpu.backend import CpuBackend
from models import transformer as T
from models.config import get_preset
from models.kv_cache import init_cache
from models.weights import init_params
from tests.cpu_policies import NATIVE

needs_kernel = pytest.mark.skipif(not cpa.available(),
                                  reason="native paged attention unavailable (CPU / compiler)")
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "int8": 1e-5}
GATHER = CpuBackend()  # XLA only: the gather path


def _kernel(bf16_dot: bool = True) -> CpuBackend:
  """Every native path, the paged attention's BF16 dot path as asked (where the CPU has it)."""
  return dataclasses.replace(NATIVE, paged_bf16_dot=bf16_dot and cpa.bf16_dot_supported())


def assert_close(got, ref, c: float) -> None:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  err = float(np.max(np.abs(got - ref)))
  bound = c * max(1.0, float(np.max(np.abs(ref))))
  assert err <= bound, f"max |diff| {err:.3g} > {c:g} * max(1, max|ref|) = {bound:.3g}"


def test_kernel_builds_where_the_cpu_supports_it():
  """The skips here are for other CPUs only: with AVX-512 F and a compiler (the dev and CI
  machines), a failed build fails the suite."""
  capable = (jax.default_backend() == "cpu" and "avx512f" in cpuinfo.flags()
             and any(shutil.which(c) for c in ("c++", "g++")))
  assert cpa.available() == capable


def _pages(x, dtype):
  """Float pages, or for int8 the ``QuantArray`` of per-token, per-head quantized values (token
  magnitudes spread over 1e-2..1e2, so the scales matter)."""
  if jnp.dtype(dtype) != jnp.int8:
    return jnp.asarray(x, dtype)
  spread = np.exp(np.random.default_rng(1).uniform(-4.6, 4.6, x.shape[:-1] + (1,)))
  return quant.quantize_array(jnp.asarray(x * spread, jnp.float32), (4,))


def _case(rng, b, n, kh, h, z, m, dtype, layers=2):
  p = b * m + 3
  k = _pages(rng.standard_normal((layers, p, kh, z, h)), dtype)
  v = _pages(rng.standard_normal((layers, p, kh, z, h)), dtype)
  table = rng.permutation(p)[:b * m].reshape(b, m).astype(np.int32)
  table[0, -1] = p  # a null entry (reads as zeros) inside row 0's visible range
  pos = rng.integers(0, m * z, size=b).astype(np.int32)
  pos[0], pos[-1] = m * z - 1, 0  # the full table; a single visible key
  q_dtype = jnp.float32 if jnp.dtype(dtype) == jnp.int8 else dtype
  q = jnp.asarray(rng.standard_normal((b, 1, n, h)) * 0.1, q_dtype)
  return q, k, v, jnp.asarray(table), jnp.asarray(pos)


@needs_kernel
@pytest.mark.parametrize("b,n,kh,h,z,m", [(5, 9, 3, 64, 16, 4), (6, 12, 1, 64, 64, 2),
                                          (4, 4, 1, 16, 8, 5), (3, 2, 2, 32, 16, 3)])
@pytest.mark.parametrize("dtype,bf16_dot", [("float32", "1"), ("bfloat16", "1"),
                                            ("bfloat16", "0"), ("int8", "1"), ("int8", "0")])
def test_kernel_equals_the_gather_path(b, n, kh, h, z, m, dtype, bf16_dot):
  rng = np.random.default_rng(b * 100 + n)
  q, k, v, table, pos = _case(rng, b, n, kh, h, z, m, jnp.dtype(dtype))
  kv = PK.PagedKV(k_pages=k, v_pages=v, page_table=table, lengths=pos,
                  backend=_kernel(bf16_dot == "1"))
  for layer in range(k.shape[0]):
    for max_keys in (m * z, m * z - z // 2):
      ref = attention.attend(q, *kv.read(layer, max_keys), jnp.minimum(pos, max_keys - 1)[:, None])
      got = jax.jit(kv.attend, static_argnums=(0, 3))(layer, q, pos[:, None], max_keys)
      assert got.shape == ref.shape and got.dtype == ref.dtype
      bf16_math = dtype == "int8" and bf16_dot == "1" and cpa.bf16_dot_supported() and z % 16 == 0 \
          and h % 32 == 0  # int8 pages on the AVX-512 BF16 path round q and p to bf16
      assert_close(got, ref, TOL["bfloat16" if bf16_math else dtype])


@needs_kernel
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_the_prefetch_target_changes_no_output(dtype):
  """The next page prefetched into L1 or L2 (the policy's ``attention_prefetch_l2``): the same
  bits, over pages long and short (the prefetch runs ahead into the next row's first page)."""
  rng = np.random.default_rng(11)
  q, k, v, table, pos = _case(rng, 6, 9, 3, 64, 64, 4, jnp.dtype(dtype))
  got = {l2: jax.jit(lambda q, l2=l2: cpa.decode_attention(
      q[:, 0], k, v, table, pos, 1, 4 * 64, bf16_dot=True, prefetch_l2=l2))(q)
         for l2 in (False, True)}
  assert got[True].shape == (6, 9, 64)
  np.testing.assert_array_equal(np.asarray(got[False]), np.asarray(got[True]))


@needs_kernel
def test_an_f32_query_over_bf16_pages_is_not_rounded():
  """f32 activations over a bf16 pool (``--kv_dtype bfloat16``): the stored K / V are exact in
  f32, so the kernel must equal the gather path to f32 accuracy (the BF16 dot-product loops,
  which round the query, are for bf16 queries only)."""
  rng = np.random.default_rng(7)
  q, k, v, table, pos = _case(rng, 4, 4, 1, 64, 16, 4, jnp.dtype("bfloat16"))
  q = q.astype(jnp.float32) * 30.0  # large logits: a bf16-rounded query would miss by ~1e-2
  kv = PK.PagedKV(k_pages=k, v_pages=v, page_table=table, lengths=pos, backend=_kernel())
  ref = attention.attend(q, *kv.read(0, 64, jnp.float32), pos[:, None])
  got = jax.jit(kv.attend, static_argnums=(0, 3))(0, q, pos[:, None], 64)
  assert got.dtype == jnp.float32
  assert_close(got, ref, TOL["float32"])


@needs_kernel
def test_rows_past_max_keys_see_only_max_keys():
  """A row whose position is past ``max_keys`` attends to the first ``max_keys`` keys (what the
  gather path reads), never to the positions after them."""
  rng = np.random.default_rng(7)
  q, k, v, table, _ = _case(rng, 3, 4, 1, 16, 8, 4, jnp.float32)
  pos = jnp.asarray([31, 20, 12], jnp.int32)
  kv = PK.PagedKV(k_pages=k, v_pages=v, page_table=table, lengths=pos)
  q_BNH = (q[:, 0] * 16 ** -0.5)
  got = cpa.decode_attention(q_BNH, k, v, table, pos, 0, 12)
  ref = attention.attend(q, *kv.read(0, 12), jnp.full((3, 1), 11, jnp.int32))[:, 0]
  assert_close(got, ref, TOL["float32"])


@needs_kernel
def test_bad_shapes_are_refused():
  q = jnp.zeros((2, 3, 24), jnp.float32)  # head dim 24: not a multiple of 16
  pages = jnp.zeros((1, 4, 1, 8, 24), jnp.float32)
  assert not cpa.supported(3, 1, 24, jnp.float32)
  with pytest.raises(ValueError, match="unsupported shapes"):
    cpa.decode_attention(q, pages, pages, jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32),
                         0, 16)
  assert not cpa.supported(34, 2, 64, jnp.float32)  # 17 query heads per kv head
  assert not cpa.supported(4, 1, 64, jnp.float16)


@needs_kernel
@pytest.mark.parametrize("store,dtype", [("paged", "float32"), ("paged", "bfloat16"),
                                         ("paged", "int8"), ("contiguous", "float32"),
                                         ("contiguous", "bfloat16")])
def test_model_decode_through_the_kernel_equals_the_gather_path(store, dtype):
  """``small``-shaped heads (multiquery, 64-wide) on a two-layer model: decode logits with the
  kernel equal those with it switched off, at the model's own tolerance for the dtype (int8:
  an int8 pool under f32 params). ``contiguous``: ``KVCache`` read in place as one page per
  row."""
  cfg = get_preset("tiny").replace(num_heads=6, num_kv_heads=2, head_dim=32)
  dt = jnp.dtype(dtype)
  params = init_params(cfg, jax.random.key(1), jnp.float32 if dtype == "int8" else dt)
  rng = np.random.default_rng(3)
  z, m, b = 16, 4, 3
  table = jnp.asarray(rng.permutation(b * m + 2)[:b * m].reshape(b, m), jnp.int32)
  lens = jnp.asarray([37, 9, 50], jnp.int32)
  toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 64)), jnp.int32)
  nxt = toks[:, 0]

  def decode(backend):
    if store == "paged":
      kv = PK.init_paged(cfg, b, b * m + 2, z, m, dt, backend=backend).replace(page_table=table)
    else:
      kv = init_cache(cfg, b, z * m, dt, backend)
    _, kv = T.prefill(params, toks, kv, None, lens, cfg=cfg, attend_len=64, backend=backend)
    fn = jax.jit(lambda p, t, c: T.decode_step(p, t, c, cfg=cfg, attend_len=64, backend=backend))
    hlo = fn.lower(params, nxt, kv).as_text()
    return fn(params, nxt, kv)[0], "phaseserve_paged_decode" in hlo

  got, native = decode(_kernel())
  ref, native_off = decode(GATHER)
  assert native and not native_off
  assert_close(got, ref, {"float32": 1e-4, "bfloat16": 5e-2, "int8": 5e-2}[dtype])


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_a_chunk_of_queries_equals_the_gather_path(dtype):
  """Prefill (T > 1): row b's query t at ``start_b + t`` sees keys ``<= start_b + t`` (causal
  inside the chunk, whose keys are in the pool), each row through its own table; rows start
  at 0, mid-page and near the end; ``max_keys`` is the capacity, as the engine passes it."""
  rng = np.random.default_rng(11)
  b, t, n, kh, h, z, m = 3, 7, 9, 3, 64, 16, 4
  _, k, v, table, _ = _case(rng, b, n, kh, h, z, m, jnp.dtype(dtype))
  start = np.asarray([0, 21, m * z - t], np.int32)
  pos_BT = jnp.asarray(start[:, None] + np.arange(t)[None, :], jnp.int32)
  q_dtype = jnp.float32 if dtype == "int8" else jnp.dtype(dtype)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)) * 0.1, q_dtype)
  kv = PK.PagedKV(k_pages=k, v_pages=v, page_table=table, lengths=jnp.asarray(start),
                  backend=_kernel(bf16_dot=False))
  assert kv.native_attention(n, t)
  got = jax.jit(kv.attend, static_argnums=(0, 3))(1, q, pos_BT, m * z)
  ref = attention.attend(q, *kv.read(1, m * z), pos_BT)
  assert got.shape == ref.shape == (b, t, n, h) and got.dtype == ref.dtype
  assert_close(got, ref, TOL[dtype])


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_model_prefill_through_the_kernel_equals_the_gather_path(dtype):
  """A prompt fed as two chunks (the second continuing the first, rows of unequal length and
  padding) gives the same logits of every position with the kernel as with it switched off."""
  cfg = get_preset("tiny").replace(num_heads=6, num_kv_heads=2, head_dim=32)
  params = init_params(cfg, jax.random.key(2), jnp.float32)
  rng = np.random.default_rng(4)
  z, m, b = 16, 4, 3
  table = jnp.asarray(rng.permutation(b * m + 2)[:b * m].reshape(b, m), jnp.int32)
  toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 2, 24)), jnp.int32)
  lens = (jnp.asarray([24, 10, 24], jnp.int32), jnp.asarray([17, 0, 24], jnp.int32))

  def run(backend):
    kv = PK.init_paged(cfg, b, b * m + 2, z, m, jnp.dtype(dtype), backend=backend).replace(
        page_table=table)
    fn = jax.jit(lambda p, tk, c, n: T.prefill(p, tk, c, None, n, cfg=cfg, attend_len=m * z,
                                                all_logits=True, backend=backend))
    native = "phaseserve_paged_decode" in fn.lower(params, toks[:, 0], kv, lens[0]).as_text()
    out = []
    for i in range(2):
      logits, kv = fn(params, toks[:, i], kv, lens[i])
      out.append([np.asarray(logits[r, :int(lens[i][r])]) for r in range(b) if lens[i][r]])
    return out, native

  got, native = run(_kernel())
  ref, native_off = run(GATHER)
  assert native and not native_off
  for g, r in zip(got, ref):
    for gr, rr in zip(g, r):
      assert_close(gr, rr, {"float32": 1e-4, "int8": 5e-2}[dtype])
