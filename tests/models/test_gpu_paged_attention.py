"""models.gpu.paged_attention (the Pallas decode attention for GPUs) in Pallas's interpreter on
CPU, against the gather path (``PagedKV.attend`` with the XLA-only backend) and inside the engine.

Tolerances, relative to the reference's largest magnitude: f32 ``1e-5`` (the same f32 sums in
another order); bf16 pages and queries ``2e-2`` (the gather path rounds its products and output
to bf16 where the kernel keeps f32 until the end: bf16's step is 2^-8 = 0.4%).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import paged_kv as PK
from models.config import get_preset
from models.cpu.backend import CpuBackend
from models.gpu import paged_attention as G

B, P, Z, M = 5, 24, 8, 4  # rows, pool pages, page size, table width (32 positions)
# Interpreted on CPU (``make test``); compiled where a GPU runs the tests (launch/device_check.sh).
PALLAS = CpuBackend(pallas_attention="gpu", pallas_interpret=jax.default_backend() != "gpu")


def _pool(kv_heads: int, dtype, rng) -> PK.PagedKV:
  cfg = get_preset("tiny").replace(num_layers=2, num_heads=8, num_kv_heads=kv_heads)
  kv = PK.init_paged(cfg, B, P, Z, M, dtype)
  pages = lambda: jnp.asarray(rng.standard_normal(kv.k_pages.shape), dtype)  # noqa: E731
  # Ragged rows over scattered pages; null entries (P and -1) past and inside a row's pages;
  # row 2 uses the whole table.
  table = np.array([[3, 7, P, P], [11, -1, P, P], [1, 2, 4, 5], [20, 9, 13, P], [P] * 4])
  return kv.replace(k_pages=pages(), v_pages=pages(), page_table=jnp.asarray(table, jnp.int32))


@pytest.mark.parametrize("kv_heads", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_the_kernel_equals_the_gather_path(kv_heads, dtype):
  rng = np.random.default_rng(kv_heads)
  kv = _pool(kv_heads, dtype, rng)
  # One-token context (row 0 at position 0), a null page inside the context (row 1 at 12), the
  # full table (row 2 at 31), a partial last page (row 3), and a row whose pages are all null.
  pos_B1 = jnp.asarray([[0], [12], [31], [20], [5]], jnp.int32)
  q = jnp.asarray(rng.standard_normal((B, 1, 8, 16)), dtype)
  # A reused page's stale values past each row's end: NaN and Inf must not reach the output.
  end = np.asarray(pos_B1)[:, 0] + 1
  k, v = np.array(kv.k_pages.astype(jnp.float32)), np.array(kv.v_pages.astype(jnp.float32))
  table = np.asarray(kv.page_table)
  for b in range(B):
    for s in range(end[b], M * Z):
      page = table[b, s // Z]
      if 0 <= page < P:
        k[:, page, :, s % Z] = np.nan
        v[:, page, :, s % Z] = np.inf
  stale = kv.replace(k_pages=jnp.asarray(k, dtype), v_pages=jnp.asarray(v, dtype))
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  for layer in (0, 1):
    want = np.asarray(kv.attend(layer, q, pos_B1, M * Z), np.float32)
    got = np.asarray(stale.replace(backend=PALLAS).attend(layer, q, pos_B1, M * Z), np.float32)
    assert np.isfinite(got).all()
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)
  # A shorter attended length bounds the keys (as the gather path's read does).
  want = np.asarray(kv.attend(1, q, jnp.minimum(pos_B1, 15), 16), np.float32)
  got = np.asarray(kv.replace(backend=PALLAS).attend(1, q, pos_B1, 16), np.float32)
  np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(1.0, float(np.abs(want).max())))


def test_a_row_that_sees_no_key_gets_zeros_and_layer_may_be_traced():
  rng = np.random.default_rng(3)
  kv = _pool(2, jnp.float32, rng)
  q = jnp.asarray(rng.standard_normal((B, 8, 16)), jnp.float32)
  end = jnp.asarray([0, -1, 32, 9, 3], jnp.int32)
  at = jax.jit(lambda layer: G.decode_attention(q, kv.k_pages, kv.v_pages, kv.page_table, end,
                                                layer, interpret=PALLAS.pallas_interpret))
  out = np.asarray(at(jnp.int32(1)))
  assert not out[:2].any() and np.abs(out[2]).max() > 0
  np.testing.assert_array_equal(out, np.asarray(at(1)))
  assert G.supported(kv.k_pages) and not G.supported(jnp.zeros((1,), jnp.int8))


def _slow_when_interpreted(fn):
  """Interpreted, an engine's run takes 15 s of the CPU suite (`make test-slow` there); compiled
  on a GPU it is fast and runs with the rest (launch/device_check.sh)."""
  return pytest.mark.slow(fn) if PALLAS.pallas_interpret else fn


@_slow_when_interpreted
def test_the_engine_decodes_through_the_kernel_with_the_same_greedy_tokens():
  """The serving engine on ``tiny`` (GQA made: 8 query heads over 2 kv heads) with the GPU
  backend's decode attention, interpreted: the same greedy ids as the XLA-only engine."""
  from models.step import UnshardedStep
  from models.text.tokenizer import ByteTokenizer
  from models.weights import init_params
  from serving.engine import Engine, EngineConfig
  from serving.kv_pages import PageBudget, PagePool
  from serving.request import Request
  from serving.sampling import SamplingParams
  from serving.scheduler import Scheduler
  from serving.stop import StopCriteria
  from tests.sched_steps import serve_all

  cfg = get_preset("tiny").replace(num_heads=8, num_kv_heads=2, vocab_size=256, max_seq_len=64)
  params = init_params(cfg, jax.random.key(0), jnp.float32)
  rng = np.random.default_rng(1)
  reqs = [Request(f"r{i}", tuple(int(t) for t in rng.integers(0, 256, int(rng.integers(2, 30)))),
                  SamplingParams(), StopCriteria(max_tokens=8, ignore_eos=True))
          for i in range(5)]

  def serve(backend: CpuBackend) -> dict[str, list[int]]:
    pool = PagePool(PageBudget(8, 48), max_seq_tokens=cfg.max_seq_len)
    sched = Scheduler(pool, ByteTokenizer(), max_slots=4, max_step_tokens=48, max_chunk=16)
    engine = Engine(UnshardedStep(cfg, backend=backend), params,
                    EngineConfig(max_slots=4, num_pages=48, page_size=8,
                                 max_seq_tokens=cfg.max_seq_len))
    return serve_all(sched, engine, reqs)

  want = serve(CpuBackend())
  assert serve(PALLAS) == want
  assert all(len(ids) == 8 for ids in want.values())
