"""The native multi-LoRA kernel (``models.cpu.kernels.lora_group``) against the dense XLA form of
``models.lora`` (every slot's product, masked to the row's slot), in float64 as the reference.

Cases: rows 1 to 21 (blocks of 8 and a remainder), rows without an adapter (-1) or of a slot out
of range (zeros), ranks 16 and 32, outputs with a tail of fewer than 16 columns, bf16 and f32.
Tolerance: f32 sums of ``I`` products of O(1 / sqrt(I)) terms: |diff| <= 1e-5 + 1e-5 |ref|
(f32); bf16 inputs are exact in f32, so the same bound holds against the reference computed
from the bf16 values. A control: the kernel's result for a row differs from another slot's.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from models.cpu import kernels

pytestmark = pytest.mark.skipif(not (kernels.available() and kernels.lora_available()),
                                reason="needs AVX-512 F/BW/VL/DQ and a C++ compiler")


def _reference(x, slot, a, b, slots):
  x, a, b = (np.asarray(v, np.float64) for v in (x, a, b))
  e = a.shape[1] // slots
  out = np.zeros((x.shape[0], b.shape[1]))
  for m, s in enumerate(slot):
    if 0 <= s < slots:
      out[m] = (x[m] @ a[:, s * e:(s + 1) * e]) @ b[s * e:(s + 1) * e]
  return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows,rank,outs", [(1, 16, (48,)), (8, 16, (40, 96)),
                                            (21, 32, (16, 37, 64))])
def test_kernel_equals_the_reference(dtype, rows, rank, outs):
  rng = np.random.default_rng(rows + rank)
  slots, i = 4, 72
  x = jnp.asarray(rng.standard_normal((rows, i)), dtype)
  slot = jnp.asarray(rng.integers(-1, slots + 1, rows), jnp.int32)  # -1 and `slots`: none
  layers, layer = 3, 1  # the stacked weights, read at one layer
  pairs = [(jnp.asarray(rng.standard_normal((layers, i, slots * rank)) / np.sqrt(i), dtype),
            jnp.asarray(rng.standard_normal((layers, slots * rank, o)) / np.sqrt(rank), dtype))
           for o in outs]
  got = kernels.lora_group(x, slot, jnp.int32(layer), pairs, slots)
  pairs = [(a[layer], b[layer]) for a, b in pairs]
  for (a, b), y in zip(pairs, got):
    want = _reference(x.astype(jnp.float32), np.asarray(slot), a.astype(jnp.float32),
                      b.astype(jnp.float32), slots)
    assert y.shape == want.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
  none = (np.asarray(slot) < 0) | (np.asarray(slot) >= slots)
  assert not np.asarray(got[0])[none].any()
  live = np.flatnonzero(~none)
  if len(live):  # the control: another slot's weights give another row
    m = live[0]
    other = np.asarray(slot).copy()
    other[m] = (other[m] + 1) % slots
    a, b = pairs[0]
    wrong = _reference(x.astype(jnp.float32), other, a.astype(jnp.float32),
                       b.astype(jnp.float32), slots)
    assert np.abs(np.asarray(got[0])[m] - wrong[m]).max() > 1e-2
