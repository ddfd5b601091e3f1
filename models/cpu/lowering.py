"""How ``models.quant.einsum`` lowers each matmul shape class on XLA:CPU: the policy, its
lowerings, and the start-up measurement that chooses it per machine.

Contract:
  * ``CpuPolicy`` (frozen, hashable; ``DEFAULT``: hand-tuned constants) names, per shape class,
    the XLA dot lowering of float prefill (``float_prefill`` / ``f32_prefill``: ``xw``,
    ``xw_nacc``, ``wx``, ``wt``), the row counts up to which the native kernels of
    ``models.cpu.kernels`` are used (float, f32, W8A8 ``[K, N]`` / ``[N, K]``), the AMX and
    AVX512-BF16 row ranges, XLA's bf16 / int8 row padding and the W8A8 kernel's prefetch target.
  * ``choose(allowed, native, amx, cache_dir, refresh, dpbf16) -> Choice``: run once at start-up
    (``models.cpu.backend.resolve``), never inside a trace: ``DEFAULT`` when not ``allowed`` or
    not on CPU; else the entry of ``<cache_dir>/cpu_lowering.json`` for this machine's key
    (CPU, jax / jaxlib, kernel sources, native / AMX / AVX512-BF16 availability, ``VERSION``);
    else ``measure()`` (seconds on a small machine), stored there. Any failure: ``DEFAULT``.
  * ``measure()`` races the candidates of each class round-robin by their best time; a
    measured choice replaces ``DEFAULT``'s only when faster by ``MARGIN``.
  * Every candidate computes the plain einsum up to summation order; int8 ones bit-identically.
No measuring or compiling happens at import.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from models.cpu import kernels as cpu_kernels, json_cache, build as native_build, cpuinfo

VERSION = 14
CACHE_FILE = "cpu_lowering.json"
FLOAT_PREFILL = ("xw", "xw_nacc", "wx", "wt")
F32_PREFILL = ("xw", "wx", "wt")  # xw_nacc is xw for f32 results


@dataclasses.dataclass(frozen=True)
class CpuPolicy:
  float_prefill: str = "xw"  # bf16 (and any non-f32 float) activations
  f32_prefill: str = "xw"
  float_native_max_rows: int = 16
  f32_native_max_rows: int = 16
  f32_native_min_rows: int = 1
  bf16_min_rows: int = 2
  int8_native_max_rows: int = 16
  int8_nk_native_max_rows: int = 16
  int8_row_multiple: int = 8
  int8_prefetch_l1: bool = False  # the [K, N] W8A8 kernel prefetches into L1, not L2
  # AMX (bf16 activations, [K, N] weights): rows in [min, max] go to cpu_kernels.matmul_amx_group;
  # bf16 weights, then weight-only int8. 0 / 0: never (DEFAULT: the AMD EPYC it was tuned on
  # has no AMX; measured where the CPU has it).
  amx_min_rows: int = 0
  amx_max_rows: int = 0
  amx_int8_min_rows: int = 0
  amx_int8_max_rows: int = 0
  # AMX for a bf16 [N, K] weight (the tied unembedding); same convention.
  amx_nk_min_rows: int = 0
  amx_nk_max_rows: int = 0
  # AMX straight from a bf16 weight's tiled copy (models.quant.TiledArray, made at placement
  # when this range is not empty); same convention.
  amx_tiled_min_rows: int = 0
  amx_tiled_max_rows: int = 0
  # AMX's int8 products on a weight-only int8 weight's quad copy (cpu_kernels.matmul_amx_w8_group;
  # made at placement when this range is not empty); same convention.
  amx_w8_min_rows: int = 0
  amx_w8_max_rows: int = 0
  # AVX512-BF16 dot products (bf16 activations, bf16 or weight-only int8 weights, [K, N] and
  # [N, K]): rows in [min, max] go to cpu_kernels.matmul_dpbf16_*, where the CPU has the
  # instruction and AMX does not take the rows. DEFAULT: measured on the AMD EPYC Zen 4.
  dpbf16_min_rows: int = 4
  dpbf16_max_rows: int = 32
  dpbf16_int8_min_rows: int = 4
  dpbf16_int8_max_rows: int = 128
  # The tiled kernel (bf16 activations; bf16, then weight-only int8 weights with a tiled copy,
  # models.quant.TiledArray): rows in [min, max] go to cpu_kernels.matmul_tiled_group. DEFAULT:
  # measured on the AMD EPYC Zen 4; 0 / 0 for both formats: never (no copy is made).
  tiled_min_rows: int = 8
  tiled_max_rows: int = 128
  tiled_int8_min_rows: int = 8
  tiled_int8_max_rows: int = 128
  # The W8A8 tiled kernel (AVX512-VNNI; W8A8 weights with a tiled copy): rows in [min, max] go
  # to cpu_kernels.matmul_tiled_w8a8_group. DEFAULT: measured on the AMD EPYC Zen 4.
  tiled_w8a8_min_rows: int = 1
  tiled_w8a8_max_rows: int = 256
  # The native paged attention prefetches the next page into L2 (else L1). DEFAULT: the AMD
  # EPYC Zen 4 (L2 1.4-1.7x faster there); measured where the kernel is available.
  attention_prefetch_l2: bool = True
  # Prefill chunks through the paged attention's AMX blocks (models/cpu/native/
  # attention_blocks.h) rather than a row a token; raced where AMX is (DEFAULT: no AMX).
  attention_amx_blocks: bool = False

  @property
  def tiles_pairs(self) -> bool:
    """Whether the AVX512-BF16 tiled kernel takes any rows (bf16 or weight-only int8)."""
    return max(self.tiled_max_rows, self.tiled_int8_max_rows) > 0

  def __post_init__(self) -> None:
    if self.float_prefill not in FLOAT_PREFILL or self.f32_prefill not in F32_PREFILL:
      raise ValueError(f"float_prefill / f32_prefill must be in {FLOAT_PREFILL} / "
                       f"{F32_PREFILL}, got {self.float_prefill!r} / {self.f32_prefill!r}")
    if min(self.bf16_min_rows, self.int8_row_multiple) < 1:
      raise ValueError("bf16_min_rows and int8_row_multiple must be >= 1")


DEFAULT = CpuPolicy()

_log = logging.getLogger(__name__)


# ---- the lowerings (used by models.quant.einsum and measured here) -----------------------------

def float_dot(x2: jax.Array, w2: jax.Array, w_kn: bool, method: str) -> jax.Array:
  """f32 ``[M, N]`` = ``x2 [M, K]`` times ``w2`` (``[K, N]`` if ``w_kn`` else ``[N, K]``), both
  in the activation dtype, lowered as ``method`` (see ``float_prefill``)."""
  kdim = 0 if w_kn else 1
  if method == "xw":
    return lax.dot_general(x2, w2, (((1,), (kdim,)), ((), ())),
                           preferred_element_type=jnp.float32)
  if method == "xw_nacc":
    return lax.dot_general(x2, w2, (((1,), (kdim,)), ((), ()))).astype(jnp.float32)
  if method == "wx":
    y = lax.dot_general(w2, x2, (((kdim,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.T
  if method == "wt":
    wt = w2.T if w_kn else w2  # [N, K]; a temporary of this call
    return lax.dot_general(x2, wt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  raise ValueError(f"unknown float lowering {method!r}")


def pad_rows(x2: jax.Array, multiple: int) -> jax.Array:
  pad = -x2.shape[0] % multiple
  return jnp.pad(x2, ((0, pad), (0, 0))) if pad else x2


def quantize_activations(x32: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """Dynamic symmetric int8 per token: amax over the contracted ``axes`` maps to 127."""
  amax = jnp.max(jnp.abs(x32), axis=axes, keepdims=True)
  x_scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  return jnp.clip(jnp.round(x32 / x_scale), -127, 127).astype(jnp.int8), x_scale


def w8a8_xla(x32: jax.Array, wq: jax.Array, w_scale_1N: jax.Array, w_kn: bool,
             row_multiple: int) -> jax.Array:
  """W8A8 through XLA's int8 dot, rows zero-padded to ``row_multiple``: f32 ``[M, N]``."""
  m = x32.shape[0]
  xq, x_scale = quantize_activations(x32, (1,))
  xq = pad_rows(xq, row_multiple)
  dims = (((1,), (0 if w_kn else 1,)), ((), ()))
  acc = lax.dot_general(xq, wq, dims, preferred_element_type=jnp.int32)[:m]
  return acc.astype(jnp.float32) * x_scale * w_scale_1N


# ---- the choice, at start-up -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Choice:
  """What ``choose`` decided: the policy, where it came from (default | cache | measured), the
  cache key and path (None when not looked up) and the best time (ms) of every candidate."""
  policy: CpuPolicy
  source: str
  key: str | None = None
  path: str | None = None
  measurements: dict = dataclasses.field(default_factory=dict, compare=False)


def cache_key(native: bool, amx: bool, dpbf16: bool = False, tiled: bool = False) -> str:
  import jaxlib
  kernels = hashlib.sha256("".join(native_build.source(n) for n in (
      "matmul_kernels", "amx_matmul", "dpbf16_matmul", "tiled_matmul", "tiled_w8a8",
      "paged_attention")
                                       ).encode()).hexdigest()[:12]
  parts = [cpuinfo.key(), f"jax {jax.__version__}", f"jaxlib {jaxlib.__version__}",
           f"kernels {kernels}", f"native {native}", f"amx {amx}", f"dpbf16 {dpbf16}",
           f"tiled {tiled}", f"v{VERSION}"]
  return " | ".join(parts)


def choose(allowed: bool, native: bool, amx: bool, cache_dir: str, refresh: bool = False,
           dpbf16: bool = False, tiled: bool = False) -> Choice:
  """The policy for this machine (start-up only, never inside a trace): ``DEFAULT`` unless
  ``allowed`` on a CPU backend; else the cached entry for this machine's key, else ``measure()``
  now, stored in the cache (``refresh``: measure even when cached). Any failure: ``DEFAULT``."""
  if not allowed or jax.default_backend() != "cpu":
    return Choice(DEFAULT, "default")
  path = os.path.join(cache_dir, CACHE_FILE)
  key = None
  try:
    key = cache_key(native, amx, dpbf16, tiled)
    entry = None if refresh else json_cache.load(path).get(key)
    if entry is not None:
      return Choice(CpuPolicy(**entry["policy"]), "cache", key, path,
                    entry.get("measurements", {}))
    p, meas, seconds = measure(native=native, amx=amx, dpbf16=dpbf16, tiled=tiled)
    json_cache.store(path, key, {"policy": dataclasses.asdict(p), "measurements": meas,
                                 "seconds": seconds, "date": time.strftime("%Y-%m-%d %H:%M:%S")})
    return Choice(p, "measured", key, path, meas)
  except Exception as e:  # noqa: BLE001 - any failure means today's constants
    _log.warning("measuring the CPU lowering failed, using the defaults: %s", e)
    return Choice(DEFAULT, "default", key, path)


# ---- measuring ---------------------------------------------------------------------------------

MARGIN = 0.10  # a measured choice replaces DEFAULT's only when at least this much faster


def race(cands: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
  """Best (minimum) ms of each candidate, timed round-robin after one warm-up call each: on a
  shared machine other load only ever adds time, so the minimum is the stable statistic."""
  for f in cands.values():
    jax.block_until_ready(f())
  times: dict[str, list[float]] = {k: [] for k in cands}
  for _ in range(rounds):
    for k, f in cands.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f())
      times[k].append((time.perf_counter() - t0) * 1e3)
  return {k: min(v) for k, v in times.items()}


def _pick(res: dict[str, float], default: str, margin: float = MARGIN) -> str:
  """The fastest candidate, unless ``default`` is within ``margin`` of it."""
  best = min(res, key=res.__getitem__)
  return default if default in res and res[default] <= res[best] * (1 + margin) else best


def _crossover(native: dict[int, float], xla: dict[int, float], default_max: int,
               margin: float = MARGIN) -> int:
  """Largest measured row count up to which native is chosen at every count: up to
  ``default_max`` unless XLA is faster by more than ``margin``, beyond it only when native is
  faster by more than ``margin`` (a hysteresis towards ``DEFAULT``)."""
  best = 0
  for m in sorted(native):
    keep = (native[m] <= xla[m] * (1 + margin) if m <= default_max
            else native[m] * (1 + margin) < xla[m])
    if not keep:
      break
    best = m
  return best


def win_range(new: dict[int, float], other: dict[int, float], margin: float = MARGIN
               ) -> tuple[int, int]:
  """The row counts for a kernel (AMX, AVX512-BF16): from the smallest measured count where it
  is faster than the path it would replace by more than ``margin``, up to the last count of the
  run of such wins that follows; (0, 0) when it never wins. No extrapolation past a measured
  count."""
  lo = hi = 0
  for m in sorted(new):
    if new[m] * (1 + margin) < other[m]:
      lo, hi = (lo or m), m
    elif lo:
      break
  return lo, hi


def chain(step: Callable[[jax.Array, jax.Array], jax.Array], x: jax.Array,
           ws: list[jax.Array]) -> jax.Array:
  """``step(x, w)`` over the weights in sequence, each input depending on the previous output
  (as a model's layers do; XLA may not run them concurrently)."""
  y = x
  for w in ws:
    out = step(y, w)
    y = x + (out[:, :1] * 0).astype(x.dtype)
  return y


def weight_stack(make: Callable[[jax.Array], jax.Array], total_bytes: int, one_bytes: int
           ) -> list[jax.Array]:
  n = max(1, total_bytes // one_bytes)
  return [make(jax.random.key(i)) for i in range(n)]


def measure(native: bool, amx: bool, dpbf16: bool = False, tiled: bool = False,
            rounds: int = 7, k: int = 768,
            n: int = 2048,
            prefill_rows: int = 512, stream_bytes: int = 48 * 2**20,
            rows: tuple[int, ...] = (1, 8, 16),
            kernel_rows: tuple[int, ...] | None = None) -> tuple[CpuPolicy, dict, float]:
  """Measures every shape class on this machine: (policy, medians in ms, seconds taken).
  Decode-shaped classes stream ``stream_bytes`` of weights per call (more than the L3 of the
  machines seen) so they measure memory-bound behaviour; prefill uses one ``[prefill_rows, k] x
  [k, n]`` product. ``kernel_rows``: the row counts of the bf16-activation kernels' races (AMX, AVX512-BF16,
  tiled; default: each its own, up to 512; the tests give fewer)."""
  from models.cpu import lowering_kernels  # it builds on this module's helpers
  t0 = time.perf_counter()
  meas: dict[str, dict[str, float]] = {}
  key = jax.random.key(0)

  # Float prefill, per activation dtype (bf16: float_prefill, f32: f32_prefill).
  chosen: dict[str, str] = {}
  for dt, methods, default in ((jnp.bfloat16, FLOAT_PREFILL, DEFAULT.float_prefill),
                               (jnp.float32, F32_PREFILL, DEFAULT.f32_prefill)):
    x = jax.random.normal(key, (prefill_rows, k), dt)
    w = jax.random.normal(key, (k, n), dt)
    fns = {m: jax.jit(lambda x, w, m=m: float_dot(x, w, True, m)) for m in methods}
    res = race({m: functools.partial(f, x, w) for m, f in fns.items()}, rounds)
    meas[f"float_prefill_{jnp.dtype(dt).name}"] = res
    chosen[jnp.dtype(dt).name] = _pick(res, default)
  float_prefill, f32_prefill = chosen["bfloat16"], chosen["float32"]

  # bf16 XLA decode padding (the path without native kernels).
  ws = weight_stack(lambda kk: jax.random.normal(kk, (k, n), jnp.bfloat16), stream_bytes, k * n * 2)
  x1 = jax.random.normal(key, (1, k), jnp.bfloat16)

  def xla_stack(pad: int):
    f = jax.jit(lambda x, ws: chain(
        lambda y, w: float_dot(pad_rows(y, pad), w, True, "xw")[:1], x, ws))
    return lambda: f(x1, ws)

  res = race({str(p): xla_stack(p) for p in (1, 2, 8)}, rounds)
  meas["bf16_xla_1row_pad"] = res
  bf16_min_rows = int(_pick(res, str(DEFAULT.bf16_min_rows)))

  float_max = f32_max = 0
  f32_min = 1
  int8_max = 0
  int8_nk_max = 0
  prefetch_l1 = DEFAULT.int8_prefetch_l1
  if native:
    # Float decode rows: native vs XLA (bf16 weights; f32 checked at the smallest count).
    crossovers = []
    for dt, counts in ((jnp.bfloat16, rows), (jnp.float32, rows[:2])):
      isz = jnp.dtype(dt).itemsize
      wst = ws if dt == jnp.bfloat16 else weight_stack(
          lambda kk: jax.random.normal(kk, (k, n), dt), stream_bytes, k * n * isz)
      nat, xla = {}, {}
      for m in counts:
        xm = jax.random.normal(key, (m, k), dt)
        fn = jax.jit(lambda x, ws: chain(
            lambda y, w: cpu_kernels.matmul_float(y.astype(jnp.float32), w), x, ws))
        fx = jax.jit(lambda x, ws: chain(
            lambda y, w: float_dot(pad_rows(y, bf16_min_rows) if y.dtype == jnp.bfloat16
                                   else y, w, True, "xw")[:y.shape[0]], x, ws))
        r = race({"native": lambda: fn(xm, wst), "xla": lambda: fx(xm, wst)}, rounds)
        nat[m], xla[m] = r["native"], r["xla"]
        meas[f"float_decode_{jnp.dtype(dt).name}_{m}rows"] = r
      crossovers.append(_crossover(nat, xla, DEFAULT.float_native_max_rows))
    float_max, f32_max = crossovers
    f32_1 = meas["float_decode_float32_1rows"]
    if f32_1["native"] > f32_1["xla"] * (1 + MARGIN):  # XLA's f32 matrix-vector wins at 1 row
      f32_min = 2
      f32_8 = meas[f"float_decode_float32_{rows[1]}rows"]
      f32_max = rows[1] if f32_8["native"] <= f32_8["xla"] * (1 + MARGIN) else 0
    if f32_max == rows[1]:  # native chosen at every f32 count measured: up to bf16's limit
      f32_max = max(f32_max, float_max)
    del ws

    # int8 W8A8 decode rows, [K, N] and [N, K] weights: native vs XLA padded to 8.
    for name, w_kn, shape in (("int8_kn", True, (k, n)), ("int8_nk", False, (4 * n, k))):
      wq = weight_stack(lambda kk: jax.random.randint(kk, shape, -127, 128, jnp.int8), stream_bytes,
                  shape[0] * shape[1])
      nn = shape[1] if w_kn else shape[0]
      sc = jnp.full((nn,), 0.01, jnp.float32)
      nat, xla = {}, {}
      for m in rows:
        xm = jax.random.normal(key, (m, k), jnp.float32)
        kern = cpu_kernels.matmul_w8a8 if w_kn else cpu_kernels.matmul_w8a8_nk
        fn = jax.jit(lambda x, ws, kern=kern: chain(lambda y, w: kern(y, w, sc), x, ws))
        fx = jax.jit(lambda x, ws, w_kn=w_kn: chain(
            lambda y, w: w8a8_xla(y, w, sc[None], w_kn, 8), x, ws))
        r = race({"native": lambda: fn(xm, wq), "xla": lambda: fx(xm, wq)}, rounds)
        nat[m], xla[m] = r["native"], r["xla"]
        meas[f"{name}_decode_{m}rows"] = r
      if w_kn:
        int8_max = _crossover(nat, xla, DEFAULT.int8_native_max_rows)
        # Prefetch target of the same kernel: L2 (DEFAULT) vs L1. L1 must win at 1 row (the
        # batch-1 decode) by MARGIN and not lose by more than MARGIN at the second count.
        pf: dict[int, dict[str, float]] = {}
        for m in rows[:2]:
          xm = jax.random.normal(key, (m, k), jnp.float32)
          fl = {str(l1): jax.jit(lambda x, ws, l1=l1: chain(
              lambda y, w: cpu_kernels.matmul_w8a8(y, w, sc, prefetch_l1=l1), x, ws))
                for l1 in (False, True)}
          # A ~10% effect: twice the rounds of the other classes.
          pf[m] = race({key_: functools.partial(f, xm, wq) for key_, f in fl.items()}, 2 * rounds)
          meas[f"int8_kn_prefetch_l1_{m}rows"] = pf[m]
        one, two = pf[rows[0]], pf[rows[1]]
        prefetch_l1 = (one["True"] * (1 + MARGIN) < one["False"]
                       and two["True"] <= two["False"] * (1 + MARGIN))
      else:
        int8_nk_max = _crossover(nat, xla, DEFAULT.int8_nk_native_max_rows)
      del wq

  # AMX for decode batches: against what each row count would otherwise use.
  kw = {} if kernel_rows is None else {"rows": kernel_rows}
  amx_bf16 = amx_int8 = (0, 0)
  if native and amx:
    amx_bf16, amx_int8 = lowering_kernels.measure_amx(
        meas, rounds, k, n, stream_bytes, float_prefill, float_max, int8_max, **kw)

  # int8 XLA row multiple: one prefill-sized and (without native kernels) one decode-sized call.
  wq1 = jax.random.randint(key, (k, n), -127, 128, jnp.int8)
  sc = jnp.full((n,), 0.01, jnp.float32)
  score: dict[str, float] = {}
  for m in ((prefill_rows - 3,) if native else (1, prefill_rows - 3)):
    xm = jax.random.normal(key, (m, k), jnp.float32)
    by_multiple = {p: jax.jit(lambda x, w, p=p: w8a8_xla(x, w, sc[None], True, p))
                   for p in (1, 8, 32)}
    r = race({str(p): functools.partial(f, xm, wq1) for p, f in by_multiple.items()}, rounds)
    meas[f"int8_xla_row_multiple_{m}rows"] = r
    best = min(r.values())
    for name, v in r.items():
      score[name] = score.get(name, 0.0) + v / best
  int8_row_multiple = int(_pick(score, str(DEFAULT.int8_row_multiple)))

  # AVX512-BF16 for decode batches, where AMX does not take the rows.
  dp_bf16 = dp_int8 = (0, 0)
  if native and dpbf16:
    dp_bf16, dp_int8 = lowering_kernels.measure_dpbf16(
        meas, rounds, k, n, stream_bytes, float_prefill, float_max, int8_max, **kw)

  # AMX for the bf16 [N, K] unembedding, and AMX on tiled copies, against the router's paths.
  amx_nk = amx_tiled = amx_w8 = (0, 0)
  if native and amx:
    amx_nk = lowering_kernels.measure_amx_nk(meas, rounds, k, n, stream_bytes, float_prefill,
                                             float_max, dp_bf16, **kw)
    amx_tiled = lowering_kernels.measure_amx_tiled(meas, rounds, k, n, stream_bytes,
                                                   float_prefill, float_max, dp_bf16, amx_bf16,
                                                   **kw)
    amx_w8 = lowering_kernels.measure_amx_w8(meas, rounds, k, n, stream_bytes, int8_max,
                                             dp_int8, amx_int8, **kw)

  # The tiled kernel against the path each row count takes without it.
  tiled_bf16 = tiled_int8 = (0, 0)
  if native and tiled:
    tiled_bf16, tiled_int8 = lowering_kernels.measure_tiled(
        meas, rounds, k, n, stream_bytes, float_prefill, float_max, int8_max, (dp_bf16, dp_int8),
        (amx_bf16, amx_int8), **kw)
  tiled_w8a8 = (0, 0)
  if native and cpu_kernels.tiled_w8a8_available():
    tiled_w8a8 = lowering_kernels.measure_tiled_w8a8(meas, rounds, k, n, stream_bytes, int8_max,
                                                     prefetch_l1, int8_row_multiple)

  # The paged attention's prefetch target, where its kernel loads.
  attention_prefetch_l2 = DEFAULT.attention_prefetch_l2
  attention_amx_blocks = False
  if native:
    attention_prefetch_l2 = lowering_kernels.measure_attention(meas, rounds)
    if amx:
      attention_amx_blocks = lowering_kernels.measure_attention_blocks(meas, rounds)

  policy = CpuPolicy(float_prefill=float_prefill, f32_prefill=f32_prefill,
                     float_native_max_rows=float_max,
                     f32_native_max_rows=f32_max, f32_native_min_rows=f32_min,
                     bf16_min_rows=bf16_min_rows, int8_native_max_rows=int8_max,
                     int8_nk_native_max_rows=int8_nk_max, int8_row_multiple=int8_row_multiple,
                     int8_prefetch_l1=prefetch_l1, amx_min_rows=amx_bf16[0], amx_max_rows=amx_bf16[1],
                     amx_int8_min_rows=amx_int8[0], amx_int8_max_rows=amx_int8[1],
                     amx_nk_min_rows=amx_nk[0], amx_nk_max_rows=amx_nk[1],
                     amx_tiled_min_rows=amx_tiled[0], amx_tiled_max_rows=amx_tiled[1],
                     amx_w8_min_rows=amx_w8[0], amx_w8_max_rows=amx_w8[1],
                     dpbf16_min_rows=dp_bf16[0], dpbf16_max_rows=dp_bf16[1],
                     dpbf16_int8_min_rows=dp_int8[0], dpbf16_int8_max_rows=dp_int8[1],
                     tiled_min_rows=tiled_bf16[0], tiled_max_rows=tiled_bf16[1],
                     tiled_int8_min_rows=tiled_int8[0], tiled_int8_max_rows=tiled_int8[1],
                     tiled_w8a8_min_rows=tiled_w8a8[0], tiled_w8a8_max_rows=tiled_w8a8[1],
                     attention_prefetch_l2=attention_prefetch_l2,
                     attention_amx_blocks=attention_amx_blocks)
  return policy, meas, time.perf_counter() - t0
