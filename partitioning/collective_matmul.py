"""The paper's looped collective einsum (Sec. 3.5): an all-gather before an einsum, or a
reduce-scatter after one, as n partial einsums with n - 1 ``ppermute`` steps between them, so that
each step's transfer can run under the next step's matmul instead of before or after all of it.

Contract (inside ``shard_map`` over the ``('x', 'y', 'z')`` mesh, as ``partitioning.comm``; n is
the size of ``axes``, chip i its linear index over them; ``axes == ()``: the plain einsum):
  * ``ag_einsums(specs, x, ws, axes, backend)``: ``[einsum(spec, AG(x), w)]`` where ``x``'s last
    dimension is the chunk over ``axes`` of a dimension every ``w`` contracts on its first: chunk
    j meets rows ``[j c, (j + 1) c)`` of each ``w``. The chunks travel the ring (chip k sends to
    k - 1), so after s steps chip i holds chunk ``(i + s) % n``; the sums are f32.
  * ``einsums_rs(specs, xs, ws, axes, backend)``: ``RS(sum of einsum(spec, x, w))`` over
    ``axes`` along the result's last dimension (the columns of each ``w``'s last): at step s
    chip i computes columns chunk ``(i + s + 1) % n`` of every einsum, adds the running sum from
    chip i + 1 and passes it on; after n steps it holds the sum of its own chunk i.
  * Weights may be ``models.quant.QuantArray`` (rows or columns sliced with their scales).
Numerics: the same products summed in another order (f32 accumulation).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from models import quant
from models.cpu.backend import CpuBackend
from models.quant import QuantArray
from partitioning import comm
from partitioning.comm import Axes


def _slice(w, dim: int, start: jax.Array, size: int):
  """``w``'s ``[start, start + size)`` along ``dim`` (a QuantArray's scale too, unless its
  ``dim`` is a contracted 1)."""
  if isinstance(w, QuantArray):
    scale = w.scale if w.scale.shape[dim] == 1 else \
        lax.dynamic_slice_in_dim(w.scale, start, size, axis=dim)
    return w.replace(quant=lax.dynamic_slice_in_dim(w.quant, start, size, axis=dim),
                     scale=scale)
  return lax.dynamic_slice_in_dim(w, start, size, axis=dim)


def _ring(n: int) -> list[tuple[int, int]]:
  return [(k, (k - 1) % n) for k in range(n)]  # chip k sends to k - 1


def ag_einsums(specs: Sequence[str], x: jax.Array, ws: Sequence, axes: Axes,
               backend: CpuBackend = CpuBackend()) -> list[jax.Array]:
  if not axes:
    return quant.einsums(specs, x, ws, backend)
  n, i = comm.axis_size(axes), comm.linear_index(axes)
  c = x.shape[-1]
  accs = None
  cur = x
  for s in range(n):
    j = (i + s) % n
    parts = [quant.einsum(spec, cur, _slice(w, 0, j * c, c), backend).astype(jnp.float32)
             for spec, w in zip(specs, ws)]
    accs = parts if accs is None else [a + p for a, p in zip(accs, parts)]
    if s < n - 1:
      cur = lax.ppermute(cur, comm.axis_name(axes), _ring(n))
  assert accs is not None
  return [a.astype(x.dtype) for a in accs]


def einsums_rs(specs: Sequence[str], xs: Sequence[jax.Array], ws: Sequence, axes: Axes,
               backend: CpuBackend = CpuBackend()) -> jax.Array:
  def columns(k, n: int) -> jax.Array:  # column chunk k of n of every einsum, summed in f32
    out = jnp.zeros((), jnp.float32)
    for spec, x, w in zip(specs, xs, ws):
      c = w.shape[-1] // n
      out = out + quant.einsum(spec, x, _slice(w, w.ndim - 1, k * c, c), backend).astype(
          jnp.float32)
    return out

  dtype = xs[0].dtype
  if not axes:
    return columns(0, 1).astype(dtype)
  n, i = comm.axis_size(axes), comm.linear_index(axes)
  acc = columns((i + 1) % n, n)
  for s in range(1, n):
    acc = lax.ppermute(acc, comm.axis_name(axes), _ring(n)) + columns((i + s + 1) % n, n)
  return acc.astype(dtype)


__all__ = ["ag_einsums", "einsums_rs"]
