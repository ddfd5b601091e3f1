"""Model speed on this machine: prefill tokens/s and MFU, decode ms/step and bandwidth use.

  python -m launch.lab.bench_model --model small --json
  python -m launch.lab.bench_model --model small --json --dtype float32 --quantize int8 \
      --prefill_tokens 128,2048 --prefill_batches 1,8 --decode_batches 1,8,64 --steps 16

One run measures, in order:
  * the machine: matmul peak FLOP/s for float32, bfloat16 and int8 (``measure_matmul_peak`` at
    ``--peak_size`` and half of it) and streaming read bandwidth (``measure_read_bandwidth``),
    both from ``partitioning.hardware``, at the start and again at the end of the run; the larger
    figures are used (on a shared machine the peak is the fastest the machine was seen running);
  * prefill, for every ``--dtype`` x quantization and every (batch, prompt length) with
    batch * length <= ``--prefill_max_tokens``: one chunk through ``prefill_and_sample`` (the
    generator's jitted prefill), tokens/s and MFU = model FLOPs / seconds / the measured peak of
    the matmul dtype (int8 weights on CPU: int8, as the W8A8 dot runs int8 x int8; else the
    activation dtype). Model FLOPs = ``cfg.flops_per_token(length)`` per token, less the
    unembedding of all but each row's last token, which prefill does not compute (counting it
    would report MFU > 1 on short prompts). ``mfu`` counts attention over the full context, as
    ``flops_per_token`` does; ``mfu_causal`` counts only the keys at or before each position,
    which is what the blocked causal attention computes (long prompts: ``mfu`` can pass 1);
  * decode, for every ``--dtype`` x quantization and batch in ``--decode_batches``: rows at
    ``--context`` tokens, ``--steps`` greedy steps in ONE call of ``serving.generator.decode_n``
    (the jitted multi-step loop the generator runs), ms/step and the bandwidth bound:
    (weight bytes + KV bytes the step reads) / measured read bandwidth. Weight bytes count every
    matmul weight (and int8 scales) but not the embedding table, of which a step reads only B
    rows (a tied table is the unembedding and counts). KV bytes are the ``attend_len`` bucket the
    step reads: 2 * layers * batch * kv_heads * attend_len * head_dim * itemsize.
    ``x_of_bound`` = ms_per_step / bound_ms; ``bw_util`` = 1 / x_of_bound.
    The bound uses the read bandwidth measured right after each timed decode call (a jitted sum
    over a resident ``--bandwidth_mb`` buffer, best of two reads), interleaved with the repeats:
    ``bound_ms`` = bytes / median bandwidth, ``x_of_bound`` = the median over repeats of
    (ms/step / bound of that repeat); ``bound_ms_start_end_bw`` uses the start/end figure;
  * the floor (``--floor_batches``, default 1 and 8, at ``--floor_tokens`` 128): phaseserve's
    float prefill (bf16 if measured, else the first ``--dtype``) against a minimal hand-written
    JAX forward of the same shape, weights stored ``[out, in]`` and ``[in, out]``, every matmul
    an einsum with ``preferred_element_type=f32``; the three are timed round-robin in this run
    (medians) and ``ratio_vs_minimal`` = phaseserve tok/s / loop tok/s.
On CPU the run first decides ``models.cpu.lowering.policy()`` (measured once per machine and
cached; ``PHASESERVE_CPU_AUTOTUNE=0``: the defaults) and reports it as ``cpu_lowering``.
``--model`` is anything ``models.io.loader.load_model`` accepts (a preset such as ``small`` or
``smollm2-135m``, or a model directory); float weights are cast to each ``--dtype``.
The KV cache content does not change the cost of a step, so decode rows start from a cache whose
lengths are set to ``--context`` (no prefill is run for them). Every figure is the median of
``--repeats`` timed calls after a compile/warm-up call (``best`` is the fastest). Int8 rows are
labelled with their mode (``weight_only``: the default of ``models.precision``, as
``launch.generate`` runs it; ``w8a8``: per-token int8 activations).

``--json`` prints one JSON object (else a table): {"model", "date", "machine", "jax_version",
"hardware": {"matmul_peak_flops": {dtype: FLOP/s}, "read_bandwidth": B/s}, "cpu_lowering",
"floor", "prefill": [...], "decode": [...], "summary": {...}, "wall_s"}. Bad flags exit with code
2 and a one-line error.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

from absl import flags, logging

from launch import cli
from launch import machine
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "small", "model preset name")
_DTYPE = flags.DEFINE_list("dtype", ["float32", "bfloat16"],
                           "float param / activation dtypes to measure (float32, bfloat16)")
_QUANTIZE = flags.DEFINE_enum(
    "quantize", "both", ["none", "int8", "both", "all", "weight_only", "w8a8"],
    "float weights; int8 in the default mode (models.precision: weight_only); both = float + "
    "default int8; all = float + both int8 modes; or one int8 mode")
_PREFILL_TOKENS = flags.DEFINE_list("prefill_tokens", ["128", "256", "512", "2048"],
                                    "prefill prompt lengths (tokens per row)")
_PREFILL_BATCHES = flags.DEFINE_list("prefill_batches", ["1", "8"], "prefill batch sizes")
_PREFILL_MAX_TOKENS = flags.DEFINE_integer(
    "prefill_max_tokens", 2048, "skip prefill shapes with batch * length above this",
    lower_bound=1)
_DECODE_BATCHES = flags.DEFINE_list("decode_batches", ["1", "8", "64"], "decode batch sizes")
_STEPS = flags.DEFINE_integer("steps", 16, "decode steps per timed call", lower_bound=1)
_CONTEXT = flags.DEFINE_integer("context", 128, "tokens already in the cache when decoding",
                                lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed calls per measurement", lower_bound=1)
_PEAK_SIZE = flags.DEFINE_integer("peak_size", 2048, "matmul size for the peak FLOP/s",
                                  lower_bound=16)
_BANDWIDTH_MB = flags.DEFINE_integer("bandwidth_mb", 512, "MiB read for the bandwidth figure",
                                     lower_bound=1)
_PARAM_SEED = flags.DEFINE_integer("param_seed", 0, "init seed for the random weights")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object instead of a table")
_FLOOR_BATCHES = flags.DEFINE_list(
    "floor_batches", ["1", "8"],
    "batches of the minimal-JAX-loop prefill floor (empty: skip it); bf16 if measured")
_FLOOR_TOKENS = flags.DEFINE_integer("floor_tokens", 128, "prompt length of the floor",
                                     lower_bound=1)



@dataclasses.dataclass(frozen=True)
class BenchConfig:
  model: str = "small"
  dtypes: tuple[str, ...] = ("float32", "bfloat16")
  quantize: str = "both"  # none | int8 | both | all | weight_only | w8a8
  prefill_tokens: tuple[int, ...] = (128, 256, 512, 2048)
  prefill_batches: tuple[int, ...] = (1, 8)
  prefill_max_tokens: int = 2048
  decode_batches: tuple[int, ...] = (1, 8, 64)
  steps: int = 16
  context: int = 128
  repeats: int = 5
  peak_size: int = 2048
  bandwidth_mb: int = 512
  param_seed: int = 0
  floor_batches: tuple[int, ...] = (1, 8)
  floor_tokens: int = 128

  def prefill_shapes(self) -> list[tuple[int, int]]:
    return [(b, t) for t in self.prefill_tokens for b in self.prefill_batches
            if b * t <= self.prefill_max_tokens]


def _ints(values: list[str], name: str) -> tuple[int, ...]:
  try:
    out = tuple(int(v) for v in values if v.strip())
  except ValueError:
    raise CliError(f"--{name} must be comma-separated integers, got {','.join(values)!r}")
  if not out or min(out) < 1:
    raise CliError(f"--{name} must list positive integers")
  return out


def _config_from_flags() -> BenchConfig:
  from models.config import PRESET_NAMES
  if (_MODEL.value not in PRESET_NAMES and not os.path.isdir(_MODEL.value)) or (
      _MODEL.value.startswith("palm")):
    names = ", ".join(n for n in PRESET_NAMES if not n.startswith("palm"))
    raise CliError(f"--model must be an instantiable preset ({names}) or a model directory, "
                   f"got {_MODEL.value!r}")
  dtypes = tuple(d.strip() for d in _DTYPE.value if d.strip())
  bad = [d for d in dtypes if d not in ("float32", "bfloat16")]
  if bad or not dtypes:
    raise CliError(f"--dtype must list float32 and/or bfloat16, got {','.join(_DTYPE.value)!r}")
  return BenchConfig(
      model=_MODEL.value, dtypes=dtypes, quantize=_QUANTIZE.value,
      prefill_tokens=_ints(_PREFILL_TOKENS.value, "prefill_tokens"),
      prefill_batches=_ints(_PREFILL_BATCHES.value, "prefill_batches"),
      prefill_max_tokens=_PREFILL_MAX_TOKENS.value,
      decode_batches=_ints(_DECODE_BATCHES.value, "decode_batches"), steps=_STEPS.value,
      context=_CONTEXT.value, repeats=_REPEATS.value, peak_size=_PEAK_SIZE.value,
      bandwidth_mb=_BANDWIDTH_MB.value, param_seed=_PARAM_SEED.value,
      floor_batches=(_ints(_FLOOR_BATCHES.value, "floor_batches")
                     if any(v.strip() for v in _FLOOR_BATCHES.value) else ()),
      floor_tokens=_FLOOR_TOKENS.value)


def _timed(fn, repeats: int) -> tuple[float, float]:
  """(median, best) seconds of ``fn()`` over ``repeats`` calls after one warm-up call."""
  fn()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), min(times)


def _weight_bytes(params, cfg) -> int:
  """Bytes of every matmul weight a decode step reads (not the embedding lookup table)."""
  import jax
  total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
  if not cfg.tie_embeddings:
    total -= sum(leaf.nbytes for leaf in jax.tree.leaves(params["embed"]))
  return int(total)


def _load(cfg_b: BenchConfig, dtype_name: str):
  """(cfg, params) from ``models.io.loader.load_model`` (a preset's random weights, or real ones),
  float leaves cast to ``dtype_name``."""
  import jax
  import jax.numpy as jnp
  from models.io.loader import load_model

  dtype = jnp.float32 if dtype_name == "float32" else jnp.bfloat16
  cfg, params, _ = load_model(cfg_b.model, dtype=dtype, param_seed=cfg_b.param_seed)
  params = jax.tree.map(
      lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != dtype
      else a, params)
  return cfg, params


def _param_sets(cfg_b: BenchConfig):
  """Yields (cfg, dtype name, quantize name, params) for every requested combination; the
  quantize name is "none" or the int8 mode (``models.precision``)."""
  from models import precision

  modes = {"none": [], "int8": [precision.default_int8_mode()],
           "both": [precision.default_int8_mode()], "all": list(precision.INT8_MODES),
           "weight_only": ["weight_only"], "w8a8": ["w8a8"]}[cfg_b.quantize]
  for name in cfg_b.dtypes:
    cfg, params = _load(cfg_b, name)
    if cfg_b.quantize in ("none", "both", "all"):
      yield cfg, name, "none", params
    for mode in modes:
      yield cfg, name, mode, precision.apply(params, cfg, "int8", mode)
    del params


def _prefill_call(cfg, params, b: int, t: int, backend):
  """A no-argument function running one prefill of b rows of t tokens (blocks until done)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from models.kv_cache import init_cache
  from models.transformer import bucket
  from serving.generator import prefill_and_sample
  from serving.sampling import SamplingArrays, SamplingParams

  dtype = params["final_norm"].dtype
  t_pad = bucket(t)
  cache_len = t_pad
  toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, t_pad)),
                     jnp.int32)
  lens = jnp.full((b,), t, jnp.int32)
  s = SamplingArrays.from_params([SamplingParams()] * b)
  state = {"cache": init_cache(cfg, b, cache_len, dtype, backend)}

  def call():  # every call prefills the prompt from position 0 (the cache is reused, donated)
    cache = state["cache"].replace(lengths=jnp.zeros((b,), jnp.int32))
    tok, state["cache"] = prefill_and_sample(params, toks, cache, lens, s, cfg=cfg,
                                             attend_len=cache_len, greedy_only=True)
    jax.block_until_ready(tok)

  return call


def _prefill(cfg, params, dtype_name: str, quant: str, b: int, t: int, cfg_b: BenchConfig, backend
             ) -> dict:
  """One prefill shape; "mfu" is filled in by ``run`` once the peaks are final."""
  med, best = _timed(_prefill_call(cfg, params, b, t, backend), cfg_b.repeats)
  # int8 W8A8 multiplies int8 x int8; everything else runs in the activation dtype.
  int8_dot = quant == "w8a8"
  peak_dtype = "int8" if int8_dot else dtype_name
  flops, flops_causal = _prefill_flops(cfg, b, t)
  return {"dtype": dtype_name, "quantize": quant, "batch": b, "tokens": t,
          "batch_tokens": b * t, "seconds": med, "best_seconds": best,
          "tokens_per_s": b * t / med, "flops_per_token": cfg.flops_per_token(t),
          "flops": flops, "flops_per_s": flops / med, "flops_causal": flops_causal,
          "flops_causal_per_s": flops_causal / med, "peak_dtype": peak_dtype}

FLOOR_LAYOUTS = ("out_in", "in_out")


def _minimal_params(cfg, dtype, layout: str, seed: int) -> dict:
  """Random weights for ``_minimal_forward``: 2-D matrices stored ``[out, in]`` or ``[in, out]``."""
  import jax
  import jax.numpy as jnp

  d, nh, kh, f = (cfg.embed_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                  cfg.mlp_dim)
  keys = iter(jax.random.split(jax.random.key(seed), 8 * cfg.num_layers + 2))

  def mat(n_in: int, n_out: int) -> jax.Array:
    shape = (n_out, n_in) if layout == "out_in" else (n_in, n_out)
    return (jax.random.normal(next(keys), shape, jnp.float32) / n_in ** 0.5).astype(dtype)

  layers = [{"q": mat(d, nh), "k": mat(d, kh), "v": mat(d, kh), "o": mat(nh, d),
             "gate": mat(d, f), "up": mat(d, f), "down": mat(f, d),
             "attn_norm": jnp.ones((d,), dtype), "mlp_norm": jnp.ones((d,), dtype)}
            for _ in range(cfg.num_layers)]
  p = {"embed": jax.random.normal(next(keys), (cfg.vocab_size, d), jnp.float32).astype(dtype),
       "final_norm": jnp.ones((d,), dtype), "layers": layers}
  if not cfg.tie_embeddings:
    p["unembed"] = mat(d, cfg.vocab_size)
  return p


def _minimal_forward(p: dict, tokens, *, cfg, layout: str):
  """A minimal hand-written JAX prefill of the same model shape (serial Llama block, SwiGLU,
  GQA, rope; full masked softmax; no KV cache; last-token logits): every matmul one
  ``jnp.einsum`` with ``preferred_element_type=f32`` on weights stored as ``layout``."""
  import jax
  import jax.numpy as jnp
  from models.layers import rms_norm, rope

  f32 = jnp.float32
  b, t = tokens.shape
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  spec = "bti,oi->bto" if layout == "out_in" else "bti,io->bto"

  def mm(x, w):
    return jnp.einsum(spec, x, w, preferred_element_type=f32).astype(x.dtype)

  x = p["embed"][tokens]
  pos = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
  causal = jnp.tril(jnp.ones((t, t), bool))
  for lw in p["layers"]:
    hh = rms_norm(x, lw["attn_norm"], cfg.norm_eps, False)
    q = rope(mm(hh, lw["q"]).reshape(b, t, n, h), pos, cfg.rope_theta)
    kk = rope(mm(hh, lw["k"]).reshape(b, t, k, h), pos, cfg.rope_theta)
    v = mm(hh, lw["v"]).reshape(b, t, k, h)
    q = q.reshape(b, t, k, n // k, h)
    s = jnp.einsum("btkgh,bskh->bkgts", q, kk, preferred_element_type=f32) * h ** -0.5
    a = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1).astype(x.dtype)
    o = jnp.einsum("bkgts,bskh->btkgh", a, v, preferred_element_type=f32).astype(x.dtype)
    x = x + mm(o.reshape(b, t, n * h), lw["o"])
    hh = rms_norm(x, lw["mlp_norm"], cfg.norm_eps, False)
    g = mm(hh, lw["gate"]).astype(f32)
    x = x + mm((jax.nn.silu(g) * mm(hh, lw["up"]).astype(f32)).astype(x.dtype), lw["down"])
  x = rms_norm(x[:, -1:], p["final_norm"], cfg.norm_eps, False)
  if cfg.tie_embeddings:
    logits = jnp.einsum("btd,vd->btv", x, p["embed"], preferred_element_type=f32)
  else:
    logits = mm(x, p["unembed"]).astype(f32)
  return jnp.argmax(logits[:, 0], axis=-1)


def _floor(cfg, params, dtype_name: str, cfg_b: BenchConfig, log, backend) -> dict:
  """phaseserve's prefill vs the minimal JAX loops (both layouts), timed round-robin in this
  process: medians and ratios (phaseserve tok/s / loop tok/s) per batch."""
  import jax
  import numpy as np

  dtype = params["final_norm"].dtype
  t = cfg_b.floor_tokens
  out: dict = {"dtype": dtype_name, "tokens": t, "rows": []}
  loops = {lay: (_minimal_params(cfg, dtype, lay, cfg_b.param_seed + 1),
                 jax.jit(lambda p, tok, lay=lay: _minimal_forward(p, tok, cfg=cfg, layout=lay)))
           for lay in FLOOR_LAYOUTS}
  for b in cfg_b.floor_batches:
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
    fns = {"phaseserve": _prefill_call(cfg, params, b, t, backend)}
    for lay, (p, f) in loops.items():
      fns[f"minimal_{lay}"] = lambda p=p, f=f: jax.block_until_ready(f(p, toks))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
      f()
    for _ in range(max(3, cfg_b.repeats)):
      for k, f in fns.items():
        t0 = time.perf_counter()
        f()
        times[k].append(time.perf_counter() - t0)
    tps = {k: b * t / statistics.median(v) for k, v in times.items()}
    best_loop = max(v for k, v in tps.items() if k != "phaseserve")
    row = {"batch": b, "tokens_per_s": tps,
           "ratio_vs_minimal": {k: tps["phaseserve"] / v for k, v in tps.items()
                                if k != "phaseserve"},
           "ratio_vs_best_minimal": tps["phaseserve"] / best_loop}
    log(f"floor {dtype_name} {b}x{t}: " + ", ".join(f"{k} {v:.0f} tok/s" for k, v in tps.items()))
    out["rows"].append(row)
  del loops
  return out


def _prefill_flops(cfg, b: int, t: int) -> tuple[float, float]:
  """Model FLOPs of prefilling b rows of t tokens, two ways. Both leave out the unembedding of
  every token but each row's last (prefill computes only the last logits).
  ``flops``: ``cfg.flops_per_token(t)`` per token (attention over the full t-token context).
  ``flops_causal``: attention of the token at position i over its i + 1 keys only (what a causal
  prefill needs; about half the attention term)."""
  unembed = 2.0 * cfg.vocab_size * cfg.embed_dim
  flops = b * t * cfg.flops_per_token(t) - b * (t - 1) * unembed
  attn_per_key = cfg.flops_per_token(1) - cfg.flops_per_token(0)
  flops_causal = (b * t * cfg.flops_per_token(0) + b * attn_per_key * t * (t + 1) / 2
                  - b * (t - 1) * unembed)
  return flops, flops_causal


class _ReadMeter:
  """Streaming read bandwidth of one jitted f32 sum over a resident ``nbytes`` buffer (the
  ``partitioning.hardware`` measurement, without re-allocating per call): B/s of one call."""

  def __init__(self, nbytes: int):
    import jax
    import jax.numpy as jnp
    self.n = max(1, nbytes // 4)
    self.buf = jnp.ones((self.n,), jnp.float32)
    self.fn = jax.jit(jnp.sum)
    jax.block_until_ready(self.fn(self.buf))

  def __call__(self) -> float:
    import jax
    best = float("inf")
    for _ in range(2):  # best of two back-to-back reads
      t0 = time.perf_counter()
      jax.block_until_ready(self.fn(self.buf))
      best = min(best, time.perf_counter() - t0)
    return 4.0 * self.n / best


def _decode(cfg, params, dtype_name: str, quant: str, b: int, cfg_b: BenchConfig,
            meter: "_ReadMeter", backend) -> dict:
  """One decode batch; each timed call is followed by a read-bandwidth measurement (``meter``)
  and the bound is the median over those, so a bound and the steps it is compared with are
  measured within the same second (read bandwidth of a shared VM moves 2x within minutes)."""
  import jax
  import jax.numpy as jnp
  from models.kv_cache import init_cache
  from models.transformer import bucket
  from serving.generator import decode_n
  from serving.sampling import SamplingArrays, SamplingParams

  dtype = params["final_norm"].dtype
  n, ctx = cfg_b.steps, cfg_b.context
  # As Generator.stream sizes them for a prompt of `ctx` tokens and `n` new ones.
  cache_len = min(cfg.max_seq_len, bucket(ctx + n, maximum=cfg.max_seq_len))
  if ctx + n > cache_len:
    raise CliError(f"--context {ctx} + --steps {n} exceeds the model context {cache_len}")
  attend_len = min(cache_len, bucket(ctx + n, maximum=cache_len))
  s = SamplingArrays.from_params([SamplingParams()] * b)
  state = {"cache": init_cache(cfg, b, cache_len, dtype, backend), "tok": jnp.zeros((b,), jnp.int32)}

  def call():
    cache = state["cache"].replace(lengths=jnp.full((b,), ctx, jnp.int32))
    out, state["cache"] = decode_n(params, state["tok"], cache, s, cfg=cfg, n=n,
                                   attend_len=attend_len, greedy_only=True)
    jax.block_until_ready(out)

  call()  # compile + warm-up
  times, bws = [], []
  for _ in range(cfg_b.repeats):
    t0 = time.perf_counter()
    call()
    times.append(time.perf_counter() - t0)
    bws.append(meter())
  med, best = statistics.median(times), min(times)
  itemsize = jnp.dtype(dtype).itemsize
  kv_bytes = 2 * cfg.num_layers * b * cfg.num_kv_heads * attend_len * cfg.head_dim * itemsize
  w_bytes = _weight_bytes(params, cfg)
  nbytes = w_bytes + kv_bytes
  step = med / n
  bw = statistics.median(bws)
  x_bound = statistics.median(t / n * bw_i / nbytes for t, bw_i in zip(times, bws))
  return {"dtype": dtype_name, "quantize": quant, "batch": b, "context": ctx,
          "attend_len": attend_len, "steps": n, "ms_per_step": step * 1e3,
          "best_ms_per_step": best / n * 1e3, "tokens_per_s": b / step,
          "weight_bytes": w_bytes, "kv_bytes": kv_bytes, "bytes_per_step": nbytes,
          "read_bandwidth": bw, "read_bandwidths": bws, "bound_ms": nbytes / bw * 1e3,
          "x_of_bound": x_bound, "bw_util": 1.0 / x_bound}


def _summary(prefill: list[dict], decode: list[dict]) -> dict:
  out: dict = {}
  float1 = [d for d in decode if d["batch"] == 1 and d["quantize"] == "none"]
  int81 = [d for d in decode if d["batch"] == 1 and d["quantize"] != "none"]
  if float1:
    f = min(float1, key=lambda d: d["ms_per_step"])
    out["fastest_float_batch1"] = {"dtype": f["dtype"], "ms_per_step": f["ms_per_step"],
                                   "x_of_bound": f["x_of_bound"]}
  if int81:
    q = min(int81, key=lambda d: d["ms_per_step"])
    out["fastest_int8_batch1"] = {"dtype": q["dtype"], "ms_per_step": q["ms_per_step"],
                                  "x_of_bound": q["x_of_bound"]}
    if float1:
      out["int8_speedup_batch1"] = out["fastest_float_batch1"]["ms_per_step"] / q["ms_per_step"]
  for b in sorted({d["batch"] for d in decode}):
    rows = [d for d in decode if d["batch"] == b]
    best = max(rows, key=lambda d: d["tokens_per_s"])
    out[f"best_decode_tokens_per_s_batch{b}"] = {
        "dtype": best["dtype"], "quantize": best["quantize"], "tokens_per_s": best["tokens_per_s"]}
  for key in sorted({(p["dtype"], p["quantize"]) for p in prefill}):
    big = [p for p in prefill if (p["dtype"], p["quantize"]) == key and p["batch_tokens"] >= 2048]
    if big:
      p = min(big, key=lambda r: r["mfu"])
      out[f"min_prefill_mfu_2048plus_{key[0]}_{key[1]}"] = {k: p[k] for k in (
          "batch", "tokens", "mfu", "mfu_causal", "tokens_per_s")}
  return out


def run(cfg_b: BenchConfig, log=lambda msg: None) -> dict:
  """Runs every measurement of ``cfg_b``; returns the JSON-able result."""
  import jax
  from partitioning.hardware import measure_matmul_peak, measure_read_bandwidth

  t_start = time.perf_counter()
  load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
  from models.cpu import backend as cpu_backend
  lowering = None
  backend = cpu_backend.CpuBackend()
  if jax.default_backend() == "cpu":
    resolved = cpu_backend.resolve()  # decided (measured or read from the cache) before any trace
    backend, lowering = resolved.backend, resolved.report()
    log(f"cpu lowering ({lowering['source']}): {lowering['policy']}")
  dtypes = ("float32", "bfloat16", "int8")

  def measure() -> tuple[dict, float]:
    # Best of two sizes: the peak of a shared machine is the fastest it was seen running.
    sizes = sorted({cfg_b.peak_size, max(16, cfg_b.peak_size // 2)})
    peaks = {d: max(measure_matmul_peak(d, n, reps=5) for n in sizes) for d in dtypes}
    return peaks, measure_read_bandwidth(cfg_b.bandwidth_mb * 2**20, reps=5)

  peaks_start, bw_start = measure()
  peaks, bandwidth = dict(peaks_start), bw_start
  log(f"peaks {', '.join(f'{k} {v / 1e9:.0f} GFLOP/s' for k, v in peaks.items())}; "
      f"read {bandwidth / 1e9:.1f} GB/s")
  meter = _ReadMeter(cfg_b.bandwidth_mb * 2**20)
  prefill, decode = [], []
  floor: dict | None = None
  floor_dtype = "bfloat16" if "bfloat16" in cfg_b.dtypes else cfg_b.dtypes[0]
  cfg = None
  for cfg, dtype_name, quant, params in _param_sets(cfg_b):
    if (cfg_b.floor_batches and quant == "none" and dtype_name == floor_dtype):
      floor = _floor(cfg, params, dtype_name, cfg_b, log, backend)
    for b, t in cfg_b.prefill_shapes():
      r = _prefill(cfg, params, dtype_name, quant, b, t, cfg_b, backend)
      log(f"prefill {dtype_name}/{quant} {b}x{t}: {r['tokens_per_s']:.0f} tok/s")
      prefill.append(r)
    for b in cfg_b.decode_batches:
      r = _decode(cfg, params, dtype_name, quant, b, cfg_b, meter, backend)
      log(f"decode {dtype_name}/{quant} batch {b}: {r['ms_per_step']:.2f} ms/step, "
          f"{r['tokens_per_s']:.0f} tok/s")
      decode.append(r)
    del params
  # Measured again at the end; the larger figures are used for MFU and the bandwidth bound.
  peaks_end, bw_end = measure()
  peaks = {d: max(peaks_start[d], peaks_end[d]) for d in dtypes}
  bandwidth = max(bw_start, bw_end)
  for p in prefill:
    p["mfu"] = p["flops_per_s"] / peaks[p["peak_dtype"]]
    p["mfu_causal"] = p["flops_causal_per_s"] / peaks[p["peak_dtype"]]
  del meter
  for d in decode:  # also against the best start / end figure, for comparison with old runs
    d["bound_ms_start_end_bw"] = d["bytes_per_step"] / bandwidth * 1e3
  assert cfg is not None
  return {
      "model": cfg.name, "param_count": cfg.param_count(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "machine": machine.describe(), "jax_version": jax.__version__,
      "config": dataclasses.asdict(cfg_b),
      "hardware": {"matmul_peak_flops": peaks, "read_bandwidth": bandwidth,
                   "peak_size": cfg_b.peak_size,
                   "start": {"matmul_peak_flops": peaks_start, "read_bandwidth": bw_start},
                   "end": {"matmul_peak_flops": peaks_end, "read_bandwidth": bw_end}},
      "load_avg_1m_start": load_start,
      "cpu_lowering": lowering, "floor": floor,
      "prefill": prefill, "decode": decode, "summary": _summary(prefill, decode),
      "wall_s": time.perf_counter() - t_start,
  }


def _table(result: dict) -> str:
  hw = result["hardware"]
  lines = [f"{result['model']} on {result['machine']['cpu']} ({result['machine']['platform']}); "
           + ", ".join(f"{k} peak {v / 1e9:.0f} GFLOP/s"
                       for k, v in hw["matmul_peak_flops"].items())
           + f"; read {hw['read_bandwidth'] / 1e9:.1f} GB/s",
           "prefill  dtype     quant  batch x tokens   tok/s    MFU  causal"]
  for p in result["prefill"]:
    lines.append(f"         {p['dtype']:9s} {p['quantize']:6s} {p['batch']:5d} x {p['tokens']:<6d}"
                 f" {p['tokens_per_s']:7.0f}  {p['mfu']:5.2f}  {p['mfu_causal']:5.2f}"
                 f" ({p['peak_dtype']})")
  lines.append("decode   dtype     quant  batch  ms/step   tok/s  bound ms  x bound")
  for d in result["decode"]:
    lines.append(f"         {d['dtype']:9s} {d['quantize']:6s} {d['batch']:5d} "
                 f"{d['ms_per_step']:8.2f} {d['tokens_per_s']:7.0f}  {d['bound_ms']:8.2f}"
                 f"  {d['x_of_bound']:5.2f}")
  if result.get("floor"):
    fl = result["floor"]
    lines.append(f"floor    {fl['dtype']} prefill x {fl['tokens']} tokens, tok/s "
                 "(ratios: phaseserve / loop)")
    for r in fl["rows"]:
      lines.append(f"         batch {r['batch']}: " + ", ".join(
          f"{k} {v:.0f}" for k, v in r["tokens_per_s"].items()) + "; ratios " + ", ".join(
          f"{k} {v:.2f}" for k, v in r["ratio_vs_minimal"].items()))
  if result.get("cpu_lowering"):
    lines.append(f"cpu lowering ({result['cpu_lowering']['source']}): "
                 f"{result['cpu_lowering']['policy']}")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  cfg_b = _config_from_flags()
  log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not _JSON.value else (
      lambda msg: None)
  result = run(cfg_b, log)
  print(json.dumps(result) if _JSON.value else _table(result))


if __name__ == "__main__":
  cli.run(main)
