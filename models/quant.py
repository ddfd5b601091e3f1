"""int8 weights: ``QuantArray`` and the one einsum every matmul goes through.

Contract:
  * ``QuantArray(quant, scale, act_quant)``: symmetric int8 values and float32 scales per output
    channel (``scale`` has the weight's shape with every contracted axis set to 1).
    ``act_quant`` (static): ``False`` dequantizes inside the dot (weight-only int8); ``True``
    also quantizes activations per token and runs an int8 x int8 -> int32 dot (W8A8).
  * ``quantize_array(w, contract_axes, act_quant)``: max |w| over the contracted axes -> 127.
  * ``einsum(spec, x, w, backend)``: ``jnp.einsum`` of an activation and a float or
    ``QuantArray`` weight, f32 accumulation, result in ``x.dtype``; models call nothing else for
    matmuls. A plain matmul goes to ``models.cpu.router`` under ``backend`` (a static
    ``models.cpu.backend.CpuBackend``; the default: XLA's dots only); any other einsum is
    lowered directly. ``einsums(specs, x, ws, backend)``: the list, grouped where the router can.
  * ``take_rows(table, ids, dtype)``: an embedding lookup in a float or int8 table.
  * ``TiledArray(array, tiles)``: a bf16 or int8 weight and its copy in a tiled decode
    kernel's layout (``tile_array(w, contract_axes)``; int8: the values, the scales stay in
    ``array``; W8A8 weights in the VNNI kernel's quads); the router reads ``tiles`` for the rows
    that kernel takes and ``array`` for everything else, so results do not depend on which copy
    was read beyond summation order (W8A8: beyond the activations' rounding).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.cpu import kernels as cpu_kernels, router
from models.cpu.backend import CpuBackend
from models.cpu.lowering import quantize_activations


@flax.struct.dataclass
class QuantArray:
  quant: jax.Array  # int8, the weight's shape
  scale: jax.Array  # float32, the weight's shape with contracted axes = 1
  act_quant: bool = flax.struct.field(pytree_node=False, default=False)

  if TYPE_CHECKING:  # flax.struct.dataclass adds it at run time; declared for the type checker
    def replace(self, **fields: Any) -> QuantArray: ...

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.quant.shape)

  @property
  def ndim(self) -> int:
    return self.quant.ndim

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    return (self.quant.astype(jnp.float32) * self.scale).astype(dtype)


@flax.struct.dataclass
class TiledArray:
  array: jax.Array | QuantArray  # the weight as stored: bf16, or int8
  tiles: jax.Array  # the tiled kernel's copy of the (int8) weight as [K, N], contracted first

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.array.shape)

  @property
  def ndim(self) -> int:
    return self.array.ndim


Stored = jax.Array | QuantArray  # a weight as stored (what every path but the tiled one reads)
Weight = Stored | TiledArray


def tile_array(w: jax.Array | QuantArray, contract_axes: Sequence[int], quads: bool = False
               ) -> TiledArray:
  """``w`` (bf16, or int8) with its tiled copy: the contracted axes first, as ``[K, N]``
  (W8A8 weights: ``tile_weight_w8a8``'s biased quads; weight-only int8 with ``quads``:
  ``tile_weight_quads``' for AMX's int8 products; else ``tile_weight``'s pairs)."""
  values = w.quant if isinstance(w, QuantArray) else w
  free = [a for a in range(w.ndim) if a not in contract_axes]
  k = math.prod(w.shape[a] for a in contract_axes)
  w_KN = jnp.transpose(values, (*contract_axes, *free)).reshape(k, -1)
  if isinstance(w, QuantArray) and w.act_quant:
    return TiledArray(array=w, tiles=cpu_kernels.tile_weight_w8a8(w_KN))
  if isinstance(w, QuantArray) and quads:
    return TiledArray(array=w, tiles=cpu_kernels.tile_weight_quads(w_KN))
  return TiledArray(array=w, tiles=cpu_kernels.tile_weight(w_KN))


def stored(w: Weight) -> Stored:
  """The weight as stored (a ``TiledArray``'s ``array``)."""
  return w.array if isinstance(w, TiledArray) else w

INV_127 = np.float32(1.0) / np.float32(127.0)  # the f32 nearest 1 / 127


def quantize_array(w: jax.Array, contract_axes: Sequence[int], act_quant: bool = False
                   ) -> QuantArray:
  """Symmetric per-output-channel int8: max |w| over the contracted axes maps to 127."""
  # Written as multiplications by reciprocals, not divisions: XLA may or may not rewrite a
  # division by a constant or a broadcast that way (eager and jitted programs differed in jax
  # 0.12.1), and the host loader (models.io.hf_import) must reproduce these values bit for bit.
  w32 = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w32), axis=tuple(contract_axes), keepdims=True)
  scale = jnp.where(amax > 0, amax * INV_127, jnp.float32(1.0))
  quant = jnp.clip(jnp.round(w32 * (jnp.float32(1.0) / scale)), -127, 127).astype(jnp.int8)
  return QuantArray(quant=quant, scale=scale.astype(jnp.float32), act_quant=act_quant)


def _parse(spec: str) -> tuple[str, str, str]:
  inputs, out = spec.replace(" ", "").split("->")
  x_letters, w_letters = inputs.split(",")
  return x_letters, w_letters, out


def _to_output(a: jax.Array, letters: str, out: str) -> jax.Array:
  """Lays ``a`` (axes named by ``letters``; axes absent from ``out`` have size 1) out for
  broadcasting against an einsum result named by ``out``."""
  kept = [c for c in letters if c in out]
  a = a.reshape([a.shape[i] for i, c in enumerate(letters) if c in out])
  order = sorted(range(len(kept)), key=lambda i: out.index(kept[i]))
  a = jnp.transpose(a, order)
  kept_sorted = [kept[i] for i in order]
  shape = [a.shape[kept_sorted.index(c)] if c in kept_sorted else 1 for c in out]
  return a.reshape(shape)


def einsum(spec: str, x: jax.Array, w: Weight, backend: CpuBackend = CpuBackend()
           ) -> jax.Array:
  """``jnp.einsum(spec, x, w)`` with f32 accumulation; result in ``x.dtype``. ``x`` is the
  activation, ``w`` the weight; ``backend`` (static) how XLA:CPU computes it."""
  mm = router.as_matmul(*_parse(spec), x, w)
  return (_einsum_generic(spec, x, w) if mm is None
          else router.matmul(mm, x.dtype, w, backend))


def einsums(specs: Sequence[str], x: jax.Array, ws: Sequence[Weight],
            backend: CpuBackend = CpuBackend()) -> list[jax.Array]:
  """``[einsum(spec, x, w, backend) ...]`` for weights that share the activation (q / k / v,
  gate / up): on XLA:CPU decode rows, one grouped native call where the router can."""
  if len(specs) != len(ws):
    raise ValueError(f"einsums: {len(specs)} specs for {len(ws)} weights")
  mms = [router.as_matmul(*_parse(spec), x, w) for spec, w in zip(specs, ws)]
  if all(mm is not None for mm in mms):
    ys = router.matmul_group(mms, x.dtype, ws, backend)  # type: ignore[arg-type]  # the weights matched Weight above
    if ys is not None:
      return ys
  return [einsum(spec, x, w, backend) for spec, w in zip(specs, ws)]


def _einsum_generic(spec: str, x: jax.Array, w: Weight) -> jax.Array:
  """Any einsum (batch axes, odd weight layouts): the straightforward lowering."""
  w = stored(w)
  if not isinstance(w, QuantArray):
    return jnp.einsum(spec, x, w.astype(x.dtype),
                      preferred_element_type=jnp.float32).astype(x.dtype)
  x_letters, w_letters, out = _parse(spec)
  w_scale = _to_output(w.scale, w_letters, out)
  if not w.act_quant:
    y = jnp.einsum(spec, x, w.quant.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * w_scale).astype(x.dtype)
  contracted = tuple(i for i, c in enumerate(x_letters) if c not in out)
  xq, x_scale = quantize_activations(x.astype(jnp.float32), contracted)
  y = jnp.einsum(spec, xq, w.quant, preferred_element_type=jnp.int32).astype(jnp.float32)
  return (y * _to_output(x_scale, x_letters, out) * w_scale).astype(x.dtype)


def take_rows(table: Weight, ids: jax.Array, dtype) -> jax.Array:
  """Embedding lookup ``table[ids]`` for a float or int8 ``[V, D]`` table."""
  table = stored(table)
  if isinstance(table, QuantArray):
    return (table.quant[ids].astype(jnp.float32) * table.scale[ids]).astype(dtype)
  return table[ids].astype(dtype)
