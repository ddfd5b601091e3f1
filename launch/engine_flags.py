"""The model, mesh and engine flags shared by the serving CLIs, and the stack they describe.

Contract: importing this module defines the flags once (``--model``, ``--quantize``,
``--int8_mode``, ``--dtype``, ``--param_seed``, ``--mode``, ``--fake_devices``,
``--prefill_devices``, ``--prefill_layout``, ``--decode_layout``, ``--hardware``, ``--calibration``,
``--warmup_threads``,
``--max_slots``, ``--page_size``, ``--kv_pages``, ``--max_step_tokens``, ``--max_chunk``,
``--max_prefill_chunks``, ``--tpot_target_ms``, ``--min_prefill_tokens``, ``--pack_prefill``,
``--max_context``,
``--prefix_cache``, ``--session_idle_s``,
``--session_pages``, ``--host_tier_bytes``, ``--kv_dtype``, ``--attention_sinks``,
``--scan_layers``, ``--compile_cache_dir``, speculative decoding's ``--num_speculative_tokens``,
``--speculative_max_rows``, ``--draft_model``, ``--draft_quantize``, ``--prompt_lookup_max`` /
``_min``, LoRA's ``--lora_modules``, ``--max_loras``, ``--max_lora_rank``, ``--max_cpu_loras``)
for ``launch.serve_offline`` and ``launch.server``.
``set_fake_devices()`` must run before JAX is imported. ``build(max_waiting, registry,
max_traces) -> Built`` loads the model, chooses the deployment (the planner's layouts unless
given) and assembles the serving loop, with JAX's persistent compilation cache on
(``launch.compile_cache``) before anything compiles and the CPU backend resolved once
(``resolve_backend``) and handed to the steps; user errors raise ``CliError``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from absl import flags, logging

from launch import compile_cache
from launch.cli import CliError

if TYPE_CHECKING:
  import prometheus_client as prom
  from models.config import ModelConfig
  from models.cpu.backend import CpuBackend
  from models.text.tokenizer import Tokenizer
  from serving.draft_model import DraftModel
  from partitioning.deployment import Steps
  from serving.loop import ServingLoop

MODEL = flags.DEFINE_string("model", "smollm2-135m", "a trained model, preset, .gguf or checkpoint")
QUANTIZE = flags.DEFINE_enum("quantize", "none", ["none", "int8"], "weight quantization")
INT8_MODE = flags.DEFINE_enum("int8_mode", None, ["weight_only", "w8a8"],
                              "int8 compute (default: models.precision's choice, weight_only)")
DTYPE = flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"],
                          "float param and activation dtype (auto: bfloat16 where the CPU computes "
                          "it natively or on an accelerator, else float32; launch/defaults.py)")
PARAM_SEED = flags.DEFINE_integer("param_seed", 0, "init seed for random presets")
MODE = flags.DEFINE_enum("mode", "interleaved", ["interleaved", "disaggregated"],
                         "prefill and decode on one mesh, or on two sub-meshes")
FAKE_DEVICES = flags.DEFINE_integer("fake_devices", 0,
                                    "split the CPU into N fake devices (tests, experiments)",
                                    lower_bound=0)
PREFILL_DEVICES = flags.DEFINE_integer("prefill_devices", None,
                                       "disaggregated: devices for prefill (default half)")
PREFILL_LAYOUT = flags.DEFINE_string("prefill_layout", None,
                                     "ffn:attn for prefill (default: the planner's choice)")
DECODE_LAYOUT = flags.DEFINE_string("decode_layout", None,
                                    "ffn:attn for decode (default: the planner's choice)")
HARDWARE = flags.DEFINE_string("hardware", "local", "cost-model hardware for the planner")
COLLECTIVE_MATMUL = flags.DEFINE_bool(
    "collective_matmul", False, "on a mesh: loop the weight-stationary layouts' (ws_1d, ws_2d) "
    "FFN all-gather and reduce-scatter into its matmuls (the paper's looped einsum; the planner "
    "costs it so)")
WARMUP_THREADS = flags.DEFINE_integer(
    "warmup_threads", 0, "programs the warm-up compiles side by side (0: the CPU count, at most 4)",
    lower_bound=0)
CALIBRATION = flags.DEFINE_string(
    "calibration", "auto", "the planner's calibration: a launch.lab.calibrate JSON; 'auto': the one "
    "installed for --hardware (launch.lab.calibrate --install), else the one shipped for it "
    "(tpu-v4), if any; 'none': uncalibrated")
MAX_SLOTS = flags.DEFINE_integer("max_slots", 0, "decode batch rows (0: 64, at most --kv_pages; "
                                 "launch/defaults.py)", lower_bound=0)
PAGE_SIZE = flags.DEFINE_integer("page_size", 64, "KV positions per page", lower_bound=1)
KV_PAGES = flags.DEFINE_integer("kv_pages", 512, "KV page budget", lower_bound=1)
STEP_TOKENS = flags.DEFINE_integer("max_step_tokens", 512, "token budget per step",
                                   lower_bound=1)
MAX_CHUNK = flags.DEFINE_integer("max_chunk", 256, "longest prefill chunk", lower_bound=1)
PREFILL_CHUNKS = flags.DEFINE_integer("max_prefill_chunks", 4,
                                      "prefill chunks per step (more: bigger prefill batches, "
                                      "more programs to warm up)", lower_bound=1)
TPOT_TARGET = flags.DEFINE_float("tpot_target_ms", 0.0,
                                 "TPOT-aware prefill budget: a step that decodes carries only "
                                 "the prefill tokens the measured step cost keeps within this "
                                 "(0: off; e.g. 30 for a 40 ms TPOT SLO at p99)", lower_bound=0.0)
PACK_PREFILL = flags.DEFINE_bool("pack_prefill", True,
                                  "pack a step's prefill chunks end to end where attention is the "
                                  "native kernel (an A/B switch: --nopack_prefill pads each chunk "
                                  "to the longest)")
MIN_PREFILL = flags.DEFINE_integer("min_prefill_tokens", 32,
                                   "prefill tokens a decoding step may always carry under "
                                   "--tpot_target_ms", lower_bound=1)
PREFIX_CACHE = flags.DEFINE_bool("prefix_cache", True, "reuse the KV pages of cached prefixes")
SESSION_IDLE = flags.DEFINE_float("session_idle_s", 300.0, "a paused session's KV stays pinned "
                                  "this long", lower_bound=0.001)
SESSION_PAGES = flags.DEFINE_integer("session_pages", None, "pinned-session KV page budget "
                                     "(default: a quarter of --kv_pages)", lower_bound=0)
HOST_TIER = flags.DEFINE_integer("host_tier_bytes", 0, "host-memory tier for KV pages the prefix "
                                 "cache evicts (0: none)", lower_bound=0)
KV_DTYPE = flags.DEFINE_enum("kv_dtype", "auto", ["auto", "float32", "bfloat16", "int8"],
                             "KV page dtype (auto: the activation dtype; int8: per-token, per-head "
                             "scales)")
SCAN = flags.DEFINE_bool("scan_layers", False, "mode single: one lax.scan over stacked layers "
                         "(compile time independent of depth; see BUILD_NOTES)")
SINKS = flags.DEFINE_bool("attention_sinks", False, "a sink KV pool: requests may ask for "
                          "attention sinks + a window (StreamingLLM; mode single only)")
COMPILE_CACHE = flags.DEFINE_string(
    "compile_cache_dir", None, "JAX's persistent compilation cache (default: "
    "~/.cache/phaseserve/jax/<this CPU>; '' turns it off; JAX_COMPILATION_CACHE_DIR wins)")
SPEC_TOKENS = flags.DEFINE_integer(
    "num_speculative_tokens", 0, "speculative decoding: draft ids (n-gram prompt lookup) "
    "verified per decode row and step (0: off)", lower_bound=0, upper_bound=16)
SPEC_MAX_ROWS = flags.DEFINE_integer(
    "speculative_max_rows", 0, "speculate only while at most this many sequences decode (0: "
    "while a step's verify call holds at most 20 tokens, where it was measured to pay)",
    lower_bound=0)
DRAFT_MODEL = flags.DEFINE_string(
    "draft_model", None, "speculative decoding: a draft model proposes the draft ids instead "
    "of n-gram lookup (a model name as --model; it must share the target's tokenizer; needs "
    "--num_speculative_tokens)")
DRAFT_QUANTIZE = flags.DEFINE_enum("draft_quantize", "none", ["none", "int8"],
                                   "the draft model's weight quantization")
LOOKUP_MAX = flags.DEFINE_integer("prompt_lookup_max", 4, "n-gram proposer: the longest "
                                  "suffix looked up in the context", lower_bound=1)
LOOKUP_MIN = flags.DEFINE_integer("prompt_lookup_min", 2, "n-gram proposer: the shortest "
                                  "suffix looked up anywhere (shorter ones count just ahead "
                                  "of the sequence's copy pointer)", lower_bound=1)
LORA_MODULES = flags.DEFINE_multi_string(
    "lora_modules", [], "LoRA adapters served beside the base model, name=path to a PEFT "
    "directory (adapter_config.json + adapter_model.safetensors); repeat or give several")
MAX_LORAS = flags.DEFINE_integer(
    "max_loras", 0, "LoRA adapters resident on the device at once (0: one per --lora_modules "
    "adapter, at most 4; give it to serve adapters loaded at run time only)", lower_bound=0)
MAX_LORA_RANK = flags.DEFINE_integer(
    "max_lora_rank", 0, "the device slots' LoRA rank (0: the largest --lora_modules adapter's, "
    "else 16)", lower_bound=0)
MAX_CPU_LORAS = flags.DEFINE_integer(
    "max_cpu_loras", 0, "LoRA adapters kept in host memory (0: at least --max_loras and every "
    "start-up adapter; others are read again from their files)", lower_bound=0)
MAX_CONTEXT = flags.DEFINE_integer("max_context", 2048,
                                   "longest prompt + output served (capped at the model's)",
                                   lower_bound=2)


@dataclasses.dataclass(frozen=True)
class Built:
  cfg: "ModelConfig"
  tokenizer: "Tokenizer"
  steps: "Steps"
  loop: "ServingLoop"
  mode: str
  dtype: str  # the float dtype run (``--dtype``, or what ``auto`` chose)
  defaults: str  # what the flags left at auto chose, and why ("" when none was)


def lora_modules(values: list[str]) -> tuple[tuple[str, str], ...]:
  """``--lora_modules`` as (name, path) pairs (``serving.lora.parse_modules``); ``CliError``."""
  from serving.lora import parse_modules
  try:
    return parse_modules(values)
  except ValueError as e:
    raise CliError(f"--lora_modules: {e}") from None


def resolve_defaults() -> tuple[str, int, str]:
  """(dtype, max_slots, why): ``--dtype`` / ``--max_slots`` as given, or ``launch.defaults``'
  choice for this machine, logged."""
  import jax
  from launch import defaults
  from models.cpu import cpuinfo
  why = []
  dtype = DTYPE.value
  if dtype == "auto":
    choice = defaults.choose_dtype(jax.default_backend(), cpuinfo.flags())
    dtype = str(choice.value)
    why.append(f"dtype {dtype}: {choice.reason}")
  slots = MAX_SLOTS.value
  if slots == 0:
    slots_choice = defaults.choose_slots(KV_PAGES.value)
    slots = int(slots_choice.value)
    why.append(f"max_slots {slots}: {slots_choice.reason}")
  if jax.process_count() > 1:  # process 0's choice everywhere: it decides the traced programs
    from partitioning.distributed import agree
    dtype, slots, why = agree("defaults", lambda: [dtype, slots, why])
  for line in why:
    logging.info("default %s", line)
  return dtype, slots, "; ".join(why)


def set_fake_devices() -> None:
  if FAKE_DEVICES.value:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={FAKE_DEVICES.value}")


def resolve_backend() -> "CpuBackend":
  """The XLA:CPU backend, once, before anything is traced (``models.cpu.backend.resolve``:
  native kernels and the lowering, cached or measured); under several processes, process 0's
  policy everywhere (measured, it could differ, and it decides the traced programs)."""
  import jax
  from models.cpu import backend as cpu_backend
  from models.cpu.lowering import CpuPolicy
  resolved = cpu_backend.resolve()
  backend = resolved.backend
  logging.info("cpu backend (%s): %s", resolved.choice.source, backend)
  if jax.process_count() > 1 and jax.default_backend() == "cpu":
    from partitioning.distributed import agree
    fields = agree("cpu_backend_policy", lambda: dataclasses.asdict(backend.policy))
    assert isinstance(fields, dict)
    backend = dataclasses.replace(backend, policy=CpuPolicy(**fields))
  return backend


def load_draft(tok: "Tokenizer", dtype, backend: "CpuBackend") -> "DraftModel":
  """``--draft_model`` on one device, in the target's dtype; ``CliError`` when it cannot serve
  as a draft (not loadable, another tokenizer, several processes)."""
  import jax
  from models.io.loader import load_model
  from models.step import UnshardedStep
  from serving.draft_model import DraftModel, check_tokenizers
  name = DRAFT_MODEL.value or ""
  if jax.process_count() > 1:
    raise CliError("--draft_model runs on one process")
  try:
    quantize, int8_mode = DRAFT_QUANTIZE.value, INT8_MODE.value
    cfg, params, draft_tok = load_model(name, dtype, PARAM_SEED.value,
                                        quantize=quantize,  # type: ignore[arg-type]  # an enum
                                        int8_mode=int8_mode)  # type: ignore[arg-type]  # an enum
    check_tokenizers(tok, draft_tok)
  except (ValueError, FileNotFoundError) as e:
    raise CliError(f"--draft_model: {e}")
  return DraftModel(UnshardedStep(cfg, False, backend), params,
                    name + (" (int8)" if DRAFT_QUANTIZE.value == "int8" else ""))


def build(max_waiting: int, registry: "prom.CollectorRegistry | None" = None,
          max_traces: int | None = None, *, wrap_engine=None, fault_hook=None,
          restarts: bool = True) -> Built:
  """``wrap_engine`` / ``fault_hook`` / ``restarts``: ``serving.stack.build``'s hooks."""
  import jax
  import jax.numpy as jnp
  from models.io.loader import load_config, load_model
  from serving.lora import LoraConfig
  from serving import stack
  from partitioning.deployment import Deployment, check_multiprocess, make_steps
  cache = compile_cache.configure(COMPILE_CACHE.value)
  logging.info("compilation cache: %s", cache or "off")
  backend = resolve_backend()
  dtype_name, max_slots, why = resolve_defaults()
  dtype = jnp.float32 if dtype_name == "float32" else jnp.bfloat16
  try:
    cfg = load_config(MODEL.value)  # the steps first: the params are made in their shardings
  except (ValueError, FileNotFoundError) as e:
    raise CliError(str(e))
  mode = MODE.value
  if mode == "interleaved" and jax.device_count() == 1:
    mode = "single"
  try:
    config = stack.ServingConfig(
        max_slots=max_slots, page_size=PAGE_SIZE.value, kv_pages=KV_PAGES.value,
        max_step_tokens=STEP_TOKENS.value, max_chunk=MAX_CHUNK.value,
        max_prefill_chunks=PREFILL_CHUNKS.value, max_waiting=max_waiting,
        max_context=min(MAX_CONTEXT.value, cfg.max_seq_len), prefix_cache=PREFIX_CACHE.value,
        session_idle_s=SESSION_IDLE.value, session_pages=SESSION_PAGES.value,
        host_tier_bytes=HOST_TIER.value,
        kv_dtype=None if KV_DTYPE.value == "auto" else KV_DTYPE.value,
        attention_sinks=SINKS.value, tpot_target_ms=TPOT_TARGET.value,
        min_prefill_tokens=MIN_PREFILL.value, pack_prefill=PACK_PREFILL.value,
        spec_tokens=SPEC_TOKENS.value, spec_max_rows=SPEC_MAX_ROWS.value,
        prompt_lookup_max=LOOKUP_MAX.value, prompt_lookup_min=LOOKUP_MIN.value,
        lora=LoraConfig(lora_modules(LORA_MODULES.value), MAX_LORAS.value, MAX_LORA_RANK.value,
                        MAX_CPU_LORAS.value))
    deployment = Deployment(mode,  # type: ignore[arg-type]  # an enum flag: one of the modes
                            PREFILL_LAYOUT.value, DECODE_LAYOUT.value,
                            PREFILL_DEVICES.value, HARDWARE.value, SCAN.value,
                            CALIBRATION.value, COLLECTIVE_MATMUL.value)
    check_multiprocess(deployment, HOST_TIER.value)
    steps = make_steps(cfg, deployment,
                       max_slots=config.max_slots, max_chunk=config.max_chunk,
                       max_context=config.max_context or cfg.max_seq_len,
                       quantized=QUANTIZE.value == "int8",
                       backend=backend)
  except (ValueError, OSError) as e:  # OSError: an unreadable --calibration file
    raise CliError(str(e))
  try:
    cfg, params, tok = load_model(MODEL.value, dtype, PARAM_SEED.value,
                                  # enum flags: their values are the Literals' own
                                  quantize=QUANTIZE.value,  # type: ignore[arg-type]
                                  int8_mode=INT8_MODE.value,  # type: ignore[arg-type]  # an enum flag
                                  shardings=steps.step.param_sharding,
                                  stack_layers=steps.step.stacked_params)
  except (ValueError, FileNotFoundError) as e:
    raise CliError(str(e))
  draft = load_draft(tok, dtype, backend) if DRAFT_MODEL.value else None
  try:
    loop = stack.build(steps.step, params, tok, config, registry, decode=steps.decode,
                       kv_shards=steps.kv_shards, max_traces=max_traces,
                       wrap_engine=wrap_engine, fault_hook=fault_hook, restarts=restarts,
                       draft=draft)
  except ValueError as e:
    raise CliError(str(e))
  return Built(cfg, tok, steps, loop, mode, dtype_name, why)
