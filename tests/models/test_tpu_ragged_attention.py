"""models.tpu.ragged_attention: the engine's ragged batch through JAX's TPU ragged paged
attention. The kernel itself runs on TPU only (JAX 0.12.1's TPU interpreter cannot run it: the
first test pins the exact failure, so a JAX that fixes it shows up here); the mapping is checked
with the kernel's own reference function against the engine's gather path (``PagedKV.attend``).

Tolerances, relative to the reference's largest magnitude: f32 ``1e-5``; bf16 ``2e-2`` (both
round to bf16 at different points; bf16's step is 2^-8).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

from models import paged_kv as PK
from models.config import get_preset
from models.tpu import ragged_attention as R

B, T, P, Z, M = 5, 8, 24, 8, 4  # rows, chunk width, pool pages, page size, table width


def _case(kv_heads: int, dtype, seed: int = 0):
  rng = np.random.default_rng(seed)
  cfg = get_preset("tiny").replace(num_layers=2, num_heads=8, num_kv_heads=kv_heads)
  kv = PK.init_paged(cfg, B, P, Z, M, dtype)
  pages = lambda: jnp.asarray(rng.standard_normal(kv.k_pages.shape), dtype)  # noqa: E731
  table = np.array([[3, 7, P, P], [11, 12, 14, P], [1, 2, 4, 5], [20, 9, 13, P], [6, P, P, P]])
  kv = kv.replace(k_pages=pages(), v_pages=pages(), page_table=jnp.asarray(table, jnp.int32))
  # A mixed step: a first chunk of 5 (row 0), a chunk of 8 continuing at 9 (row 1), a decode
  # row at 31 (the full table), an idle row (nothing written), a one-token prompt (row 4).
  start = np.array([0, 9, 31, 20, 0])
  n_new = np.array([5, 8, 1, 0, 1])
  pos_BT = jnp.asarray(start[:, None] + np.arange(T)[None], jnp.int32)
  end_B = jnp.asarray(np.where(n_new > 0, start + n_new, start), jnp.int32)
  q = jnp.asarray(rng.standard_normal((B, T, 8, 16)), dtype)
  return kv, q, pos_BT, end_B, n_new


def test_the_tpu_interpreter_cannot_run_the_kernel_in_this_jax():
  """At the kernel's own shapes (head_dim 128: it tiles heads by TPU lanes; at 16 it fails an
  assertion before running), interpreted on CPU."""
  rng = np.random.default_rng(0)
  f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  args = (f32(16, 4, 128), f32(16, 16, 2, 128), jnp.array([20, 1, 40, 0], jnp.int32),
          jnp.array([[1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 6, 0], [0, 0, 0, 0]], jnp.int32),
          jnp.array([0, 5, 6, 14, 14], jnp.int32), jnp.array([3], jnp.int32))
  assert rpa.ref_ragged_paged_attention(*args).shape == (14, 4, 128)  # the reference runs
  with pytest.raises(Exception, match="'ReshapeTransform' object has no attribute 'indices'"):
    with pltpu.force_tpu_interpret_mode():
      np.asarray(rpa.ragged_paged_attention(*args, num_kv_pages_per_block=2,
                                            num_queries_per_block=8))


@pytest.mark.parametrize("kv_heads", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_the_mapping_through_the_kernels_reference_equals_the_gather_path(kv_heads, dtype):
  kv, q, pos_BT, end_B, n_new = _case(kv_heads, dtype, kv_heads)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  for layer in (0, 1):
    r = R.pack(q, pos_BT, end_B, kv.k_pages[layer], kv.v_pages[layer], kv.page_table)
    assert r.cu_q_lens.tolist() == [0, 5, 13, 14, 14, 15] and r.num_seqs.tolist() == [B]
    out = rpa.ref_ragged_paged_attention(*r.args(), sm_scale=16 ** -0.5)
    got = np.asarray(R.unpack(out, r, T), np.float32)
    want = np.asarray(kv.attend(layer, q, pos_BT, M * Z, end_B), np.float32)
    real = np.arange(T)[None, :] < n_new[:, None]
    scale = max(1.0, float(np.abs(want[real]).max()))
    np.testing.assert_allclose(got[real], want[real], rtol=0, atol=tol * scale)
    assert not got[~real].any()  # padding and the idle row: zeros
