"""Collective plumbing inside ``shard_map``: moving one array dimension between shardings.

Contract: every function runs on a chip's local block inside ``shard_map`` over the
``('x', 'y', 'z')`` mesh. ``axes`` tuples list mesh axes major to minor (the order of a
``PartitionSpec`` entry); ``()`` makes a function the identity, so one code path serves every
layout and every fallback.
  * ``linear_index(axes)``: this chip's chunk index over ``axes``.
  * ``reshard(x, dim, src, dst)``: ``dim`` sharded over ``src`` -> over ``dst`` (common prefix
    kept, the rest of ``src`` all-gathered, the rest of ``dst`` sliced locally).
  * ``reduce(x, dim, unreduced, src, dst)``: sums partial sums over ``unreduced`` and moves ``dim``
    from ``src`` to ``dst``: one reduce-scatter when ``dst == src + unreduced``, else an
    all-reduce and ``reshard``.
  * ``gather_weight(w, dim, src, dst, permute)``: the weight-gathered layouts' all-gather
    (``permute=True``: only the dropped axes, in a permuted order, for mlp and heads).
  * ``all_to_all(x, axes, split, concat)``: tiled all-to-all (heads <-> batch for attention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Axes = tuple[str, ...]


def axis_name(axes: Axes):
  """The axis name a collective over ``axes`` takes (one name, or the tuple)."""
  return axes[0] if len(axes) == 1 else tuple(axes)


def axis_size(axes: Axes) -> int:
  n = 1
  for a in axes:
    n *= lax.axis_size(a) if hasattr(lax, "axis_size") else lax.psum(1, a)
  return n


def linear_index(axes: Axes) -> jax.Array:
  idx = jnp.zeros((), jnp.int32)
  for a in axes:
    idx = idx * axis_size((a,)) + lax.axis_index(a)
  return idx


def slice_chunk(x: jax.Array, dim: int, axes: Axes) -> jax.Array:
  """This chip's chunk of ``dim`` when ``dim`` is split over ``axes`` (local, no traffic)."""
  if not axes:
    return x
  n = x.shape[dim] // axis_size(axes)
  return lax.dynamic_slice_in_dim(x, linear_index(axes) * n, n, axis=dim)


def psum(x: jax.Array, axes: Axes) -> jax.Array:
  return lax.psum(x, axis_name(axes)) if axes else x


def all_gather(x: jax.Array, dim: int, axes: Axes) -> jax.Array:
  return lax.all_gather(x, axis_name(axes), axis=dim, tiled=True) if axes else x


def _common_prefix(a: Axes, b: Axes) -> int:
  p = 0
  while p < min(len(a), len(b)) and a[p] == b[p]:
    p += 1
  return p


def reshard(x: jax.Array, dim: int, src: Axes, dst: Axes) -> jax.Array:
  p = _common_prefix(src, dst)
  return slice_chunk(all_gather(x, dim, tuple(src[p:])), dim, tuple(dst[p:]))


def reduce(x: jax.Array, dim: int, unreduced: Axes, src: Axes, dst: Axes) -> jax.Array:
  if unreduced and tuple(dst) == tuple(src) + tuple(unreduced):
    return lax.psum_scatter(x, axis_name(unreduced), scatter_dimension=dim, tiled=True)
  return reshard(psum(x, unreduced), dim, src, dst)


def gather_weight(w: jax.Array, dim: int, src: Axes, dst: Axes, permute: bool) -> jax.Array:
  if tuple(src) == tuple(dst):
    return w
  if permute and all(a in src for a in dst):
    return all_gather(w, dim, tuple(a for a in src if a not in dst))
  return reshard(w, dim, src, dst)


def all_to_all(x: jax.Array, axes: Axes, split: int, concat: int) -> jax.Array:
  if not axes:
    return x
  return lax.all_to_all(x, axis_name(axes), split, concat, tiled=True)


__all__ = ["linear_index", "slice_chunk", "psum", "all_gather", "reshard", "reduce",
           "gather_weight", "all_to_all", "axis_size", "axis_name"]
