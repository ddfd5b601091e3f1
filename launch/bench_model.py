"""Model speed on this machine: prefill tokens/s and MFU, decode ms/step and bandwidth use.

  python -m launch.bench_model --model small --json
  python -m launch.bench_model --model small --json --dtype float32 --quantize int8 \
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
The KV cache content does not change the cost of a step, so decode rows start from a cache whose
lengths are set to ``--context`` (no prefill is run for them). Every figure is the median of
``--repeats`` timed calls after a compile/warm-up call (``best`` is the fastest). Int8 uses
``quantize(..., act_quant=True)`` on CPU (W8A8; see ``models/quant.py``) and weight-only int8
elsewhere, as ``launch/generate.py`` does.

``--json`` prints one JSON object (else a table): {"model", "date", "machine", "jax_version",
"hardware": {"matmul_peak_flops": {dtype: FLOP/s}, "read_bandwidth": B/s}, "prefill": [...],
"decode": [...], "summary": {...}, "wall_s"}. Bad flags exit with code 2 and a one-line error.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time

from absl import flags, logging

from launch import cli
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "small", "model preset name")
_DTYPE = flags.DEFINE_list("dtype", ["float32", "bfloat16"],
                           "float param / activation dtypes to measure (float32, bfloat16)")
_QUANTIZE = flags.DEFINE_enum("quantize", "both", ["none", "int8", "both"],
                              "float weights, int8 weights, or both")
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



@dataclasses.dataclass(frozen=True)
class BenchConfig:
  model: str = "small"
  dtypes: tuple[str, ...] = ("float32", "bfloat16")
  quantize: str = "both"  # none | int8 | both
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
  if _MODEL.value not in PRESET_NAMES or _MODEL.value.startswith("palm"):
    raise CliError(f"--model must be an instantiable preset (tiny, small), got {_MODEL.value!r}")
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
      bandwidth_mb=_BANDWIDTH_MB.value, param_seed=_PARAM_SEED.value)


def _timed(fn, repeats: int) -> tuple[float, float]:
  """(median, best) seconds of ``fn()`` over ``repeats`` calls after one warm-up call."""
  fn()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), min(times)


def _machine() -> dict:
  import jax
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  dev = jax.devices()[0]
  info = {"platform": dev.platform, "device_kind": dev.device_kind, "cpu": cpu,
          "cpu_count": os.cpu_count(), "devices": jax.device_count()}
  if hasattr(os, "getloadavg"):
    info["load_avg_1m"] = round(os.getloadavg()[0], 2)
  return info


def _weight_bytes(params, cfg) -> int:
  """Bytes of every matmul weight a decode step reads (not the embedding lookup table)."""
  import jax
  total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
  if not cfg.tie_embeddings:
    total -= sum(leaf.nbytes for leaf in jax.tree.leaves(params["embed"]))
  return int(total)


def _param_sets(cfg, cfg_b: BenchConfig):
  """Yields (dtype name, quantize name, params) for every requested combination."""
  import jax
  import jax.numpy as jnp
  from models.weights import init_params, quantize

  on_cpu = jax.default_backend() == "cpu"
  for name in cfg_b.dtypes:
    dtype = jnp.float32 if name == "float32" else jnp.bfloat16
    params = jax.jit(init_params, static_argnums=(0, 2))(
        cfg, jax.random.key(cfg_b.param_seed), dtype)
    if cfg_b.quantize in ("none", "both"):
      yield name, "none", params
    if cfg_b.quantize in ("int8", "both"):
      q = jax.jit(lambda p: quantize(p, cfg, act_quant=on_cpu))(params)
      del params
      yield name, "int8", q
    else:
      del params


def _prefill(cfg, params, dtype_name: str, quant: str, b: int, t: int, cfg_b: BenchConfig
             ) -> dict:
  """One prefill shape; "mfu" is filled in by ``run`` once the peaks are final."""
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
  state = {"cache": init_cache(cfg, b, cache_len, dtype)}

  def call():  # every call prefills the prompt from position 0 (the cache is reused, donated)
    cache = state["cache"].replace(lengths=jnp.zeros((b,), jnp.int32))
    tok, state["cache"] = prefill_and_sample(params, toks, cache, lens, s, cfg=cfg,
                                             attend_len=cache_len, greedy_only=True)
    jax.block_until_ready(tok)

  med, best = _timed(call, cfg_b.repeats)
  # int8 W8A8 on CPU multiplies int8 x int8; everything else runs in the activation dtype.
  int8_dot = quant == "int8" and jax.default_backend() == "cpu"
  peak_dtype = "int8" if int8_dot else dtype_name
  flops, flops_causal = _prefill_flops(cfg, b, t)
  return {"dtype": dtype_name, "quantize": quant, "batch": b, "tokens": t,
          "batch_tokens": b * t, "seconds": med, "best_seconds": best,
          "tokens_per_s": b * t / med, "flops_per_token": cfg.flops_per_token(t),
          "flops": flops, "flops_per_s": flops / med, "flops_causal": flops_causal,
          "flops_causal_per_s": flops_causal / med, "peak_dtype": peak_dtype}


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


def _decode(cfg, params, dtype_name: str, quant: str, b: int, cfg_b: BenchConfig) -> dict:
  """One decode batch; the bandwidth bound is filled in by ``run`` once bandwidth is final."""
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
  state = {"cache": init_cache(cfg, b, cache_len, dtype), "tok": jnp.zeros((b,), jnp.int32)}

  def call():
    cache = state["cache"].replace(lengths=jnp.full((b,), ctx, jnp.int32))
    out, state["cache"] = decode_n(params, state["tok"], cache, s, cfg=cfg, n=n,
                                   attend_len=attend_len, greedy_only=True)
    jax.block_until_ready(out)

  med, best = _timed(call, cfg_b.repeats)
  itemsize = jnp.dtype(dtype).itemsize
  kv_bytes = 2 * cfg.num_layers * b * cfg.num_kv_heads * attend_len * cfg.head_dim * itemsize
  w_bytes = _weight_bytes(params, cfg)
  step = med / n
  return {"dtype": dtype_name, "quantize": quant, "batch": b, "context": ctx,
          "attend_len": attend_len, "steps": n, "ms_per_step": step * 1e3,
          "best_ms_per_step": best / n * 1e3, "tokens_per_s": b / step,
          "weight_bytes": w_bytes, "kv_bytes": kv_bytes, "bytes_per_step": w_bytes + kv_bytes}


def _summary(prefill: list[dict], decode: list[dict]) -> dict:
  out: dict = {}
  float1 = [d for d in decode if d["batch"] == 1 and d["quantize"] == "none"]
  int81 = [d for d in decode if d["batch"] == 1 and d["quantize"] == "int8"]
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
  from models.config import get_preset
  from partitioning.hardware import measure_matmul_peak, measure_read_bandwidth

  t_start = time.perf_counter()
  load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
  cfg = get_preset(cfg_b.model)
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
  prefill, decode = [], []
  for dtype_name, quant, params in _param_sets(cfg, cfg_b):
    for b, t in cfg_b.prefill_shapes():
      r = _prefill(cfg, params, dtype_name, quant, b, t, cfg_b)
      log(f"prefill {dtype_name}/{quant} {b}x{t}: {r['tokens_per_s']:.0f} tok/s")
      prefill.append(r)
    for b in cfg_b.decode_batches:
      r = _decode(cfg, params, dtype_name, quant, b, cfg_b)
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
  for d in decode:
    bound = d["bytes_per_step"] / bandwidth
    step = d["ms_per_step"] / 1e3
    d.update(bound_ms=bound * 1e3, x_of_bound=step / bound, bw_util=bound / step)
  return {
      "model": cfg.name, "param_count": cfg.param_count(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "machine": _machine(), "jax_version": jax.__version__,
      "config": dataclasses.asdict(cfg_b),
      "hardware": {"matmul_peak_flops": peaks, "read_bandwidth": bandwidth,
                   "peak_size": cfg_b.peak_size,
                   "start": {"matmul_peak_flops": peaks_start, "read_bandwidth": bw_start},
                   "end": {"matmul_peak_flops": peaks_end, "read_bandwidth": bw_end}},
      "load_avg_1m_start": load_start,
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
  lines.append("decode   dtype     quant  batch  ms/step   tok/s  x bound")
  for d in result["decode"]:
    lines.append(f"         {d['dtype']:9s} {d['quantize']:6s} {d['batch']:5d} "
                 f"{d['ms_per_step']:8.2f} {d['tokens_per_s']:7.0f}  {d['x_of_bound']:5.2f}")
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
