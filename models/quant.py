"""int8 weights: ``QuantArray`` and the one einsum every matmul goes through.

Contract:
  * ``QuantArray(quant, scale)`` holds symmetric int8 values and float32 scales per output
    channel. ``scale`` has the weight's shape with every contracted (input) axis set to 1, so one
    description serves any weight whatever its rank.
  * ``einsum(spec, x, w)`` multiplies activations by a float array or a ``QuantArray``; models call
    nothing else for matmuls, so there is never a second, quantized copy of a layer.
    ``einsums(specs, x, ws)`` is the list of ``einsum(spec, x, w)`` for weights that share the
    activation (q / k / v, gate / up): on XLA:CPU decode rows, one grouped native call (below).
  * ``QuantArray.act_quant`` (static) picks how int8 weights are multiplied: ``False`` dequantizes
    inside the dot (weight-only int8, the GPU/TPU policy); ``True`` also quantizes activations per
    token to int8 and runs an int8 x int8 -> int32 dot (the XLA:CPU policy, where that is the only
    fast int8 kernel; see "Compute policy" below).

Compute policy (how ``einsum`` lowers; results are those of the plain einsum up to rounding). On
XLA:CPU the knobs named below are fields of ``models.cpu.lowering.policy()``, chosen by a
start-up measurement per machine (cached on disk; ``PHASESERVE_CPU_AUTOTUNE=0`` fixes them to
``cpu_lowering.DEFAULT``), read once per trace:
  * Every weight einsum becomes ONE 2D ``dot_general`` ``[M, K] x [K, N]`` (or ``[N, K]`` when the
    weight's contracted axes are trailing, e.g. a tied ``[V, D]`` embedding): the weight is only
    reshaped (a bitcast), never transposed, and the activation is laid out as ``[M, K]``. Left to
    itself XLA may transpose a multi-axis weight such as ``o [N, H, D]`` into a copy on every call
    (measured on XLA:CPU: 6 ms per decode step of the 121M model, a quarter of the step).
  * Float weights: operands in the activation dtype, f32 accumulation (``preferred_element_type``),
    result in the activation dtype. So f32 params compute in f32 and bf16 params in bf16 (prefill:
    XLA:CPU's YNNPACK bf16 kernels, about twice the f32 FLOP/s; the dot lowering is the
    policy's ``float_prefill`` / ``f32_prefill``). On XLA:CPU, up to the policy's ``float_native_max_rows`` (bf16) /
    ``f32_native_max_rows`` rows (decode) go to the native kernel of ``models.cpu.kernels``
    (same products and f32 accumulation; it reads bf16 weights at memory bandwidth, where XLA's
    bf16 dot reaches about half, and f32 weights a little faster than XLA's f32 matrix-vector).
  * int8, ``act_quant=False`` (weight-only, the default of ``models.precision`` on every
    backend): the weight is converted to the activation dtype inside the dot and the
    per-channel scale applied to the result (GPU/TPU fuse the convert). On XLA:CPU, decode rows
    (up to the policy's int8 crossover) go to the native float kernels with int8 weights
    (``matmul_float`` for ``[K, N]``, ``matmul_float_nk`` for a tied ``[V, D]``): the int8
    values are widened in registers, so the weight is read once at memory bandwidth.
  * int8, ``act_quant=True`` (W8A8 dynamic, like llama.cpp's Q8_0 dot): each row of the activation
    is quantized to int8 with its own scale (amax / 127), the dot is int8 x int8 -> int32 (exact),
    and ``row_scale * col_scale`` is applied in f32. On XLA:CPU, up to the policy's
    ``int8_native_max_rows`` (``[K, N]`` weights) / ``int8_nk_native_max_rows`` (``[N, K]``, the
    tied unembedding) rows (decode) go to the native kernels of ``models.cpu.kernels`` when
    available (the same quantization, int32 sums and scaling in one call; they read the int8
    weight at memory bandwidth, XLA's int8 dot does not); otherwise the rows are padded with
    zeros to a multiple of the policy's ``int8_row_multiple``, since with few rows XLA:CPU picks
    a much slower int8 kernel. Both give the same int32 sums; padding rows quantize to zero and are
    sliced off.
  * AMX (Intel Sapphire Rapids and later): bf16 activations times a ``[K, N]`` bf16 or
    weight-only int8 weight, with a row count in the policy's ``amx_*_rows`` range (decode
    batches of tens of rows, where the native kernels run out of FMA throughput and XLA's bf16
    dot re-packs the weight on every call), go to ``cpu_kernels.matmul_amx_group`` (bf16
    products, f32 accumulation: XLA's bf16 dot up to summation order). It takes precedence over
    the native float kernel where both apply (the policy measured it faster there). A weight-only
    int8 ``[N, K]`` table (the tied unembedding) goes to ``cpu_kernels.matmul_amx_nk`` past the
    native ``[N, K]`` kernel's rows, where XLA would convert the whole table on every call.
  * ``einsums``: where every product of the group would go to the same native ``[K, N]`` kernel
    (float, weight-only int8 or W8A8, one stored dtype, the same activation layout), one
    grouped native call computes them all; otherwise the separate ``einsum``s. Measured on the
    2-vCPU Xeon: SmolLM2-135M decode 7-10% faster at batch 1 (bf16, int8 weight-only), 7-10%
    at batch 8 (BUILD_NOTES "Grouped native matmuls").
  * Without the native kernels, bf16 operands with fewer than ``bf16_min_rows`` rows are padded
    the same way on XLA:CPU, which otherwise converts the whole bf16 weight to f32 in memory
    before a matrix-vector dot.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from models.cpu import kernels as cpu_kernels, lowering as cpu_lowering


@flax.struct.dataclass
class QuantArray:
  quant: jax.Array  # int8, the weight's shape
  scale: jax.Array  # float32, the weight's shape with contracted axes = 1
  act_quant: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.quant.shape)

  @property
  def ndim(self) -> int:
    return self.quant.ndim

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    return (self.quant.astype(jnp.float32) * self.scale).astype(dtype)


Weight = jax.Array | QuantArray

# The XLA:CPU knobs (see "Compute policy") are ``models.cpu.lowering.policy()``, measured per
# machine (``cpu_lowering.DEFAULT`` holds the values these names had when they were constants).


def quantize_array(w: jax.Array, contract_axes: Sequence[int], act_quant: bool = False
                   ) -> QuantArray:
  """Symmetric per-output-channel int8: max |w| over the contracted axes maps to 127."""
  w32 = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w32), axis=tuple(contract_axes), keepdims=True)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  quant = jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8)
  return QuantArray(quant=quant, scale=scale.astype(jnp.float32), act_quant=act_quant)


_quantize_activations = cpu_lowering.quantize_activations


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


_pad_rows = cpu_lowering.pad_rows


def _on_cpu() -> bool:
  # The backend the computation is being traced for; jit on CPU is what the policy is for.
  return jax.default_backend() == "cpu"


class _Matmul(NamedTuple):
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


def _as_matmul(spec: str, x: jax.Array, w: Weight) -> _Matmul | None:
  x_letters, w_letters, out = _parse(spec)
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
  return _Matmul(x2, tuple(perm), w_kn, m, k, n, tuple(sizes[c] for c in got), y_perm)


def _finish(mm: _Matmul, y2: jax.Array, dtype) -> jax.Array:
  y = y2.astype(dtype).reshape(mm.y_shape)
  return y if mm.y_perm is None else jnp.transpose(y, mm.y_perm)


def _weight_2d(mm: _Matmul, w: jax.Array) -> jax.Array:
  """The weight as ``[K, N]`` or ``[N, K]``: a reshape of contiguous axes, never a transpose."""
  return w.reshape((mm.k, mm.n) if mm.w_kn else (mm.n, mm.k))


def _native_kernel(mm: _Matmul, x_dtype, w: Weight, pol: cpu_lowering.CpuPolicy) -> str | None:
  """Which ``models.cpu.kernels`` kernel computes this product on XLA:CPU under ``pol``:
  ``amx`` / ``amx_nk`` (bf16 activations, see ``_amx_rows``), ``float`` / ``float_nk`` (float or
  weight-only int8 weights), ``w8a8`` / ``w8a8_nk``, or None (XLA's dot)."""
  if not _on_cpu():
    return None
  if _amx_rows(mm, x_dtype, w, pol):
    return "amx" if mm.w_kn else "amx_nk"
  layout = "" if mm.w_kn else "_nk"
  if isinstance(w, QuantArray):
    max_rows = pol.int8_native_max_rows if mm.w_kn else pol.int8_nk_native_max_rows
    if mm.m > max_rows or not cpu_kernels.available():
      return None
    return ("w8a8" if w.act_quant else "float") + layout
  # The native kernel multiplies in f32: exact for w's own dtype when the einsum would compute
  # in w's dtype anyway (x.dtype == w.dtype) or cast w up to f32 (x is f32).
  f32 = w.dtype == jnp.dtype(jnp.float32)
  native_rows = pol.f32_native_max_rows if f32 else pol.float_native_max_rows
  if ((mm.w_kn or not f32) and mm.m <= native_rows
      and (not f32 or mm.m >= pol.f32_native_min_rows)
      and w.dtype in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
      and (x_dtype == w.dtype or x_dtype == jnp.float32) and cpu_kernels.available()):
    return "float" + layout
  return None


def _amx_rows(mm: _Matmul, x_dtype, w: Weight, pol: cpu_lowering.CpuPolicy) -> bool:
  """Whether the AMX kernel computes this product: bf16 activations, a ``[K, N]`` bf16 or
  weight-only int8 weight, and a row count in the policy's range for that weight. An ``[N, K]``
  weight (the tied unembedding) only when weight-only int8 and past the native kernel's rows,
  where the alternative converts the whole table for XLA's dot on every call (measured ~10x
  slower than AMX on the Xeon; bf16 ``[N, K]`` tied with XLA's dot and stays there)."""
  if x_dtype != jnp.bfloat16:
    return False
  if not mm.w_kn:
    return (isinstance(w, QuantArray) and not w.act_quant
            and pol.int8_nk_native_max_rows < mm.m <= pol.amx_int8_max_rows
            and cpu_kernels.amx_available())
  if isinstance(w, QuantArray):
    lo, hi = pol.amx_int8_min_rows, pol.amx_int8_max_rows
    ok = not w.act_quant
  else:
    lo, hi = pol.amx_min_rows, pol.amx_max_rows
    ok = w.dtype == jnp.dtype(jnp.bfloat16)
  return ok and lo <= mm.m <= hi and hi > 0 and cpu_kernels.amx_available()


def _amx_products(mms: Sequence[_Matmul], ws: Sequence[Weight]) -> list[jax.Array]:
  """The f32 ``[M, N]`` products of one bf16 activation with ``[K, N]`` weights of one stored
  dtype, in one AMX call; weight-only int8 scaled after."""
  y2s = cpu_kernels.matmul_amx_group(
      mms[0].x2, [_weight_2d(mm, w.quant if isinstance(w, QuantArray) else w)
                  for mm, w in zip(mms, ws)])
  return [y2 * w.scale.reshape(1, mm.n) if isinstance(w, QuantArray) else y2
          for y2, mm, w in zip(y2s, mms, ws)]


def _native_product(kernel: str, mm: _Matmul, w: Weight, pol: cpu_lowering.CpuPolicy) -> jax.Array:
  if kernel == "amx":
    return _amx_products([mm], [w])[0]
  if kernel == "amx_nk":  # weight-only int8 [N, K]
    return cpu_kernels.matmul_amx_nk(mm.x2, _weight_2d(mm, w.quant)) * w.scale.reshape(1, mm.n)
  x32 = mm.x2.astype(jnp.float32)
  if kernel in ("float", "float_nk"):
    fn = cpu_kernels.matmul_float if mm.w_kn else cpu_kernels.matmul_float_nk
    if not isinstance(w, QuantArray):
      return fn(x32, _weight_2d(mm, w))
    # Weight-only int8 at memory bandwidth: the int8 values widened in registers, f32 products
    # and sums (exact products for f32 and bf16 activations), then the scales.
    return fn(x32, _weight_2d(mm, w.quant)) * w.scale.reshape(1, mm.n)
  # W8A8: the same quantization, int32 dot and scaling, in one native call.
  if mm.w_kn:
    return cpu_kernels.matmul_w8a8(x32, _weight_2d(mm, w.quant), w.scale.reshape(mm.n),
                                   prefetch_l1=pol.int8_prefetch_l1)
  return cpu_kernels.matmul_w8a8_nk(x32, _weight_2d(mm, w.quant), w.scale.reshape(mm.n))


def _xla_product(mm: _Matmul, x_dtype, w: Weight, pol: cpu_lowering.CpuPolicy) -> jax.Array:
  """The product by XLA's own dot, lowered as the policy says on XLA:CPU."""
  x2 = mm.x2
  cpu = _on_cpu()
  dims = (((1,), (0 if mm.w_kn else 1,)), ((), ()))
  if not isinstance(w, QuantArray):
    if not cpu:
      return lax.dot_general(x2, _weight_2d(mm, w).astype(x_dtype), dims,
                             preferred_element_type=jnp.float32)
    w2 = _weight_2d(mm, w).astype(x_dtype)
    if x_dtype == jnp.bfloat16 and mm.m < pol.bf16_min_rows:
      return cpu_lowering.float_dot(_pad_rows(x2, pol.bf16_min_rows), w2, mm.w_kn, "xw")[:mm.m]
    # Many rows (prefill): the lowering measured fastest on this machine.
    f32 = w.dtype == jnp.dtype(jnp.float32)
    native_rows = pol.f32_native_max_rows if f32 else pol.float_native_max_rows
    method = "xw"
    if mm.m > native_rows:
      method = pol.f32_prefill if x_dtype == jnp.float32 else pol.float_prefill
    return cpu_lowering.float_dot(x2, w2, mm.w_kn, method)
  wq = _weight_2d(mm, w.quant)
  w_scale = w.scale.reshape(1, mm.n)
  if not w.act_quant:
    y2 = lax.dot_general(x2, wq.astype(x_dtype), dims, preferred_element_type=jnp.float32)
    return y2 * w_scale
  return cpu_lowering.w8a8_xla(x2.astype(jnp.float32), wq, w_scale, mm.w_kn,
                               pol.int8_row_multiple if cpu else 1)


def _policy() -> cpu_lowering.CpuPolicy:
  return cpu_lowering.policy() if _on_cpu() else cpu_lowering.DEFAULT


def einsum(spec: str, x: jax.Array, w: Weight) -> jax.Array:
  """``jnp.einsum(spec, x, w)`` with f32 accumulation; result in ``x.dtype``.

  ``x`` is the activation (first operand), ``w`` the weight (second operand).
  """
  return _einsum_as(spec, x, w, _as_matmul(spec, x, w))


def _einsum_as(spec: str, x: jax.Array, w: Weight, mm: _Matmul | None) -> jax.Array:
  """``einsum`` given its ``_as_matmul`` plan (None: not one matmul)."""
  if mm is None:
    return _einsum_generic(spec, x, w)
  pol = _policy()
  kernel = _native_kernel(mm, x.dtype, w, pol)
  y2 = (_native_product(kernel, mm, w, pol) if kernel else _xla_product(mm, x.dtype, w, pol))
  return _finish(mm, y2, x.dtype)


def einsums(specs: Sequence[str], x: jax.Array, ws: Sequence[Weight]) -> list[jax.Array]:
  """``[einsum(spec, x, w) for spec, w in zip(specs, ws)]`` for weights that share the
  activation (q / k / v, gate / up). Where every product would go to the same native ``[K, N]``
  kernel with weights of one dtype (decode on XLA:CPU), they are computed in ONE native call
  (``cpu_kernels.matmul_float_group`` / ``matmul_w8a8_group``): one fan-out over the threads
  instead of one per weight, which is most of the cost of the short matmuls of a small model's
  decode step. Results as ``einsum``'s (W8A8 bit-identical; float up to summation order)."""
  if len(specs) != len(ws):
    raise ValueError(f"einsums: {len(specs)} specs for {len(ws)} weights")
  mms = [_as_matmul(spec, x, w) for spec, w in zip(specs, ws)]
  if len(ws) > 1 and all(mm is not None for mm in mms):
    pol = _policy()
    kernels = {_native_kernel(mm, x.dtype, w, pol) for mm, w in zip(mms, ws)}
    quant = {isinstance(w, QuantArray) for w in ws}
    stored = {(w.quant if isinstance(w, QuantArray) else w).dtype for w in ws}
    same_x = all(mm.x_perm == mms[0].x_perm and mm.k == mms[0].k for mm in mms)
    if len(kernels) == 1 and len(quant) == 1 and len(stored) == 1 and same_x:
      kernel = kernels.pop()
      if kernel == "amx":
        return [_finish(mm, y2, x.dtype) for mm, y2 in zip(mms, _amx_products(mms, ws))]
      x32 = mms[0].x2.astype(jnp.float32)  # every einsum reads x's contracted axes alike
      if kernel == "float":
        y2s = cpu_kernels.matmul_float_group(
            x32, [_weight_2d(mm, w.quant if isinstance(w, QuantArray) else w)
                  for mm, w in zip(mms, ws)])
        if quant.pop():
          y2s = [y2 * w.scale.reshape(1, mm.n) for y2, mm, w in zip(y2s, mms, ws)]
        return [_finish(mm, y2, x.dtype) for mm, y2 in zip(mms, y2s)]
      if kernel == "w8a8":
        y2s = cpu_kernels.matmul_w8a8_group(
            x32, [_weight_2d(mm, w.quant) for mm, w in zip(mms, ws)],
            [w.scale.reshape(mm.n) for mm, w in zip(mms, ws)], prefetch_l1=pol.int8_prefetch_l1)
        return [_finish(mm, y2, x.dtype) for mm, y2 in zip(mms, y2s)]
  return [_einsum_as(spec, x, w, mm) for spec, w, mm in zip(specs, ws, mms)]


def _einsum_generic(spec: str, x: jax.Array, w: Weight) -> jax.Array:
  """Any einsum (batch axes, odd weight layouts): the straightforward lowering."""
  if not isinstance(w, QuantArray):
    return jnp.einsum(spec, x, w.astype(x.dtype),
                      preferred_element_type=jnp.float32).astype(x.dtype)
  x_letters, w_letters, out = _parse(spec)
  w_scale = _to_output(w.scale, w_letters, out)
  if not w.act_quant:
    y = jnp.einsum(spec, x, w.quant.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * w_scale).astype(x.dtype)
  contracted = tuple(i for i, c in enumerate(x_letters) if c not in out)
  xq, x_scale = _quantize_activations(x.astype(jnp.float32), contracted)
  y = jnp.einsum(spec, xq, w.quant, preferred_element_type=jnp.int32).astype(jnp.float32)
  return (y * _to_output(x_scale, x_letters, out) * w_scale).astype(x.dtype)


def take_rows(table: Weight, ids: jax.Array, dtype) -> jax.Array:
  """Embedding lookup ``table[ids]`` for a float or int8 ``[V, D]`` table."""
  if isinstance(table, QuantArray):
    return (table.quant[ids].astype(jnp.float32) * table.scale[ids]).astype(dtype)
  return table[ids].astype(dtype)
