"""The XLA:CPU router of ``models.quant.einsum``: which kernel computes a matmul under a
``models.cpu.backend.CpuBackend``, and how.

Contract:
  * ``as_matmul(x_letters, w_letters, out, x, w) -> Matmul | None``: the einsum as ONE 2D
    product ``x2 [M, K]`` times the weight reshaped (never transposed) to ``[K, N]`` or
    ``[N, K]`` (contracted weight axes leading or trailing); None for any other einsum.
  * ``matmul(mm, x_dtype, w, backend)``: the einsum's result (dtype ``x_dtype``): a native
    kernel of ``models.cpu.kernels`` where the backend allows it and its policy's row limits
    say so (AMX, AVX512-BF16, float, weight-only int8, W8A8), else XLA's dot lowered as the
    policy says (bf16 / int8 row padding, the prefill dot lowering). Results are the plain
    einsum's up to summation order (W8A8: bit-identical).
  * ``matmul_group(mms, x_dtype, ws, backend)``: the products of one activation with several
    weights in one native call (same kernel, one stored dtype), else None.
  * A ``quant.TiledArray`` weight goes to the tiled kernel (``kernels.matmul_tiled_group``) for
    bf16 activations with rows in the policy's ``tiled_min_rows..tiled_max_rows`` (int8:
    ``tiled_int8_*``), or, with W8A8 tiles, to ``kernels.matmul_tiled_w8a8_group`` for bf16 or
    f32 activations with rows in ``tiled_w8a8_*`` (the integer sums are exact: the W8A8 result
    up to the activations' rounding); with AMX, bf16 tiles go to
    ``kernels.matmul_amx_tiled_group`` for rows in ``amx_tiled_*`` and a weight-only int8
    weight's quad tiles to ``kernels.matmul_amx_w8_group`` for rows in ``amx_w8_*`` (the
    activations quantized to 16 bits a row); otherwise its stored ``array`` takes the path
    above.
Off XLA:CPU every product is XLA's plain dot with f32 accumulation.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from models import quant
from models.cpu import kernels as cpu_kernels, lowering as cpu_lowering
from models.cpu.backend import CpuBackend


def _matmul_plan(x_letters: str, w_letters: str, out: str):
  """(contracted letters in weight order, weight-is-[K, N]) when ``spec`` is a plain matmul whose
  contracted weight axes are a leading or trailing block; else None (generic einsum)."""
  contract = [c for c in w_letters if c in x_letters and c not in out]
  free_w = [c for c in w_letters if c not in contract]
  free_x = [c for c in x_letters if c not in contract]
  if (not contract or any(c not in out for c in free_w + free_x)
      or len(set(x_letters)) != len(x_letters) or len(set(w_letters)) != len(w_letters)
      or any(c in x_letters for c in free_w) or sorted(out) != sorted(free_x + free_w)):
    return None
  nc = len(contract)
  if list(w_letters[:nc]) == contract:
    return "".join(contract), True
  if list(w_letters[-nc:]) == contract:
    return "".join(contract), False
  return None


def _on_cpu() -> bool:
  # The backend the computation is being traced for; jit on CPU is what the policy is for.
  return jax.default_backend() == "cpu"


class Matmul(NamedTuple):
  """An einsum that is one 2D matmul: the activation as ``x2 [M, K]``, the weight read as
  ``[K, N]`` (``w_kn``) or ``[N, K]``, and how ``[M, N]`` becomes the einsum's output."""
  x2: jax.Array
  x_perm: tuple[int, ...]  # x's axes in [M..., K...] order (what x2 is a reshape of)
  w_kn: bool
  m: int
  k: int
  n: int
  y_shape: tuple[int, ...]  # the free activation axes, then the free weight axes
  y_perm: tuple[int, ...] | None  # then this transpose into the output's order (None: none)


def as_matmul(x_letters: str, w_letters: str, out: str, x: jax.Array, w: quant.Weight
              ) -> Matmul | None:
  plan = _matmul_plan(x_letters, w_letters, out)
  if plan is None:
    return None
  contract, w_kn = plan
  free_x = [c for c in x_letters if c not in contract]
  free_w = [c for c in w_letters if c not in contract]
  sizes = dict(zip(x_letters, x.shape))
  sizes.update(zip(w_letters, w.shape))
  k = math.prod(sizes[c] for c in contract)
  n = math.prod(sizes[c] for c in free_w)
  m = math.prod(sizes[c] for c in free_x)
  # Activation -> [M, K] (a bitcast when its contracted axes are already trailing, in order).
  perm = [x_letters.index(c) for c in free_x + list(contract)]
  x2 = (x if perm == sorted(perm) else jnp.transpose(x, perm)).reshape(m, k)
  got = "".join(free_x + free_w)
  y_perm = None if got == out else tuple(got.index(c) for c in out)
  return Matmul(x2, tuple(perm), w_kn, m, k, n, tuple(sizes[c] for c in got), y_perm)


def _finish(mm: Matmul, y2: jax.Array, dtype) -> jax.Array:
  y = y2.astype(dtype).reshape(mm.y_shape)
  return y if mm.y_perm is None else jnp.transpose(y, mm.y_perm)


def _weight_2d(mm: Matmul, w: jax.Array) -> jax.Array:
  """The weight as ``[K, N]`` or ``[N, K]``: a reshape of contiguous axes, never a transpose."""
  return w.reshape((mm.k, mm.n) if mm.w_kn else (mm.n, mm.k))


def _native_kernel(mm: Matmul, x_dtype, w: quant.Stored, be: CpuBackend) -> str | None:
  """Which ``models.cpu.kernels`` kernel computes this product on XLA:CPU under ``be``:
  ``amx`` / ``amx_nk`` (bf16 activations, see ``_amx_rows``), ``dpbf16`` / ``dpbf16_nk``
  (``_dpbf16_rows``), ``float`` / ``float_nk`` (float or weight-only int8 weights), ``w8a8`` /
  ``w8a8_nk``, or None (XLA's dot)."""
  if not _on_cpu():
    return None
  if _amx_rows(mm, x_dtype, w, be):
    return "amx" if mm.w_kn else "amx_nk"
  if _dpbf16_rows(mm, x_dtype, w, be):
    return "dpbf16" if mm.w_kn else "dpbf16_nk"
  layout = "" if mm.w_kn else "_nk"
  if isinstance(w, quant.QuantArray):
    max_rows = be.policy.int8_native_max_rows if mm.w_kn else be.policy.int8_nk_native_max_rows
    if mm.m > max_rows or not be.matmul_kernels:
      return None
    return ("w8a8" if w.act_quant else "float") + layout
  # The native kernel multiplies in f32: exact for w's own dtype when the einsum would compute
  # in w's dtype anyway (x.dtype == w.dtype) or cast w up to f32 (x is f32).
  f32 = w.dtype == jnp.dtype(jnp.float32)
  native_rows = be.policy.f32_native_max_rows if f32 else be.policy.float_native_max_rows
  if ((mm.w_kn or not f32) and mm.m <= native_rows
      and (not f32 or mm.m >= be.policy.f32_native_min_rows)
      and w.dtype in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
      and (x_dtype == w.dtype or x_dtype == jnp.float32) and be.matmul_kernels):
    return "float" + layout
  return None


def _amx_rows(mm: Matmul, x_dtype, w: quant.Stored, be: CpuBackend) -> bool:
  """Whether the AMX kernel computes this product: bf16 activations, a ``[K, N]`` bf16 or
  weight-only int8 weight, and a row count in the policy's range for that weight. An ``[N, K]``
  weight (the tied unembedding): bf16 with the rows in the policy's ``amx_nk`` range (raced at
  start-up), or weight-only int8 past the native kernel's rows, where the alternative converts
  the whole table for XLA's dot on every call (measured ~10x slower than AMX on the Xeon)."""
  if x_dtype != jnp.bfloat16:
    return False
  p = be.policy
  if not mm.w_kn:
    if isinstance(w, quant.QuantArray):
      return (not w.act_quant and be.amx
              and p.int8_nk_native_max_rows < mm.m <= p.amx_int8_max_rows)
    return (be.amx and w.dtype == jnp.dtype(jnp.bfloat16)
            and p.amx_nk_min_rows <= mm.m <= p.amx_nk_max_rows and p.amx_nk_max_rows > 0)
  return be.amx and _in_range(mm, w, (p.amx_min_rows, p.amx_max_rows),
                              (p.amx_int8_min_rows, p.amx_int8_max_rows))


def _dpbf16_rows(mm: Matmul, x_dtype, w: quant.Stored, be: CpuBackend) -> bool:
  """Whether the AVX512-BF16 kernel computes this product: bf16 activations, a bf16 or
  weight-only int8 weight (``[K, N]`` or ``[N, K]``), and a row count in the policy's range for
  that weight (the kernel's products are exact, so this is XLA's bf16 dot up to summation
  order)."""
  p = be.policy
  return (x_dtype == jnp.bfloat16 and be.dpbf16
          and _in_range(mm, w, (p.dpbf16_min_rows, p.dpbf16_max_rows),
                        (p.dpbf16_int8_min_rows, p.dpbf16_int8_max_rows)))


def _in_range(mm: Matmul, w: quant.Stored, bf16_rows: tuple[int, int],
              int8_rows: tuple[int, int]) -> bool:
  """A bf16-activation kernel's rule: a bf16 weight with the rows in ``bf16_rows``, or a
  weight-only int8 one with the rows in ``int8_rows`` (``(min, max)``; max 0: never)."""
  if isinstance(w, quant.QuantArray):
    (lo, hi), ok = int8_rows, not w.act_quant
  else:
    (lo, hi), ok = bf16_rows, w.dtype == jnp.dtype(jnp.bfloat16)
  return ok and lo <= mm.m <= hi and hi > 0


def _scaled(y2s: list[jax.Array], mms: Sequence[Matmul], ws: Sequence[quant.Stored]
            ) -> list[jax.Array]:
  """int8 products times their per-column scales; float ones as they are."""
  return [y2 * w.scale.reshape(1, mm.n) if isinstance(w, quant.QuantArray) else y2
          for y2, mm, w in zip(y2s, mms, ws)]


def _raw(mm: Matmul, w: quant.Stored) -> jax.Array:
  """The stored weight (int8 values for weight-only int8) as ``[K, N]`` or ``[N, K]``."""
  return _weight_2d(mm, w.quant if isinstance(w, quant.QuantArray) else w)


def _amx_products(mms: Sequence[Matmul], ws: Sequence[quant.Stored]) -> list[jax.Array]:
  """The f32 ``[M, N]`` products of one bf16 activation with ``[K, N]`` weights of one stored
  dtype, in one AMX call; weight-only int8 scaled after."""
  y2s = cpu_kernels.matmul_amx_group(mms[0].x2, [_raw(mm, w) for mm, w in zip(mms, ws)])
  return _scaled(y2s, mms, ws)


def _dpbf16_products(mms: Sequence[Matmul], ws: Sequence[quant.Stored]) -> list[jax.Array]:
  """``_amx_products`` on AVX512-BF16 dot products."""
  y2s = cpu_kernels.matmul_dpbf16_group(mms[0].x2, [_raw(mm, w) for mm, w in zip(mms, ws)])
  return _scaled(y2s, mms, ws)


def _native_product(kernel: str, mm: Matmul, w: quant.Stored, be: CpuBackend) -> jax.Array:
  if kernel == "amx":
    return _amx_products([mm], [w])[0]
  if kernel == "dpbf16":
    return _dpbf16_products([mm], [w])[0]
  if kernel == "dpbf16_nk":
    return _scaled([cpu_kernels.matmul_dpbf16_nk(mm.x2, _raw(mm, w))], [mm], [w])[0]
  if kernel == "amx_nk":  # bf16 or weight-only int8 [N, K]
    return _scaled([cpu_kernels.matmul_amx_nk(mm.x2, _raw(mm, w))], [mm], [w])[0]
  x32 = mm.x2.astype(jnp.float32)
  if kernel in ("float", "float_nk"):
    fn = cpu_kernels.matmul_float if mm.w_kn else cpu_kernels.matmul_float_nk
    if not isinstance(w, quant.QuantArray):
      return fn(x32, _weight_2d(mm, w))
    # quant.Weight-only int8 at memory bandwidth: the int8 values widened in registers, f32 products
    # and sums (exact products for f32 and bf16 activations), then the scales.
    return fn(x32, _weight_2d(mm, w.quant)) * w.scale.reshape(1, mm.n)
  # W8A8: the same quantization, int32 dot and scaling, in one native call.
  assert isinstance(w, quant.QuantArray)
  if mm.w_kn:
    return cpu_kernels.matmul_w8a8(x32, _weight_2d(mm, w.quant), w.scale.reshape(mm.n),
                                   prefetch_l1=be.policy.int8_prefetch_l1)
  return cpu_kernels.matmul_w8a8_nk(x32, _weight_2d(mm, w.quant), w.scale.reshape(mm.n))


def _xla_product(mm: Matmul, x_dtype, w: quant.Stored, be: CpuBackend) -> jax.Array:
  """The product by XLA's own dot, lowered as the policy says on XLA:CPU."""
  x2 = mm.x2
  cpu = _on_cpu()
  dims = (((1,), (0 if mm.w_kn else 1,)), ((), ()))
  if not isinstance(w, quant.QuantArray):
    if not cpu:
      return lax.dot_general(x2, _weight_2d(mm, w).astype(x_dtype), dims,
                             preferred_element_type=jnp.float32)
    w2 = _weight_2d(mm, w).astype(x_dtype)
    if x_dtype == jnp.bfloat16 and mm.m < be.policy.bf16_min_rows:
      return cpu_lowering.float_dot(cpu_lowering.pad_rows(x2, be.policy.bf16_min_rows), w2, mm.w_kn, "xw")[:mm.m]
    # Many rows (prefill): the lowering measured fastest on this machine.
    f32 = w.dtype == jnp.dtype(jnp.float32)
    native_rows = be.policy.f32_native_max_rows if f32 else be.policy.float_native_max_rows
    method = "xw"
    if mm.m > native_rows:
      method = be.policy.f32_prefill if x_dtype == jnp.float32 else be.policy.float_prefill
    return cpu_lowering.float_dot(x2, w2, mm.w_kn, method)
  wq = _weight_2d(mm, w.quant)
  w_scale = w.scale.reshape(1, mm.n)
  if not w.act_quant:
    y2 = lax.dot_general(x2, wq.astype(x_dtype), dims, preferred_element_type=jnp.float32)
    return y2 * w_scale
  return cpu_lowering.w8a8_xla(x2.astype(jnp.float32), wq, w_scale, mm.w_kn,
                               be.policy.int8_row_multiple if cpu else 1)


def _tiled_rows(mm: Matmul, x_dtype, w: quant.Weight, be: CpuBackend) -> bool:
  """Whether a tiled kernel computes this product: a ``TiledArray`` whose tiles are this
  product's ``[K, N]``, rows in the policy's range for its format; bf16 activations, or (W8A8
  tiles) bf16 or f32 ones."""
  p = be.policy
  if isinstance(w, quant.TiledArray) and w.tiles.dtype == jnp.uint8:
    return (_on_cpu() and be.tiled_w8a8 and x_dtype in (jnp.bfloat16, jnp.float32)
            and p.tiled_w8a8_min_rows <= mm.m <= p.tiled_w8a8_max_rows
            and w.tiles.shape == (-(-mm.n // cpu_kernels.TILE_COLUMNS), -(-mm.k // 4),
                                  4 * cpu_kernels.TILE_COLUMNS))
  return (isinstance(w, quant.TiledArray) and _on_cpu() and be.tiled
          and x_dtype == jnp.bfloat16
          and _in_range(mm, w.array, (p.tiled_min_rows, p.tiled_max_rows),
                        (p.tiled_int8_min_rows, p.tiled_int8_max_rows))
          and w.tiles.shape == (-(-mm.n // cpu_kernels.TILE_COLUMNS), -(-mm.k // 2),
                                2 * cpu_kernels.TILE_COLUMNS))


def _amx_tiled_rows(mm: Matmul, x_dtype, w: quant.Weight, be: CpuBackend) -> bool:
  """Whether AMX computes this product straight from the weight's tiled copy (which is a
  sequence of AMX B tiles when ``K % 32 == 0``): a ``TiledArray`` with bf16 tiles of this
  product's ``[K, N]``, bf16 activations, rows in the policy's ``amx_tiled`` range."""
  p = be.policy
  return _amx_copy(mm, x_dtype, w, be, jnp.bfloat16, 2,
                   (p.amx_tiled_min_rows, p.amx_tiled_max_rows))


def _amx_w8_rows(mm: Matmul, x_dtype, w: quant.Weight, be: CpuBackend) -> bool:
  """Whether AMX's int8 products compute this product from the weight's quad copy: a
  ``TiledArray`` of a weight-only int8 weight with int8 quad tiles of this product's ``[K, N]``
  (``K % 64 == 0``), bf16 activations, rows in the policy's ``amx_w8`` range."""
  p = be.policy
  return _amx_copy(mm, x_dtype, w, be, jnp.int8, 4, (p.amx_w8_min_rows, p.amx_w8_max_rows))


def _amx_copy(mm: Matmul, x_dtype, w: quant.Weight, be: CpuBackend, dtype, group: int,
              rows: tuple[int, int]) -> bool:
  """A ``TiledArray`` whose tiles (``dtype``, ``group`` K rows a column entry: AMX B tiles of
  16 x ``16 * group`` K) are this product's ``[K, N]`` with ``K`` a whole number of tiles, bf16
  activations and rows in ``rows`` (``(min, max)``; max 0: never)."""
  k_step = 16 * group
  return (isinstance(w, quant.TiledArray) and _on_cpu() and be.amx
          and x_dtype == jnp.bfloat16 and w.tiles.dtype == dtype and mm.k % k_step == 0
          and rows[1] > 0 and rows[0] <= mm.m <= rows[1]
          and w.tiles.shape == (-(-mm.n // cpu_kernels.TILE_COLUMNS), mm.k // group,
                                group * cpu_kernels.TILE_COLUMNS))


def _tiled_products(mms: Sequence[Matmul], x_dtype, ws: Sequence[quant.Weight],
                    amx: bool = False) -> list[jax.Array]:
  tws = [w for w in ws if isinstance(w, quant.TiledArray)]  # all of them (_tiled_rows)
  quads = (tws[0].tiles.dtype == jnp.int8
           and tws[0].tiles.shape[-1] == 4 * cpu_kernels.TILE_COLUMNS)  # _amx_w8_rows
  kernel = (cpu_kernels.matmul_amx_w8_group if amx and quads
            else cpu_kernels.matmul_amx_tiled_group if amx
            else cpu_kernels.matmul_tiled_w8a8_group if tws[0].tiles.dtype == jnp.uint8
            else cpu_kernels.matmul_tiled_group)
  y2s = kernel(mms[0].x2, [w.tiles for w in tws], [mm.n for mm in mms])
  y2s = _scaled(y2s, mms, [w.array for w in tws])
  return [_finish(mm, y2, x_dtype) for mm, y2 in zip(mms, y2s)]


def matmul(mm: Matmul, x_dtype, w: quant.Weight, backend: CpuBackend) -> jax.Array:
  if _amx_tiled_rows(mm, x_dtype, w, backend) or _amx_w8_rows(mm, x_dtype, w, backend):
    return _tiled_products([mm], x_dtype, [w], amx=True)[0]
  if _tiled_rows(mm, x_dtype, w, backend):
    return _tiled_products([mm], x_dtype, [w])[0]
  sw = quant.stored(w)
  kernel = _native_kernel(mm, x_dtype, sw, backend)
  y2 = (_native_product(kernel, mm, sw, backend) if kernel
        else _xla_product(mm, x_dtype, sw, backend))
  return _finish(mm, y2, x_dtype)


def matmul_group(mms: Sequence[Matmul], x_dtype, ws: Sequence[quant.Weight],
                 backend: CpuBackend) -> list[jax.Array] | None:
  """The products of one activation with several weights in ONE native call, when every one
  would go to the same native ``[K, N]`` kernel with weights of one dtype; else None."""
  same_x = all(mm.x_perm == mms[0].x_perm and mm.k == mms[0].k for mm in mms)
  if (len(ws) >= 2 and same_x
      and (all(_amx_tiled_rows(mm, x_dtype, w, backend) for mm, w in zip(mms, ws))
           or all(_amx_w8_rows(mm, x_dtype, w, backend) for mm, w in zip(mms, ws)))):
    return _tiled_products(mms, x_dtype, ws, amx=True)
  if (len(ws) >= 2 and same_x and len({w.tiles.dtype for w in ws
                                       if isinstance(w, quant.TiledArray)}) == 1
      and all(_tiled_rows(mm, x_dtype, w, backend) for mm, w in zip(mms, ws))):
    return _tiled_products(mms, x_dtype, ws)
  sws = [quant.stored(w) for w in ws]
  kernels = {_native_kernel(mm, x_dtype, w, backend) for mm, w in zip(mms, sws)}
  quantized = {isinstance(w, quant.QuantArray) for w in sws}
  stored = {(w.quant if isinstance(w, quant.QuantArray) else w).dtype for w in sws}
  if len(sws) < 2 or len(kernels) != 1 or len(quantized) != 1 or len(stored) != 1 or not same_x:
    return None
  kernel = kernels.pop()
  if kernel in ("amx", "dpbf16"):
    products = _amx_products if kernel == "amx" else _dpbf16_products
    return [_finish(mm, y2, x_dtype) for mm, y2 in zip(mms, products(mms, sws))]
  x32 = mms[0].x2.astype(jnp.float32)  # every einsum reads x's contracted axes alike
  if kernel == "float":
    y2s = cpu_kernels.matmul_float_group(
        x32, [_weight_2d(mm, w.quant if isinstance(w, quant.QuantArray) else w)
              for mm, w in zip(mms, sws)])
    if quantized.pop():
      y2s = [y2 * w.scale.reshape(1, mm.n) for y2, mm, w in zip(y2s, mms, sws)
             if isinstance(w, quant.QuantArray)]
    return [_finish(mm, y2, x_dtype) for mm, y2 in zip(mms, y2s)]
  if kernel == "w8a8":
    qs = [w for w in sws if isinstance(w, quant.QuantArray)]  # all of them: W8A8 weights
    y2s = cpu_kernels.matmul_w8a8_group(
        x32, [_weight_2d(mm, q.quant) for mm, q in zip(mms, qs)],
        [q.scale.reshape(mm.n) for mm, q in zip(mms, qs)],
        prefetch_l1=backend.policy.int8_prefetch_l1)
    return [_finish(mm, y2, x_dtype) for mm, y2 in zip(mms, y2s)]
  return None


__all__ = ["Matmul", "as_matmul", "matmul", "matmul_group"]
