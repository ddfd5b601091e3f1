"""The engine: runs the scheduler's ``StepPlan``s on the device over paged KV memory.

Contract (an ``serving.engine_api.EngineApi``): ``Engine(step, params, EngineConfig, decode=None,
host_store=None)``; ``step`` is a ``models.step.Step`` (the engine never imports a model).
  * One ``serving.engine_pool.Pool`` serves both phases, or with ``decode=PhaseDecode(step,
    transfer)`` decode has its own, which receives each finished prompt's pages and first id;
    ``PhaseDecode(step)`` (no transfer): decode runs its own program over the one pool.
  * ``execute(plan)``: setups, host-tier spills / loads, page copies, the page table, decode and
    prefill, dispatched asynchronously; returns the result ``lag`` steps back. A slot samples
    with ``fold_in(key(seed), position)``, independent of the batch.
  * A step's ``kv_shards``: row ``r`` of a call runs on shard ``r // (R / n)`` and holds pages of
    that shard only; rows are arranged by the shard of each slot's pages.
  * ``packed``: where prefill attention is the native kernel on one kv shard, a step's chunks
    run end to end (a token a row, ``engine_calls.packed_call``), else as ``[R, T]`` rows padded
    to the longest chunk.
  * Shapes are bucketed (powers of two; one shard's decode rows also 24, a packed prefill's
    tokens four sizes an octave; the cap where attention is the native kernel);
    ``warmup()`` runs every bucket with all rows inactive, ``seal()`` closes the set
    (``serving.engine_shapes``). A step's small host arrays go to the jitted calls as numpy
    (the warm-up passes numpy too: one signature; ``jax.device_put`` of a tuple costs ~0.15 ms
    of Python, the C++ path of a numpy argument ~3 us). Letters:
    ``models/config.py``.
  * Structured outputs: a constrained slot's matcher (``serving.grammar_rows``) masks its
    sampling; its last ids are read before the mask is filled, while the model runs.
  * Speculative decoding (``spec_tokens``; one packing pool): a step whose decode rows carry
    draft ids runs them as one verify call (``serving.spec_verify``), the rows with penalties,
    a grammar or logprobs as a plain decode beside it. A lagged engine's driver flushes each
    step while the scheduler is ``synchronous`` (the next drafts need this step's ids).
  * LoRA adapters (``max_loras`` device slots, ``loras`` the registry; one unsharded pool):
    ``serving.engine_lora.DeviceLoras`` fills slots from the plan's ``lora_loads`` and every
    model call takes each row's adapter from its slot's setup. The warm-up is
    ``serving.engine_warmup``'s.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

import jax
import numpy as np

from models.paged_kv import ring_entries
from models.step import PhaseDecode, Step, Transfer
from models.transformer import bucket
from models.weights import Params, untile
from serving.engine_api import EngineApi
from serving.engine_pool import Pool
from serving.engine_calls import (Part, Pending, decode_call, packed_call,
                                  prefill_call, sample_call, want_lp)
from serving.engine_lora import DeviceLoras
from serving.engine_shapes import ProgramSet, arrange, decode_rows, pack, packed
from serving.engine_warmup import EngineWarmup
from serving.grammar_rows import GrammarRows
from serving import host_moves
from serving.host_tier import HostStore
from serving.lora import LoraRegistry
from serving.penalties import fill_slot
from serving.request import Sinks
from serving.sampling import SamplingArrays, SamplingParams
from serving.scheduler import DecodeRow, PrefillChunk, StepPlan, StepResult
from serving.spec_verify import pack_verify, verify_call, verify_tokens
from serving.speculative import verifiable


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  max_slots: int
  num_pages: int
  page_size: int
  max_seq_tokens: int
  kv_dtype: str = "float32"
  valid_vocab: int | None = None  # sample only ids below this (a tokenizer smaller than V)
  lag: int = 1
  sinks: bool = False  # a sink pool: slots may run the attention-sink policy
  pack_prefill: bool = True  # pack a step's chunks where attention allows (see Engine.packed)
  # Speculative decoding (serving.spec_verify): the most draft ids a decode row carries (0: off)
  # and the most rows a verify call holds (its warmed sizes).
  spec_tokens: int = 0
  spec_rows: int = 8
  max_loras: int = 0  # LoRA adapters resident on the device at once (0: none served)
  min_packed: int = 16  # a packed prefill's fewest tokens (engine_shapes.packed's floor)

  @property
  def pages_per_seq(self) -> int:
    return -(-self.max_seq_tokens // self.page_size)


class Engine(EngineWarmup, EngineApi):
  """Executes plans; see the module contract."""

  def __init__(self, step: Step, params: Params, config: EngineConfig,
               decode: PhaseDecode | None = None, host_store: HostStore | None = None,
               loras: LoraRegistry | None = None):
    if config.sinks and decode is not None:
      raise ValueError("attention sinks run on one pool (mode single); not disaggregated")
    self.config = config
    self.host_store = host_store
    self.valid_vocab = min(config.valid_vocab or step.cfg.vocab_size, step.cfg.vocab_size)

    def pool(step: Step, params: Params, sinks: bool = False) -> Pool:
      return Pool.create(step, params, slots=config.max_slots, num_pages=config.num_pages,
                         page_size=config.page_size, pages_per_seq=config.pages_per_seq,
                         kv_dtype=config.kv_dtype, vocab=self.valid_vocab, sinks=sinks)
    self.prefill_pool = pool(step, params, config.sinks)
    self.transfer: Transfer | None = None if decode is None else decode.transfer
    self.decode_step: Step = step if decode is None else decode.step  # its program's layout
    # Decode params placed from the prefill ones as stored (no-op for equal shardings).
    self.decode_pool = self.prefill_pool if self.transfer is None else \
        pool(self.decode_step, untile(self.prefill_pool.params))
    self.pools = [self.prefill_pool] + ([self.decode_pool] if self.transfer else [])
    if any(config.num_pages % p.shards for p in self.pools):
      raise ValueError(f"num_pages {config.num_pages} does not split into the steps' "
                       f"{' / '.join(str(p.shards) for p in self.pools)} kv shards")
    self._samp_host = [SamplingParams()] * config.max_slots
    self._policy_host = np.zeros((2, config.max_slots), np.int32)  # sinks, window per slot
    self._samp = SamplingArrays.from_params(self._samp_host)
    # Per phase, whether attention's cost follows the positions (the native kernel): then one
    # attended length (the cap) per program, not a bucket per power of two.
    n = step.cfg.num_heads
    self.length_free = {"prefill": self.prefill_pool.kv.native_attention(n, 2),
                        "decode": self.decode_pool.kv.native_attention(n, 1)}
    self._rings_only = self.prefill_pool.kv.rings_only(n)  # a sink pool's decode: rings only
    # Prefill packed (chunks end to end, a token a row) where attention reads each token's own
    # table row at its own position: the native kernel on one kv shard.
    self.packed = (config.pack_prefill and self.prefill_pool.shards == 1
                   and self.prefill_pool.kv.native_attention(n, 1))
    self._prefill_rows = 1  # a packed call's logits rows, at least (warm-up: the plans' most)
    if config.spec_tokens and (not self.packed or decode or config.sinks):
      raise ValueError("speculative decoding needs one pool that packs prefill (one kv shard, "
                       "the native attention kernel, no attention sinks)")
    if config.max_loras and (decode or loras is None or self.prefill_pool.shards > 1):
      raise ValueError("LoRA adapters need a registry and one unsharded pool")
    self.lora = DeviceLoras.create(
        step.cfg, loras, slots=config.max_loras, max_slots=config.max_slots,
        dtype=self.prefill_pool.params["final_norm"].dtype,
        sharding=self.prefill_pool.kv.lengths.sharding) if config.max_loras and loras else None
    self._table_XM = np.full((config.max_slots, config.pages_per_seq), config.num_pages,
                             np.int32)
    self._held: collections.deque[Pending] = collections.deque()
    self.grammar = GrammarRows(self.valid_vocab)  # structured outputs' matchers and masks
    self.program_set = ProgramSet()
    self._warm_logits: dict[tuple[str, int], jax.Array] = {}  # warm-up: for the samplers
    self.copied_pages = 0  # plan copies run, and the seconds they took
    self.copy_seconds = 0.0

  @property
  def programs(self) -> int:
    """Distinct bucketed programs dispatched so far (each compiled once)."""
    return self.program_set.count

  @property
  def lag(self) -> int:
    return self.config.lag

  def describe(self) -> dict[str, object]:
    return self.prefill_pool.step.describe()

  # -- one call per phase -------------------------------------------------------------------

  def setup(self, slot: int, sampling: SamplingParams, sinks: Sinks | None = None,
            lora: int = -1) -> None:
    self._samp_host[slot] = sampling
    if self.lora is not None:
      self.lora.setup(slot, lora)
    elif lora >= 0:
      raise ValueError("this engine serves no LoRA adapters (EngineConfig.max_loras)")
    if sinks is not None and not self.config.sinks:
      raise ValueError("this engine's pool has no attention sinks (EngineConfig.sinks)")
    self._policy_host[:, slot] = (sinks.sinks, sinks.window) if sinks else (0, 0)

  def _push_policy(self) -> None:
    pool = self.prefill_pool  # a sink pool is the only pool
    sharding = pool.kv.lengths.sharding
    # Copies: on CPU a numpy argument may be read in place after a later setup changed it.
    pool.kv = pool.kv.replace(sinks=jax.device_put(self._policy_host[0].copy(), sharding),
                              window=jax.device_put(self._policy_host[1].copy(), sharding))

  def _row_end(self, slot: int, end: int) -> int:
    """Positions a row's attention reads: a window row's ring once it has wrapped."""
    window = int(self._policy_host[1, slot])
    if not window:
      return end
    return min(end, ring_entries(window, self.config.page_size) * self.config.page_size)

  def _arrange(self, slots: Sequence[int], shards: int, cap: int | None = None
               ) -> tuple[int, list[int]]:
    return arrange(slots, self._table_XM, self.config.num_pages, shards, cap)

  def prefill(self, chunks: Sequence[PrefillChunk]) -> Part:
    if self.packed:
      return self._prefill_packed(chunks)
    pool = self.prefill_pool
    r, row_of = self._arrange([c.slot for c in chunks], pool.shards)
    t = bucket(max(len(c.token_ids) for c in chunks), minimum=16,
               maximum=self.config.max_seq_tokens)
    end = max(self._row_end(c.slot, c.start + len(c.token_ids)) for c in chunks)
    attend = self._attend(end, "prefill")
    _, r, t, attend = self.program_set.cover(("prefill", r, t, attend), pad_rows=pool.shards == 1)
    toks = np.zeros((r, t), np.int32)
    slots = np.full((r,), self.config.max_slots, np.int32)
    start = np.zeros((r,), np.int32)
    lens = np.zeros((r,), np.int32)
    want = np.zeros((r,), bool)
    for c, i in zip(chunks, row_of):
      toks[i, :len(c.token_ids)] = c.token_ids
      slots[i], start[i], lens[i], want[i] = c.slot, c.start, len(c.token_ids), c.sample
    rows = [(c.request_id, i, self._samp_host[c.slot].logprobs)
            for c, i in zip(chunks, row_of) if c.sample]
    self.program_set.dispatch(("prefill", r, t, attend))
    pool.kv, logits_RV = prefill_call(pool.params, pool.kv, toks, slots, start, lens,
                                      self._loras(), step=pool.step, attend_len=attend)
    return self._sample_prefill(chunks, logits_RV, slots, start + lens, want, want_lp(rows),
                                rows)

  def _prefill_packed(self, chunks: Sequence[PrefillChunk]) -> Part:
    """The chunks' tokens end to end in one row of ``N = packed(total)`` tokens (no padding to
    the longest chunk); logits rows ``R``: at least the warm-up's (one sampling program)."""
    pool = self.prefill_pool
    r = max(bucket(len(chunks), minimum=1), self._prefill_rows)
    cap = self._attend(1, "prefill")  # packed implies the native kernel: the cap, length-free
    _, r, n, attend = self.program_set.cover(
        ("prefill", r, packed(sum(len(c.token_ids) for c in chunks), self.config.min_packed), cap),
        pad_rows=True)
    p = pack(chunks, n, r, self.config.max_slots)
    rows = [(c.request_id, j, self._samp_host[c.slot].logprobs)
            for j, c in enumerate(chunks) if c.sample]
    self.program_set.dispatch(("prefill", r, n, attend))
    pool.kv, logits_RV = packed_call(pool.params, pool.kv, p.tokens_N, p.slot_N, p.pos_N,
                                     p.slots_R, p.end_R, p.last_R, self._loras(),
                                     step=pool.step, attend_len=attend)
    return self._sample_prefill(chunks, logits_RV, p.slots_R, p.end_R, p.want_R,
                                want_lp(rows), rows)

  def _sample_prefill(self, chunks: Sequence[PrefillChunk], logits_RV: jax.Array,
                      slots_R: np.ndarray, end_R: np.ndarray, want_R: np.ndarray,
                      lp_on: np.bool_, rows: list) -> Part:
    """Each chunk's next id (rows ``want_R``: a prompt's last chunk) from its logits."""
    pool = self.prefill_pool
    self.program_set.dispatch(("sample", end_R.shape[0], "prefill"))
    pool.last_X, pool.pen, tok_R, lp = sample_call(
        logits_RV, pool.last_X, pool.pen, self._samp, slots_R, end_R, want_R, lp_on,
        *self._masks([(rid, int(slots_R[i]), i) for rid, i, _ in rows], end_R.shape[0]),
        valid_vocab=self.valid_vocab)
    self.insert(chunks)
    return Part(tok_R, rows, lp)

  def insert(self, chunks: Sequence[PrefillChunk]) -> None:
    """One pool: nothing to re-lay. Two: each sequence whose prompt is complete moves to the
    decode pool (``Pool.receive``)."""
    done = [c.slot for c in chunks if c.sample]
    if self.transfer is not None and done:
      self.decode_pool.receive(self.prefill_pool, done, self._table_XM, self.transfer,
                               np.array([p.penalized for p in self._samp_host]))

  def generate(self, rows: Sequence[DecodeRow]) -> Part:
    pool = self.decode_pool
    shards = pool.shards
    if shards == 1:  # rows packed in plan order (slots free and refill in any order)
      n = decode_rows(len(rows), self.config.max_slots)
      row_of = list(range(len(rows)))
    else:
      n, row_of = self._arrange([r.slot for r in rows], shards, cap=self.config.max_slots)
    attend = self._attend(max((self._row_end(r.slot, r.position + 1) for r in rows
                               if not self._rings_only or self._policy_host[1, r.slot]),
                              default=1), "decode")
    _, n, attend = self.program_set.cover(("decode", n, attend), pad_rows=shards == 1)
    slots = np.full((n,), self.config.max_slots, np.int32)  # padding rows: the null slot
    pos = np.zeros((n,), np.int32)
    active = np.zeros((n,), bool)
    for r, i in zip(rows, row_of):
      slots[i], pos[i], active[i] = r.slot, r.position, True
    out_rows = [(r.request_id, i, self._samp_host[r.slot].logprobs)
                for r, i in zip(rows, row_of)]
    self.program_set.dispatch(("decode", n, attend))
    self.program_set.dispatch(("sample", n, "decode"))
    pool.kv, logits_RV = decode_call(pool.params, pool.kv, pool.last_X, slots, pos, active,
                                     self._loras(), step=self.decode_step, n=n,
                                     attend_len=attend)
    pool.last_X, pool.pen, tok_R, lp = sample_call(
        logits_RV, pool.last_X, pool.pen, self._samp, slots, pos + 1, active, want_lp(out_rows),
        *self._masks([(r.request_id, r.slot, i) for r, i in zip(rows, row_of)], n),
        valid_vocab=self.valid_vocab)
    return Part(tok_R, out_rows, lp)

  def _decode(self, rows: Sequence[DecodeRow]) -> list[Part]:
    """Plain decode; with draft ids, a verify call of the rows it computes fully (no penalties,
    bias, grammar or logprobs: the scheduler drafts only for those), a plain decode of the rest."""
    if not any(r.draft for r in rows):
      return [self.generate(rows)]
    rest = [r for r in rows if not verifiable(self._samp_host[r.slot])]
    assert not any(r.draft for r in rest), "a draft for a row the verify call cannot compute"
    return [self._verify([r for r in rows if verifiable(self._samp_host[r.slot])])] + (
        [self.generate(rest)] if rest else [])

  def _verify(self, rows: Sequence[DecodeRow]) -> Part:
    pool = self.decode_pool
    n = verify_tokens(len(rows), sum(len(r.draft) for r in rows), self.config.spec_tokens,
                      self.config.spec_rows)
    _, n, attend = self.program_set.cover(("verify", n, self._attend(1, "decode")),
                                          pad_rows=True)
    a = pack_verify(rows, n, self.config.max_slots)
    self.program_set.dispatch(("verify", n, attend))
    pool.kv, pool.last_X, tok_R, acc_R = verify_call(
        pool.params, pool.kv, pool.last_X, self._samp, a.tokens_N, a.first_N, a.slot_N,
        a.pos_N, a.next_N, a.slots_R, a.start_R, a.k_R, self._loras(), step=self.decode_step,
        attend_len=attend,
        valid_vocab=self.valid_vocab, k=self.config.spec_tokens)
    return Part(tok_R, [(r.request_id, i, 0) for i, r in enumerate(rows)], acc=acc_R,
                drafts=[r.draft for r in rows])

  def _masks(self, rows: list[tuple[str, int, int]], n: int) -> tuple[np.ndarray, np.ndarray]:
    """A sampling call's structured-output masks for (request id, slot, row) ``rows``: the
    steps in flight are read first, while the device runs this step's model."""
    if self.grammar.active and self.grammar.constrained([(rid, slot) for rid, slot, _ in rows]):
      for p in self._held:
        self._accept(p)
      got = self.grammar.masks(rows, n)
      if got is not None:
        return got
    return self.grammar.none(n)

  def _attend(self, end: int, phase: str) -> int:
    z = self.config.page_size
    cap = self.config.pages_per_seq * z
    if self.length_free[phase]:
      return cap
    a = bucket(end, minimum=max(16, z), maximum=cap)
    return min(-(-a // z) * z, cap)

  # -- one scheduler step -------------------------------------------------------------------

  def execute(self, plan: StepPlan) -> StepResult | None:
    if self.host_store is not None and self.host_store.pending:
      self.host_store.materialize()  # the last spills: host arrays now, device buffers freed
    if plan.setups:
      for s in plan.setups:
        self.setup(s.slot, s.sampling, s.sinks, s.lora)
        self.grammar.setup(s.slot, s.request_id, s.sampling.grammar, s.output_ids)
        for pool in self.pools if s.sampling.penalized else ():
          pool.pen = fill_slot(pool.pen, s.slot, s.prompt_ids, s.output_ids)
      self._samp = SamplingArrays.from_params(self._samp_host)
      if self.config.sinks:
        self._push_policy()
    if plan.lora_loads:
      assert self.lora is not None, "adapter loads for an engine without LoRA slots"
      self.lora.load(plan.lora_loads)
    if plan.spills or plan.forget or plan.loads:
      assert self.host_store is not None, "a plan with host-tier moves needs a host_store"
      self.prefill_pool.kv = host_moves.run(self.host_store, self.prefill_pool.kv, plan,
                                            self._tier_cap, self.config.num_pages)
    if plan.copies:  # rare (prefix pages into another sub-pool): timed, so it waits for them
      t0 = time.perf_counter()
      for pool in self.pools:
        pool.kv = host_moves.copy(pool.kv, plan.copies, self._tier_cap, self.config.num_pages)
      jax.block_until_ready(self.prefill_pool.kv.k_pages)
      self.copy_seconds += time.perf_counter() - t0
      self.copied_pages += len(plan.copies)
    parts = []
    if not plan.empty:
      # Placed like the pool's own table (committed, same sharding): an uncommitted array would
      # be a different jit signature from the warm-up's and recompile every program once.
      table_XM = np.asarray(plan.page_table, np.int32)
      if not np.array_equal(table_XM, self._table_XM):  # most decode steps allocate no page
        self._table_XM = table_XM
        for pool in self.pools:
          pool.kv = pool.kv.replace(
              page_table=jax.device_put(table_XM, pool.kv.page_table.sharding))
    if plan.decode:
      parts += self._decode(plan.decode)
    if plan.prefill:
      parts.append(self.prefill(plan.prefill))
    for part in parts:
      wanted = part.lp if part.lp is not None and any(k for _, _, k in part.rows) else ()
      for arr in (part.ids, *wanted, *(() if part.acc is None else (part.acc,))):
        arr.copy_to_host_async()
    self._held.append(Pending(plan.step, parts))
    if len(self._held) > self.config.lag:
      return self._result(self._held.popleft())
    return None

  def _result(self, p: Pending) -> StepResult:
    self._accept(p)
    return p.result()

  def _accept(self, p: Pending) -> None:
    if not p.accepted and self.grammar.active:
      self.grammar.accept(p.result().tokens)
    p.accepted = True

  def read_pages(self, pages: Sequence[int]) -> tuple[np.ndarray, ...]:
    return host_moves.read(self.prefill_pool.kv, pages, self._tier_cap)

  @property
  def _tier_cap(self) -> int:
    """Pages per host-tier copy call: a sequence's worth (larger plans are split)."""
    return bucket(self.config.pages_per_seq, minimum=1)

  def flush(self) -> list[StepResult]:
    out = [self._result(p) for p in self._held]
    self._held.clear()
    return out

  def reset(self) -> None:
    """Drops the results in flight (after a failed step: the scheduler has ended their
    sequences). Device state needs nothing: freed slots' table rows are the null page."""
    self._held.clear()
