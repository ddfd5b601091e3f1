"""Assembles a serving stack from a loaded model: page pool, scheduler, engine, loop, metrics.

Contract: ``build(step, params, tokenizer, ServingConfig, registry=None, *, decode=None,
kv_shards=1, max_traces=None, wrap_engine=None, fault_hook=None, restarts=True, draft=None)
-> ServingLoop``
(``step`` / ``decode`` / ``kv_shards`` from ``partitioning.deployment.make_steps``). One
``ServingConfig`` sizes the page pool (``kv_pages`` pages of ``page_size`` positions in
``kv_shards`` sub-pools), the scheduler and the engine, so they always agree; the prefix cache
(with session pinning) is on unless ``prefix_cache`` is False, ``host_tier_bytes`` gives it a
host tier, ``tpot_target_ms`` > 0 a TPOT-aware prefill budget, ``lora`` the LoRA adapters
served (``serving.lora``: the loop's ``loras`` registry, the scheduler's slots, the engine's),
``spec_tokens`` speculative decoding (n-gram lookup, or with a ``draft`` model its own engine:
``serving.draft_model``, warmed and sealed with the target's). Hooks are given here, never
assigned later: ``wrap_engine(engine)`` wraps the engine the loop drives (the multi-host
``serving.multihost.LeaderEngine``), ``fault_hook`` is the loop's (test-only fault injection),
``restarts`` lets the loop rebuild its scheduler after an internal error. ``warmup`` / ``ready``
close the program set; ``describe`` reads the loop's ``capacity()`` and the engine's plan.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import prometheus_client as prom

from models.step import PhaseDecode, Step
from models.text.tokenizer import Tokenizer
from models.weights import Params
from serving.step_cost import StepCostModel, tpot_prefill_limit
from serving.draft_model import DraftModel, build_draft
from serving.compiles import (ProgramCounter, map_count, mapping_warning, max_map_count,
                              trim_heap)
from serving.engine import Engine, EngineConfig
from serving.engine_api import EngineApi
from serving.guard import Guard
from serving.kv_manager import build_kv
from serving.kv_pages import page_budget
from serving.lifecycle import Metrics
from serving.loop import ServingLoop
from serving.host_tier import HostStore
from serving.sessions import SessionPolicy
from serving.scheduler import Scheduler, StepPlan
from serving.lora import LoraConfig, LoraSlots, build_registry
from serving.speculative import NgramProposer, Proposer, auto_max_rows, word_starts


@dataclasses.dataclass(frozen=True)
class ServingConfig:
  max_slots: int = 32  # decode batch rows
  page_size: int = 64  # measured choice (BUILD_NOTES.md "Paged KV")
  kv_pages: int = 512
  max_step_tokens: int = 512  # per-step token budget: bounds the step time, hence TPOT
  max_chunk: int = 256  # longest prefill chunk
  max_prefill_chunks: int = 4  # chunks per step (bounds the prefill programs to warm up)
  max_waiting: int = 1024
  max_context: int | None = None  # default: the model's
  kv_dtype: str | None = None  # default: the params' activation dtype
  lag: int = 1  # sampled ids reach the host one step behind
  prefix_cache: bool = True  # reuse cached KV pages of shared prefixes (serving.prefix_cache)
  session_idle_s: float = 300.0  # a paused session's KV stays pinned this long (serving.sessions)
  session_pages: int | None = None  # pinned-session page budget (default: a quarter of the pool)
  host_tier_bytes: int = 0  # host-memory tier for evicted prefix pages (0: none)
  attention_sinks: bool = False  # a sink pool: requests may ask for sinks + a window
  # TPOT-aware prefill budget (0: off): a step that decodes carries only the prefill tokens
  # the loop's fitted step-cost model says keep it within this many ms, but at least
  # min_prefill_tokens (serving.step_cost.tpot_prefill_limit).
  tpot_target_ms: float = 0.0
  min_prefill_tokens: int = 32
  pack_prefill: bool = True  # a step's chunks end to end (serving.engine): off is an A/B switch
  # Speculative decoding (serving.speculative): draft ids per decode row and step (0: off),
  # proposed by n-gram prompt lookup over suffixes of prompt_lookup_max down to
  # prompt_lookup_min ids, while at most spec_max_rows sequences decode (0: auto_max_rows(k));
  # those steps run synchronously (the loop flushes), the others at ``lag``.
  spec_tokens: int = 0
  spec_max_rows: int = 0
  prompt_lookup_max: int = 4
  prompt_lookup_min: int = 2
  lora: LoraConfig = LoraConfig()  # multi-LoRA serving (serving.lora; default: none)


def build(step: Step, params: Params, tokenizer: Tokenizer, config: ServingConfig,
          registry: prom.CollectorRegistry | None = None, *, decode: PhaseDecode | None = None,
          kv_shards: int = 1, max_traces: int | None = None,
          wrap_engine: Callable[[EngineApi], EngineApi] | None = None,
          fault_hook: Callable[[StepPlan], None] | None = None,
          restarts: bool = True, draft: DraftModel | None = None) -> ServingLoop:
  cfg = step.cfg
  context = min(config.max_context or cfg.max_seq_len, cfg.max_seq_len)
  kv_dtype = config.kv_dtype or jnp.dtype(params["final_norm"].dtype).name
  budget = page_budget(cfg, kv_dtype, config.page_size, num_pages=config.kv_pages,
                       num_shards=kv_shards)
  host_pages = config.host_tier_bytes // max(1, budget.bytes_per_page)
  store = HostStore() if config.prefix_cache and host_pages else None
  metrics = Metrics(registry or prom.CollectorRegistry())
  guard, cost_model = Guard(metrics.internal_errors), StepCostModel()

  spec_rows = config.spec_max_rows or auto_max_rows(config.spec_tokens)
  proposer: Proposer | None = None
  if draft is not None:
    if not config.spec_tokens:
      raise ValueError("a draft model needs num_speculative_tokens >= 1")
    proposer = build_draft(draft, k=config.spec_tokens, slots=spec_rows, context=context,
                           chunk=config.max_chunk, valid_vocab=tokenizer.vocab_size,
                           kv_dtype=jnp.dtype(draft.params["final_norm"].dtype).name)
  elif config.spec_tokens:
    proposer = NgramProposer(config.spec_tokens, config.prompt_lookup_max,
                             config.prompt_lookup_min, word_start=word_starts(tokenizer))
  loras, lora_slots = build_registry(cfg, config.lora)

  def make_scheduler() -> Scheduler:
    """A fresh KV manager (pool, prefix cache, sessions, host tier emptied) and scheduler (at
    start and on a loop restart)."""
    pins = SessionPolicy(config.session_idle_s, config.kv_pages // 4 if config.session_pages
                         is None else config.session_pages) if config.prefix_cache else None
    kv = build_kv(budget, context, prefix_cache=config.prefix_cache, host_store=store,
                  host_pages=host_pages, sessions=pins,
                  # Two pools: decode writes generated KV into its own, which prefill never
                  # reads, so only prompt pages (written by prefill) may be reused.
                  cache_generated=decode is None or decode.transfer is None)
    sched = Scheduler(kv, tokenizer, max_slots=config.max_slots,
                      max_step_tokens=config.max_step_tokens, max_chunk=config.max_chunk,
                      max_waiting=config.max_waiting, max_context=context,
                      max_prefill_chunks=config.max_prefill_chunks,
                      sinks=config.attention_sinks, proposer=proposer,
                      spec_max_rows=spec_rows,
                      loras=LoraSlots(lora_slots) if lora_slots else None)
    if config.tpot_target_ms > 0:  # a cost-model failure means no budget this step
      sched.prefill_limit = guard.wrap("cost_model", tpot_prefill_limit(
          cost_model, config.tpot_target_ms / 1e3, config.min_prefill_tokens))
    return sched

  engine = Engine(step, params, EngineConfig(
      max_slots=config.max_slots, num_pages=config.kv_pages, page_size=config.page_size,
      max_seq_tokens=context, kv_dtype=kv_dtype, valid_vocab=tokenizer.vocab_size,
      lag=config.lag, sinks=config.attention_sinks,
      pack_prefill=config.pack_prefill, spec_tokens=config.spec_tokens,
      spec_rows=spec_rows, max_loras=lora_slots),
      decode=decode, host_store=store, loras=loras)
  return ServingLoop(make_scheduler(), engine if wrap_engine is None else wrap_engine(engine),
                     metrics, max_traces=max_traces, fault_hook=fault_hook,
                     rebuild=make_scheduler if restarts else None, guard=guard,
                     cost_model=cost_model, loras=loras)


def warmup(loop: ServingLoop, threads: int | None = None) -> int:
  """Compiles every program the loop's plans can reach, ``threads`` at a time (None: the
  engine's default); returns how many."""
  c = loop.capacity()
  proposer = loop.scheduler.proposer
  return loop.engine.warmup(c.max_prefill_chunks, c.max_chunk, threads, c.max_step_tokens) + (
      proposer.warmup(threads) if proposer is not None else 0)


def ready(loop: ServingLoop, programs: ProgramCounter, maps_before: int | None,
          warmed: int) -> str | None:
  """Readiness: the program set is closed (the engine is sealed, ``programs`` marked, so any
  later load shows in ``phaseserve_programs_after_ready``); returns the start-up warning about
  memory mappings, if any (``serving.compiles.mapping_warning``). The C heap is trimmed."""
  loop.engine.seal()
  if loop.scheduler.proposer is not None:
    loop.scheduler.proposer.seal()
  programs.mark()
  trim_heap()  # the warm-up's temporaries: freed, but held by the C heap until trimmed
  return mapping_warning(maps_before, map_count(), warmed, max_map_count())


def describe(loop: ServingLoop) -> dict[str, object]:
  c = loop.capacity()
  return {"kv_pages": c.kv_pages, "page_size": c.page_size, "kv_bytes": c.kv_bytes,
          "max_slots": c.max_slots, "max_context": c.max_context,
          "max_step_tokens": c.max_step_tokens, "max_prefill_chunks": c.max_prefill_chunks,
          "prefix_cache": c.prefix_cache, "attention_sinks": c.attention_sinks,
          "host_tier_pages": c.host_tier_pages, "speculative": spec_describe(loop),
          "lora": lora_describe(loop),
          "step": loop.engine.describe()}


def lora_describe(loop: ServingLoop) -> dict[str, object] | None:
  """The LoRA adapters served (None: none)."""
  reg, slots = loop.loras, loop.scheduler.loras
  if reg is None or slots is None:
    return None
  return {"max_loras": slots.max_loras, "max_lora_rank": reg.max_rank,
          "max_cpu_loras": reg.max_cpu_loras, "adapters": [r.name for r in reg.names()]}


def spec_describe(loop: ServingLoop) -> dict[str, object] | None:
  """The scheduler's proposer (None: no speculative decoding)."""
  p = loop.scheduler.proposer
  return None if p is None else {**p.describe(), "max_rows": loop.scheduler.spec_max_rows}
