"""The engine: runs the scheduler's ``StepPlan``s on the device over paged KV memory.

Contract (an ``serving.engine_api.EngineApi``): ``Engine(step, params, EngineConfig, decode=None,
host_store=None)``; ``step`` is a ``models.step.Step`` (the engine never imports a model).
  * One ``serving.engine_pool.Pool`` serves both phases, or with ``decode=PhaseDecode(step,
    transfer)`` decode has its own, which receives each finished prompt's pages and first id.
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
  * Speculative decoding (``spec_tokens``; lag 0, one packing pool): a step whose decode rows
    carry draft ids runs them as one verify call (``serving.spec_verify``), the rows with
    penalties, a grammar or logprobs as a plain decode beside it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import time
from typing import Any, Sequence

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
from serving.engine_shapes import (ProgramSet, arrange, decode_rows, pack, packed, packed_sizes,
                                   powers)
from serving.grammar_rows import GrammarRows
from serving import host_moves
from serving.host_tier import HostStore
from serving.penalties import fill_slot, warm_penalties
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

  @property
  def pages_per_seq(self) -> int:
    return -(-self.max_seq_tokens // self.page_size)


class Engine(EngineApi):
  """Executes plans; see the module contract."""

  def __init__(self, step: Step, params: Params, config: EngineConfig,
               decode: PhaseDecode | None = None, host_store: HostStore | None = None):
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
    # Decode params placed from the prefill ones as stored (no-op for equal shardings).
    self.decode_pool = self.prefill_pool if decode is None else \
        pool(decode.step, untile(self.prefill_pool.params))
    self.transfer: Transfer | None = None if decode is None else decode.transfer
    self.pools = [self.prefill_pool] + ([self.decode_pool] if decode is not None else [])
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
    if config.spec_tokens and (not self.packed or decode or config.lag or config.sinks):
      raise ValueError("speculative decoding needs lag 0 and one pool that packs prefill (one "
                       "kv shard, the native attention kernel, no attention sinks)")
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

  def setup(self, slot: int, sampling: SamplingParams, sinks: Sinks | None = None) -> None:
    self._samp_host[slot] = sampling
    if sinks is not None and not self.config.sinks:
      raise ValueError("this engine's pool has no attention sinks (EngineConfig.sinks)")
    self._policy_host[:, slot] = (sinks.sinks, sinks.window) if sinks else (0, 0)

  def _push_policy(self) -> None:
    pool = self.prefill_pool  # a sink pool is the only pool
    sharding = pool.kv.lengths.sharding
    pool.kv = pool.kv.replace(sinks=jax.device_put(self._policy_host[0], sharding),
                              window=jax.device_put(self._policy_host[1], sharding))

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
                                      step=pool.step, attend_len=attend)
    return self._sample_prefill(chunks, logits_RV, slots, start + lens, want, want_lp(rows),
                                rows)

  def _prefill_packed(self, chunks: Sequence[PrefillChunk]) -> Part:
    """The chunks' tokens end to end in one row of ``N = packed(total)`` tokens (no padding to
    the longest chunk); logits rows ``R``: at least the warm-up's (one sampling program)."""
    pool = self.prefill_pool
    r = max(bucket(len(chunks), minimum=1), self._prefill_rows)
    cap = self._attend(1, "prefill")  # packed implies the native kernel: the cap, length-free
    _, r, n, attend = self.program_set.cover(
        ("prefill", r, packed(sum(len(c.token_ids) for c in chunks)), cap), pad_rows=True)
    p = pack(chunks, n, r, self.config.max_slots)
    rows = [(c.request_id, j, self._samp_host[c.slot].logprobs)
            for j, c in enumerate(chunks) if c.sample]
    self.program_set.dispatch(("prefill", r, n, attend))
    pool.kv, logits_RV = packed_call(pool.params, pool.kv, p.tokens_N, p.slot_N, p.pos_N,
                                     p.slots_R, p.end_R, p.last_R, step=pool.step,
                                     attend_len=attend)
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
                                     step=pool.step, n=n, attend_len=attend)
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
    n = verify_tokens(len(rows), sum(len(r.draft) for r in rows))
    _, n, attend = self.program_set.cover(("verify", n, self._attend(1, "decode")),
                                          pad_rows=True)
    a = pack_verify(rows, n, self.config.max_slots)
    self.program_set.dispatch(("verify", n, attend))
    pool.kv, pool.last_X, tok_R, acc_R = verify_call(
        pool.params, pool.kv, pool.last_X, self._samp, a.tokens_N, a.first_N, a.slot_N,
        a.pos_N, a.next_N, a.slots_R, a.start_R, a.k_R, step=pool.step, attend_len=attend,
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

  # -- warm-up ------------------------------------------------------------------------------

  def buckets(self, max_prefill_rows: int = 1, max_chunk: int | None = None,
              max_tokens: int | None = None) -> list[tuple[str, int, int, int]]:
    """Every (phase, rows, chunk length (prefill) or 0, attended length) program the scheduler's
    plans can reach with at most ``max_prefill_rows`` chunks per step of at most ``max_chunk``
    tokens, ``max_tokens`` in all (packed: one logits row count, every ``packed`` size up to
    the most tokens a step's chunks hold; decode rows: every power of two up to the slots), then
    the sampling programs of each row count (``sample_prefill`` / ``sample_decode``, chunk and
    attended length 0)."""
    cap = self.config.pages_per_seq * self.config.page_size
    attends = {p: sorted({self._attend(e, p) for e in powers(1, cap)})
               for p in ("prefill", "decode")}
    chunk_cap = min(max_chunk or self.config.max_seq_tokens, self.config.max_seq_tokens)
    out = []
    if self.packed:
      most = max_prefill_rows * chunk_cap if max_tokens is None else min(
          max_tokens, max_prefill_rows * chunk_cap)
      out += [("prefill", bucket(max_prefill_rows, minimum=1), n, attends["prefill"][-1])
              for n in packed_sizes(most)]
    else:
      chunks = sorted({bucket(c, minimum=16, maximum=self.config.max_seq_tokens)
                       for c in powers(1, chunk_cap)})
      for r in sorted({bucket(n, minimum=1) for n in powers(1, max_prefill_rows)}):
        for t in chunks:
          out += [("prefill", r * self.prefill_pool.shards, t, a) for a in attends["prefill"]
                  if a >= min(t, cap) or a == attends["prefill"][-1]]
    one = self.decode_pool.shards == 1  # more shards: a power of two a shard (arrange)
    for n in sorted({decode_rows(n, self.config.max_slots) if one
                     else min(bucket(n, minimum=1), self.config.max_slots)
                     for n in range(1, self.config.max_slots + 1)}):
      out += [("decode", n * self.decode_pool.shards, 0, a) for a in attends["decode"]]
    rows = lambda phase: sorted({b[1] for b in out if b[0] == phase})
    spec = self.config.spec_tokens  # verify calls: every token count up to spec_rows' drafts
    verify = [("verify", v, 0, attends["decode"][-1]) for v in powers(4, verify_tokens(
        self.config.spec_rows, self.config.spec_rows * spec))] if spec else []
    return out + [(f"sample_{phase}", r, 0, 0) for phase in ("prefill", "decode")
                  for r in rows(phase)] + verify

  def _warm_call(self, bucket: tuple) -> tuple[Any, tuple, dict, Pool]:
    """The jitted call that runs ``bucket`` with every row inactive, on the current arrays:
    (function, args, kwargs, the pool whose state its outputs replace)."""
    phase, r, t, attend = bucket
    # Host arrays, as ``execute`` passes them (the same jit signature).
    none_R = np.full((r,), self.config.max_slots, np.int32)  # out of range: null pages
    z_R = np.zeros((r,), np.int32)
    if phase == "prefill" and self.packed:  # t tokens, every one padding
      pool = self.prefill_pool
      none_N = np.full((t,), self.config.max_slots, np.int32)
      args: tuple = (pool.params, pool.kv, np.zeros((t,), np.int32), none_N,
                     np.full((t,), -1, np.int32), none_R, z_R, z_R)
      return packed_call, args, dict(step=pool.step, attend_len=attend), pool
    if phase == "prefill":
      pool = self.prefill_pool
      args = (pool.params, pool.kv, np.zeros((r, t), np.int32), none_R, z_R, z_R)
      return prefill_call, args, dict(step=pool.step, attend_len=attend), pool
    if phase == "decode":
      pool = self.decode_pool
      args = (pool.params, pool.kv, pool.last_X, none_R, z_R, z_R.astype(bool))
      return decode_call, args, dict(step=pool.step, n=r, attend_len=attend), pool
    if phase == "verify":  # r tokens, every one padding
      pool, v = self.decode_pool, pack_verify([], r, self.config.max_slots)
      args = (pool.params, pool.kv, pool.last_X, self._samp, v.tokens_N, v.first_N, v.slot_N,
              v.pos_N, v.next_N, v.slots_R, v.start_R, v.k_R)
      return verify_call, args, dict(step=pool.step, attend_len=attend, k=self.config.spec_tokens,
                                     valid_vocab=self.valid_vocab), pool
    # Sampling: on the logits a model program of the same rows left (``_warm_logits``).
    pool = self.decode_pool if phase == "sample_decode" else self.prefill_pool
    args = (self._warm_logits[(phase[len("sample_"):], r)], pool.last_X, pool.pen, self._samp,
            none_R, z_R, z_R.astype(bool), want_lp([]), *self._masks([], r))
    return sample_call, args, dict(valid_vocab=self.valid_vocab), pool

  def warmup(self, max_prefill_rows: int = 1, max_chunk: int | None = None,
             threads: int | None = None, max_tokens: int | None = None) -> int:
    """Compiles every program of ``buckets`` by running it with every row inactive (no state
    changes). With ``threads`` > 1 (default: the CPU count, at most 4) the model programs are
    first compiled side by side (``lower(...).compile()`` in a thread pool), then each is run
    once. Returns the number of programs compiled."""
    before = self.program_set.count
    self._prefill_rows = bucket(max_prefill_rows, minimum=1)
    buckets = list(self.buckets(max_prefill_rows, max_chunk, max_tokens))
    model = [b for b in buckets if b[0] in ("prefill", "decode", "verify")]
    if threads is None:
      threads = min(4, os.cpu_count() or 1)
    if threads > 1 and len(model) > 1:
      def compile_one(key: tuple) -> None:
        fn, args, kw, _ = self._warm_call(key)
        fn.lower(*args, **kw).compile()
      with concurrent.futures.ThreadPoolExecutor(threads) as executor:
        list(executor.map(compile_one, model))  # re-raises the first error
    for key in buckets:  # model programs first: the sampling ones run on their logits
      phase, r, t, attend = key
      self.program_set.shapes.add(
          {"prefill": ("prefill", r, t, attend), "decode": ("decode", r, attend),
           "verify": ("verify", r, attend)}
          .get(phase, ("sample", r, phase[len("sample_"):])))
      fn, args, kw, pool = self._warm_call(key)
      out = fn(*args, **kw)
      if phase in ("prefill", "decode"):
        pool.kv, self._warm_logits[(phase, r)] = out
      elif phase == "verify":
        pool.kv, pool.last_X = out[:2]
      else:
        pool.last_X, pool.pen = out[:2]
    self._warm_logits = {}
    extra = 0
    if self.host_store is not None:
      pool = self.prefill_pool
      pool.kv, extra = host_moves.warm(pool.kv, self._tier_cap, self.config.num_pages)
    for pool in self.pools:  # the penalty state's programs (a second pool's: count_first too)
      pool.pen = warm_penalties(pool.pen, pool.last_X if pool is not self.prefill_pool else None)
    extra += len(self.pools) + (self.transfer is not None)
    if max(p.shards for p in self.pools) > 1:  # prefix pages copied across sub-pools
      for pool in self.pools:
        pool.kv, count = host_moves.warm_copies(pool.kv, self._tier_cap, self.config.num_pages)
        extra += count
    jax.block_until_ready(self.prefill_pool.last_X)
    return self.program_set.count - before + extra

  def seal(self) -> None:
    """Readiness: every program a plan can reach is compiled; any other is a hole to report."""
    self.program_set.seal()

  # -- one scheduler step -------------------------------------------------------------------

  def execute(self, plan: StepPlan) -> StepResult | None:
    if self.host_store is not None and self.host_store.pending:
      self.host_store.materialize()  # the last spills: host arrays now, device buffers freed
    if plan.setups:
      for s in plan.setups:
        self.setup(s.slot, s.sampling, s.sinks)
        self.grammar.setup(s.slot, s.request_id, s.sampling.grammar, s.output_ids)
        for pool in self.pools if s.sampling.penalized else ():
          pool.pen = fill_slot(pool.pen, s.slot, s.prompt_ids, s.output_ids)
      self._samp = SamplingArrays.from_params(self._samp_host)
      if self.config.sinks:
        self._push_policy()
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
