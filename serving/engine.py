"""The engine: runs the scheduler's ``StepPlan``s on the device over paged KV memory.

Contract (JetStream's shape, driven by ``serving.scheduler``'s plans):
  * ``Engine(step, params, EngineConfig)``: ``step`` is a ``models.step.Step`` (the unsharded
    model, or a partitioned step from ``partitioning/``); the engine never imports a model.
    Device state: the ``PagedKV`` pool (one page-table row per decode slot), each slot's last
    sampled id and its sampling parameters.
  * ``prefill(chunks, page_table)``: one jitted call over a ragged batch of prompt chunks (each
    continuing the KV its sequence already holds at ``chunk.start``); rows whose context ends
    sample their next id. ``insert`` is where a prefill layout's KV would be re-laid into the
    decode layout; with one layout (or one device) it is the identity and costs nothing.
  * ``generate(rows)``: one decode step over slots ``[0, n)`` (``n`` a power-of-two bucket
    covering the active slots; the scheduler keeps them compact), each active slot writing its
    last sampled id at its position and sampling the next.
  * ``release(slots)``: nothing to do on the device: the scheduler's ``PagePool`` owns pages and
    a freed slot's table row becomes the null page, so its stale KV is never read.
  * ``execute(plan) -> StepResult | None``: setups, page copies, the page table, then prefill
    and decode, all dispatched asynchronously; the sampled ids are copied to the host with
    ``copy_to_host_async``. With ``lag=1`` (the default) it returns the PREVIOUS step's
    result, so the host plans step n+1 while the device runs step n; ``lag=0`` returns this
    step's (tests). ``flush()`` returns what is held; ``reset()`` drops it (after a fault).
  * Sampling per slot: seed, temperature, top-k, top-p; a slot's key is
    ``fold_in(key(seed), position)``, so the ids do not depend on the batch (same as
    ``serving.generator``).
  * A partitioned step may shard the pool's page axis into ``step.kv_shards`` sub-pools (an
    optional attribute; absent = 1): a call's row ``r`` then runs on shard ``r // (R / n)`` and
    must hold pages of that shard only (``partitioning.paged_step``). The engine keeps its
    per-slot state (table, lengths, last ids, sampling) indexed by the scheduler's slot and
    arranges each call's rows by the shard of the slot's pages (read from the plan's page
    table), ``R = n * bucket(most rows on one shard)``; with one shard the rows are the slots
    ``[0, n)`` as before.
  * Two phases (optional ``decode=PhaseDecode(step, transfer)``): prefill runs ``step`` on its
    own pool and decode runs ``decode.step`` on another (another layout on the same mesh, or a
    disaggregated decode sub-mesh), each with its params placed by its step (the same arrays
    when the two steps' resident shardings are equal). ``insert`` then copies the pages of every
    sequence whose prompt just finished into the decode pool (``transfer(src_pool, dst_pool,
    ids, ids)``, same page ids: the host allocator's sub-pools must suit both steps) and its
    first sampled id into the decode slot state; fork copies run on both pools.
  * Host tier (optional ``host_store``, ``serving.host_tier``): a plan's ``spills`` are read
    from the device pool and copied to the host asynchronously before anything of the step
    runs (the copies are finished, their device buffers freed, at the start of the next
    ``execute`` whatever it plans), its ``loads`` written back onto their pages before the step
    reads them.
  * Host arrays reach the device with ``jax.device_put`` (``jnp.asarray`` of a numpy array
    compiles a small staging program per new shape, which would load programs while serving).
  * Shapes are bucketed (powers of two: prefill rows, chunk length, attended length, decode
    rows), so a new request reuses compiled programs; ``programs`` counts what was compiled.
    Where a phase's attention is the native kernel (``length_free[phase]``: its work follows
    each query's position), its attended length is always the cap: one program per (rows,
    chunk), not one per attended power of two (SmolLM2 defaults: 30 programs instead of 126; a
    sink pool's decode keeps the buckets).
    The model programs return logits; sampling runs in a program of its own per row count,
    where greedy-or-sampled and logprobs-or-not are run-time switches (``lax.cond``), not
    program variants, so the set is exactly ``buckets()``.
    ``warmup()`` compiles every bucket a plan can reach before serving by running each with all
    rows inactive (no state changes); ``seal()`` closes the set at readiness. After it, a model
    program outside the set runs as the smallest warmed one that covers it (more rows, a
    longer chunk or attended length; counted in ``covered``), and one nothing covers is logged
    and counted (``unwarmed``) and compiles.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.paged_kv import PagedKV, Pages, copy_pages, ring_entries
from models.step import PhaseDecode, Step
from models.transformer import bucket
from models.weights import Params
from serving.host_tier import HostStore
from serving.request import Sinks, TokenLogprobs
from serving.sampling import LOGPROBS_MAX, SamplingArrays, SamplingParams, logprobs_if, sample
from serving.scheduler import DecodeRow, PrefillChunk, StepPlan, StepResult

_log = logging.getLogger(__name__)


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

  @property
  def pages_per_seq(self) -> int:
    return -(-self.max_seq_tokens // self.page_size)


def _powers(lo: int, hi: int) -> list[int]:
  """Powers of two from ``lo`` up to ``hi``, and ``hi`` itself."""
  out, v = [], lo
  while v < hi:
    out.append(v)
    v *= 2
  return out + [hi]


def _rows(x: jax.Array, idx: jax.Array, fill) -> jax.Array:
  return x.at[idx].get(mode="fill", fill_value=fill)


def _sampling_rows(s: SamplingArrays, idx: jax.Array) -> SamplingArrays:
  return jax.tree.map(lambda a: _rows(a, idx, 0), s)


def _policy_rows(kv: PagedKV, idx: jax.Array) -> dict[str, jax.Array]:
  """A sink pool's per-slot sinks / window for the rows of a call (nothing otherwise)."""
  if kv.sinks is None:
    return {}
  return {"sinks": _rows(kv.sinks, idx, 0), "window": _rows(kv.window, idx, 0)}


_copy_call = jax.jit(copy_pages, donate_argnums=0)


@jax.jit
def _read_pages(kv: PagedKV, ids_N: jax.Array) -> tuple[Pages, Pages]:
  """K and V of pages ``ids_N`` (clipped; padding reads page 0): [L, N, K, Z, H] each (every
  leaf of ``Pages``: int8 values and their scales)."""
  ids_N = jnp.clip(ids_N, 0, kv.num_pages - 1)
  take = lambda a: a[:, ids_N]
  return jax.tree.map(take, kv.k_pages), jax.tree.map(take, kv.v_pages)


@jax.jit
def _write_pages(kv: PagedKV, ids_N: jax.Array, k: Pages, v: Pages) -> PagedKV:
  """Writes K / V [L, N, K, Z, H] into pages ``ids_N``; ids outside the pool are padding."""
  ids_N = jnp.where((ids_N >= 0) & (ids_N < kv.num_pages), ids_N, kv.num_pages)
  put = lambda a, x: a.at[:, ids_N].set(x.astype(a.dtype), mode="drop")
  return kv.replace(k_pages=jax.tree.map(put, kv.k_pages, k),
                    v_pages=jax.tree.map(put, kv.v_pages, v))


# The model's programs (prefill, decode) return logits; sampling is a program of its own, keyed
# only by the row count: a sampling or logprobs variant would otherwise multiply every model
# program (each XLA:CPU kernel costs ~3 memory mappings: BUILD_NOTES "Staying in service").
@functools.partial(jax.jit, static_argnames=("step", "attend_len"), donate_argnames=("kv",))
def _prefill_call(params: Params, kv: PagedKV, tokens_RT: jax.Array, slots_R: jax.Array,
                  start_R: jax.Array, lens_R: jax.Array, *, step: Step, attend_len: int):
  sub = kv.replace(page_table=_rows(kv.page_table, slots_R, kv.num_pages),
                   lengths=_rows(kv.lengths, slots_R, 0), **_policy_rows(kv, slots_R))
  logits_RV, sub = step.prefill(params, tokens_RT, sub, start_R, lens_R, attend_len=attend_len)
  kv = kv.replace(k_pages=sub.k_pages, v_pages=sub.v_pages,
                  lengths=kv.lengths.at[slots_R].set(sub.lengths, mode="drop"))
  return kv, logits_RV


@functools.partial(jax.jit, static_argnames=("step", "n", "attend_len"), donate_argnames=("kv",))
def _decode_call(params: Params, kv: PagedKV, last_S: jax.Array, slots_N: jax.Array,
                 pos_N: jax.Array, active_N: jax.Array, *, step: Step, n: int, attend_len: int):
  # Row i runs slot slots_N[i] (padding rows: slot max_slots, the null page, inactive).
  sub = kv.replace(page_table=_rows(kv.page_table, slots_N, kv.num_pages), lengths=pos_N,
                   **_policy_rows(kv, slots_N))
  logits_NV, sub = step.decode(params, _rows(last_S, slots_N, 0), sub, active_N,
                               attend_len=attend_len)
  keep_N = _rows(kv.lengths, slots_N, 0)
  lengths = kv.lengths.at[slots_N].set(jnp.where(active_N, sub.lengths, keep_N), mode="drop")
  return kv.replace(k_pages=sub.k_pages, v_pages=sub.v_pages, lengths=lengths), logits_NV


@functools.partial(jax.jit, static_argnames=("valid_vocab",), donate_argnames=("last_S",))
def _sample_call(logits_RV: jax.Array, last_S: jax.Array, samp: SamplingArrays,
                 slots_R: jax.Array, pos_R: jax.Array, take_R: jax.Array, want_lp: jax.Array, *,
                 valid_vocab: int):
  """Row r's next id from its logits (its slot's sampling, key position ``pos_R``); rows with
  ``take_R`` write it into their slot's last id, the others keep theirs (and return it);
  logprobs under the run-time switch ``want_lp``."""
  logits_RV = logits_RV[:, :valid_vocab]
  keep_R = _rows(last_S, slots_R, 0)
  tok_R = jnp.where(take_R, sample(logits_RV, pos_R, _sampling_rows(samp, slots_R),
                                   greedy_only=False), keep_R)
  return (last_S.at[slots_R].set(tok_R, mode="drop"), tok_R,
          logprobs_if(want_lp, logits_RV, tok_R, LOGPROBS_MAX))


def _to_host(a: jax.Array) -> np.ndarray:
  """The value of a step output on this process. Under several processes (``jax.distributed``)
  an output spans devices of other processes: a sharded one is first replicated over its own
  devices (a collective: every process reads the same outputs in the same order, since each
  runs the same plans), then read from a local copy. Every mesh spans every process
  (``partitioning.mesh.split_devices``), so each process holds a copy."""
  if a.is_fully_addressable:
    return np.asarray(a)
  if not a.sharding.is_fully_replicated:
    a = jax.device_put(a, jax.sharding.NamedSharding(a.sharding.mesh,
                                                     jax.sharding.PartitionSpec()))
  return np.asarray(a.addressable_shards[0].data)


LogprobArrays = tuple[jax.Array, jax.Array, jax.Array]  # chosen [B], top ids [B, n], top [B, n]
Row = tuple[str, int, int]  # (request id, row of the call, top-n logprobs it asked for)


def _want_lp(rows: Sequence[Row]) -> jax.Array:
  """The calls' traced logprobs switch: on when any sampled row asked for them."""
  return jax.device_put(np.bool_(any(k for _, _, k in rows)))


@dataclasses.dataclass
class _Part:
  ids: jax.Array
  rows: list[Row]
  lp: LogprobArrays | None = None


@dataclasses.dataclass
class _Pending:
  step: int
  parts: list[_Part]

  def result(self) -> StepResult:
    tokens: dict[str, int] = {}
    lps: dict[str, TokenLogprobs] = {}
    for part in self.parts:
      host = _to_host(part.ids)
      lp = None if part.lp is None or not any(k for _, _, k in part.rows) else \
          [_to_host(a) for a in part.lp]
      for rid, i, k in part.rows:
        tokens[rid] = int(host[i])
        if lp is not None and k:
          lps[rid] = TokenLogprobs(int(host[i]), float(lp[0][i]),
                                   tuple(zip(lp[1][i, :k].tolist(), lp[2][i, :k].tolist())))
    return StepResult(self.step, tokens, lps)


class Engine:
  """Executes plans; see the module contract."""

  def __init__(self, step: Step, params: Params, config: EngineConfig,
               decode: PhaseDecode | None = None, host_store: HostStore | None = None):
    self.step = step
    self.host_store = host_store
    self.decode = decode
    self.config = config
    self.params = step.place_params(params)
    if config.sinks and decode is not None:
      raise ValueError("attention sinks run on one pool (mode single); not disaggregated")
    self.kv = step.init_kv(config.max_slots, config.num_pages, config.page_size,
                           config.pages_per_seq, jnp.dtype(config.kv_dtype),
                           **({"sink_pool": True} if config.sinks else {}))
    self.last_S = jnp.zeros((config.max_slots,), jnp.int32)
    # Committed from the start, as every later step's outputs are: the warm-up's first program
    # would otherwise compile for uncommitted inputs and the first real step compile it again.
    self.kv = jax.tree.map(lambda a: jax.device_put(a, a.sharding), self.kv)
    self.last_S = jax.device_put(self.last_S, self.kv.lengths.sharding)
    self._samp_host = [SamplingParams()] * config.max_slots
    self._policy_host = np.zeros((2, config.max_slots), np.int32)  # sinks, window per slot
    self._samp = SamplingArrays.from_params(self._samp_host)
    self.valid_vocab = min(config.valid_vocab or step.cfg.vocab_size, step.cfg.vocab_size)
    self.kv_shards = int(getattr(step, "kv_shards", 1))
    dec = decode.step if decode else step
    self.decode_shards = int(getattr(dec, "kv_shards", 1))
    if config.num_pages % self.kv_shards or config.num_pages % self.decode_shards:
      raise ValueError(f"num_pages {config.num_pages} does not split into the steps' "
                       f"{self.kv_shards} / {self.decode_shards} kv shards")
    if decode:
      self.params_dec = dec.place_params(self.params)  # a no-op when the shardings are equal
      self.kv_dec = dec.init_kv(config.max_slots, config.num_pages, config.page_size,
                                config.pages_per_seq, jnp.dtype(config.kv_dtype))
      self.kv_dec = jax.tree.map(lambda a: jax.device_put(a, a.sharding), self.kv_dec)
      self._dec_sharding = self.kv_dec.lengths.sharding  # per-slot state on the decode chips
      self.last_dec = jax.device_put(jnp.zeros((config.max_slots,), jnp.int32),
                                     self._dec_sharding)
    # Per phase, whether attention's cost follows the positions (the native kernel): then one
    # attended length (the cap) per program, not a bucket per power of two.
    n = step.cfg.num_heads
    self.length_free = {"prefill": self.kv.native_attention(n, 2),
                        "decode": (self.kv_dec if decode else self.kv).native_attention(n, 1)}
    self._rings_only = self.kv.rings_only(n)  # a sink pool's decode attends the rings only
    self._table = np.full((config.max_slots, config.pages_per_seq), config.num_pages, np.int32)
    self._held: collections.deque[_Pending] = collections.deque()
    self._shapes: set[tuple] = set()
    self.sealed = False  # set by seal(): the program set is closed (readiness)
    self.unwarmed = 0  # dispatches after seal() of a program warm-up did not compile
    self.covered = 0  # after seal(), programs run as a larger warmed one (``_cover``)
    self._warm_logits: dict[tuple[str, int], jax.Array] = {}  # warm-up: for the samplers
    self.copied_pages = 0  # plan copies run, and the seconds they took
    self.copy_seconds = 0.0

  @property
  def programs(self) -> int:
    """Distinct bucketed programs dispatched so far (each compiled once)."""
    return len(self._shapes)

  # -- the engine contract ------------------------------------------------------------------

  def setup(self, slot: int, sampling: SamplingParams, sinks: Sinks | None = None) -> None:
    self._samp_host[slot] = sampling
    if sinks is not None and not self.config.sinks:
      raise ValueError("this engine's pool has no attention sinks (EngineConfig.sinks)")
    self._policy_host[:, slot] = (sinks.sinks, sinks.window) if sinks else (0, 0)

  def _push_policy(self) -> None:
    sharding = self.kv.lengths.sharding
    self.kv = self.kv.replace(sinks=jax.device_put(self._policy_host[0], sharding),
                              window=jax.device_put(self._policy_host[1], sharding))

  def _row_end(self, slot: int, end: int) -> int:
    """Positions a row's attention reads: a window row's ring once it has wrapped."""
    window = int(self._policy_host[1, slot])
    if not window:
      return end
    return min(end, ring_entries(window, self.config.page_size) * self.config.page_size)

  def prefill(self, chunks: Sequence[PrefillChunk]) -> "_Part":
    r, row_of = self._arrange([c.slot for c in chunks], self.kv_shards)
    t = bucket(max(len(c.token_ids) for c in chunks), minimum=16,
               maximum=self.config.max_seq_tokens)
    end = max(self._row_end(c.slot, c.start + len(c.token_ids)) for c in chunks)
    attend = self._attend(end, "prefill")
    _, r, t, attend = self._cover(("prefill", r, t, attend), pad_rows=self.kv_shards == 1)
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
    self._dispatch(("prefill", r, t, attend))
    slots_R, start_R, lens_R = jax.device_put(slots), jax.device_put(start), jax.device_put(lens)
    self.kv, logits_RV = _prefill_call(self.params, self.kv, jax.device_put(toks), slots_R,
                                       start_R, lens_R, step=self.step, attend_len=attend)
    self._dispatch(("sample", r, "prefill"))
    self.last_S, tok_R, lp = _sample_call(
        logits_RV, self.last_S, self._samp, slots_R, jax.device_put(start + lens),
        jax.device_put(want), _want_lp(rows), valid_vocab=self.valid_vocab)
    self.insert(chunks)
    return _Part(tok_R, rows, lp)

  def _cover(self, key: tuple, pad_rows: bool) -> tuple:
    """After ``seal()``, a model program warm-up did not compile runs as the smallest warmed one
    of its phase that covers it: as many rows or more (only where ``pad_rows``: one shard, so
    extra rows are inactive slots), a chunk and an attended length at least as long (padding
    is masked). Only a program nothing covers compiles while serving (``_dispatch``)."""
    if not self.sealed or key in self._shapes:
      return key
    fits = [k for k in self._shapes if k[0] == key[0] and len(k) == len(key)
            and all(a >= b for a, b in zip(k[1:], key[1:])) and (pad_rows or k[1] == key[1])]
    if not fits:
      return key
    best = min(fits, key=lambda k: (int(np.prod(k[1:])), k))
    self.covered += 1
    _log.warning("program %s was not compiled at warm-up: run as %s", key, best)
    return best

  def _dispatch(self, key: tuple) -> None:
    """Counts a program dispatch; after ``seal()`` one that warm-up did not compile is logged
    (and counted in ``unwarmed``): the closed set has a hole, XLA compiles it now."""
    if self.sealed and key not in self._shapes:
      self.unwarmed += 1
      _log.error("program %s was not compiled at warm-up: compiling it while serving", key)
    self._shapes.add(key)

  def insert(self, chunks: Sequence[PrefillChunk]) -> None:
    """One step and one pool: nothing to re-lay. Two phases: the pages of each sequence whose
    prompt is complete go to the decode pool (one transfer per sequence, all its table
    entries, null ones padding), with its first sampled id."""
    if self.decode is None:
      return
    done = [c.slot for c in chunks if c.sample]
    for slot in done:
      ids = self._table[slot]
      self.kv_dec = self.decode.transfer(self.kv, self.kv_dec, ids, ids)
    if done:
      mask = np.zeros((self.config.max_slots,), bool)
      mask[done] = True
      sharding = self._dec_sharding
      self.last_dec = jnp.where(jax.device_put(mask, sharding),
                                jax.device_put(self.last_S, sharding), self.last_dec)

  def generate(self, rows: Sequence[DecodeRow]) -> "_Part":
    shards = self.decode_shards
    if shards == 1:  # rows = slots [0, n): the scheduler keeps active slots compact
      n = min(bucket(max(r.slot for r in rows) + 1, minimum=1), self.config.max_slots)
      row_of = [r.slot for r in rows]
    else:
      n, row_of = self._arrange([r.slot for r in rows], shards, cap=self.config.max_slots)
    attend = self._attend(max((self._row_end(r.slot, r.position + 1) for r in rows
                               if not self._rings_only or self._policy_host[1, r.slot]),
                              default=1), "decode")
    _, n, attend = self._cover(("decode", n, attend), pad_rows=shards == 1)
    slots = np.full((n,), self.config.max_slots, np.int32)
    if shards == 1:
      slots[:] = np.arange(n)
    pos = np.zeros((n,), np.int32)
    active = np.zeros((n,), bool)
    for r, i in zip(rows, row_of):
      slots[i], pos[i], active[i] = r.slot, r.position, True
    out_rows = [(r.request_id, i, self._samp_host[r.slot].logprobs)
                for r, i in zip(rows, row_of)]
    self._dispatch(("decode", n, attend))
    self._dispatch(("sample", n, "decode"))
    slots_N, active_N = jax.device_put(slots), jax.device_put(active)
    rows_args = (slots_N, jax.device_put(pos), active_N)
    sample_args = (self._samp, slots_N, jax.device_put(pos + 1), active_N, _want_lp(out_rows))
    if self.decode is None:
      self.kv, logits_NV = _decode_call(self.params, self.kv, self.last_S, *rows_args,
                                        step=self.step, n=n, attend_len=attend)
      self.last_S, tok_N, lp = _sample_call(logits_NV, self.last_S, *sample_args,
                                            valid_vocab=self.valid_vocab)
    else:
      self.kv_dec, logits_NV = _decode_call(self.params_dec, self.kv_dec, self.last_dec,
                                            *rows_args, step=self.decode.step, n=n,
                                            attend_len=attend)
      self.last_dec, tok_N, lp = _sample_call(logits_NV, self.last_dec, *sample_args,
                                              valid_vocab=self.valid_vocab)
    return _Part(tok_N, out_rows, lp)

  def release(self, slots: Sequence[int]) -> None:
    """Nothing on the device (see the module contract)."""

  # -- warm-up ------------------------------------------------------------------------------

  def buckets(self, max_prefill_rows: int = 1, max_chunk: int | None = None
              ) -> list[tuple[str, int, int, int]]:
    """Every (phase, rows, chunk length (prefill) or 0, attended length) program the scheduler's
    plans can reach with at most ``max_prefill_rows`` chunks per step of at most ``max_chunk``
    tokens (decode rows: every power of two up to the slots), then the sampling programs of
    each row count (``sample_prefill`` / ``sample_decode``, chunk and attended length 0)."""
    cap = self.config.pages_per_seq * self.config.page_size
    attends = {p: sorted({self._attend(e, p) for e in _powers(1, cap)})
               for p in ("prefill", "decode")}
    chunk_cap = min(max_chunk or self.config.max_seq_tokens, self.config.max_seq_tokens)
    chunks = sorted({bucket(c, minimum=16, maximum=self.config.max_seq_tokens)
                     for c in _powers(1, chunk_cap)})
    out = []
    for r in sorted({bucket(n, minimum=1) for n in _powers(1, max_prefill_rows)}):
      for t in chunks:
        out += [("prefill", r * self.kv_shards, t, a) for a in attends["prefill"]
                if a >= min(t, cap) or a == attends["prefill"][-1]]
    for n in sorted({min(bucket(n, minimum=1), self.config.max_slots)
                     for n in _powers(1, self.config.max_slots)}):
      out += [("decode", n * (self.decode_shards if self.decode_shards > 1 else 1), 0, a)
              for a in attends["decode"]]
    rows = lambda phase: sorted({b[1] for b in out if b[0] == phase})
    return out + [(f"sample_{phase}", r, 0, 0) for phase in ("prefill", "decode")
                  for r in rows(phase)]

  def _warm_call(self, bucket: tuple) -> tuple[Callable, tuple, dict, str]:
    """The jitted call that runs ``bucket`` with every row inactive, on the current arrays:
    (function, args, kwargs, which state its outputs replace: "prefill" or "decode")."""
    phase, r, t, attend = bucket
    none = jnp.full((r,), self.config.max_slots, jnp.int32)  # out of range: null pages
    z = jax.device_put(np.zeros((r,), np.int32))
    if phase == "prefill":
      args = (self.params, self.kv, jnp.zeros((r, t), jnp.int32), none, z, z)
      return _prefill_call, args, dict(step=self.step, attend_len=attend), "prefill"
    if phase == "decode":
      kw = dict(n=r, attend_len=attend)
      if self.decode is None:
        return (_decode_call, (self.params, self.kv, self.last_S, none, z, z.astype(bool)),
                dict(kw, step=self.step), "prefill")
      return (_decode_call, (self.params_dec, self.kv_dec, self.last_dec, none, z,
                             z.astype(bool)), dict(kw, step=self.decode.step), "decode")
    # Sampling: on the logits a model program of the same rows left (``_warm_logits``).
    pool = "decode" if phase == "sample_decode" and self.decode is not None else "prefill"
    last = self.last_dec if pool == "decode" else self.last_S
    args = (self._warm_logits[(phase[len("sample_"):], r)], last, self._samp, none, z,
            z.astype(bool), _want_lp([]))
    return _sample_call, args, dict(valid_vocab=self.valid_vocab), pool

  def warmup(self, max_prefill_rows: int = 1, max_chunk: int | None = None,
             threads: int | None = None) -> int:
    """Compiles every program of ``buckets`` by running it with every row inactive, which
    changes no state.
    With ``threads`` > 1 (default: the CPU count, at most 4) the programs are first compiled
    side by side (``lower(...).compile()`` in a thread pool, which fills JAX's in-memory cache
    of executables), then each is run once: XLA:CPU compiles one program on about one core, so
    on 2 cores start-up is about 1.4x faster (BUILD_NOTES "Build and test").
    Returns the number of programs compiled."""
    before = len(self._shapes)
    buckets = list(self.buckets(max_prefill_rows, max_chunk))
    model = [b for b in buckets if b[0] in ("prefill", "decode")]
    if threads is None:
      threads = min(4, os.cpu_count() or 1)
    if threads > 1 and len(model) > 1:
      def compile_one(bucket: tuple) -> None:
        fn, args, kw, _ = self._warm_call(bucket)
        fn.lower(*args, **kw).compile()
      with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(compile_one, model))  # re-raises the first error
    for bucket in buckets:  # model programs first: the sampling ones run on their logits
      phase, r, t, attend = bucket
      self._shapes.add({"prefill": ("prefill", r, t, attend), "decode": ("decode", r, attend)}
                       .get(phase, ("sample", r, phase[len("sample_"):])))
      fn, args, kw, target = self._warm_call(bucket)
      out = fn(*args, **kw)
      if phase in ("prefill", "decode"):
        kv, self._warm_logits[(phase, r)] = out
        if target == "prefill":
          self.kv = kv
        else:
          self.kv_dec = kv
      elif target == "prefill":
        self.last_S = out[0]
      else:
        self.last_dec = out[0]
    self._warm_logits = {}
    extra = self._warm_host_tier() if self.host_store is not None else 0
    if max(self.kv_shards, self.decode_shards) > 1:  # prefix pages copied across sub-pools
      n = 1
      while n <= self._tier_cap:
        self._copy(jnp.zeros((n,), jnp.int32), jnp.full((n,), self.config.num_pages, jnp.int32))
        n, extra = n * 2, extra + (2 if self.decode is not None else 1)
    jax.block_until_ready(self.last_S)
    return len(self._shapes) - before + extra

  # -- one scheduler step -------------------------------------------------------------------

  def execute(self, plan: StepPlan) -> StepResult | None:
    if self.host_store is not None and self.host_store.pending:
      self.host_store.materialize()  # the last spills: host arrays now, device buffers freed
    if plan.setups:
      for s in plan.setups:
        self.setup(s.slot, s.sampling, s.sinks)
      self._samp = SamplingArrays.from_params(self._samp_host)
      if self.config.sinks:
        self._push_policy()
    if plan.spills or plan.forget or plan.loads:
      self._host_tier(plan)
    if plan.copies:  # rare (prefix pages into another sub-pool): timed, so it waits for them
      t0 = time.perf_counter()
      cap = self._tier_cap  # padded to powers of two up to a sequence's pages: warmed programs
      for g in range(0, len(plan.copies), cap):
        group = plan.copies[g:g + cap]
        src = np.zeros((bucket(len(group), minimum=1),), np.int32)
        dst = np.full(src.shape, self.config.num_pages, np.int32)  # padding copies nothing
        src[:len(group)] = [c.src for c in group]
        dst[:len(group)] = [c.dst for c in group]
        self._copy(jax.device_put(src), jax.device_put(dst))
      jax.block_until_ready(self.kv.k_pages)
      self.copy_seconds += time.perf_counter() - t0
      self.copied_pages += len(plan.copies)
    parts = []
    if not plan.empty:
      # Placed like the pool's own table (committed, same sharding): an uncommitted array would
      # be a different jit signature from the warm-up's and recompile every program once.
      self._table = np.asarray(plan.page_table, np.int32)
      self.kv = self.kv.replace(
          page_table=jax.device_put(self._table, self.kv.page_table.sharding))
      if self.decode is not None:
        self.kv_dec = self.kv_dec.replace(
            page_table=jax.device_put(self._table, self.kv_dec.page_table.sharding))
    if plan.decode:
      parts.append(self.generate(plan.decode))
    if plan.prefill:
      parts.append(self.prefill(plan.prefill))
    for part in parts:
      wanted = part.lp if any(k for _, _, k in part.rows) else ()
      for arr in (part.ids, *wanted):
        arr.copy_to_host_async()
    self._held.append(_Pending(plan.step, parts))
    if len(self._held) > self.config.lag:
      return self._held.popleft().result()
    return None

  def _host_tier(self, plan: StepPlan) -> None:
    """Spills (device -> host, started now, finished at the next step), forgets, then loads
    (host -> device), all on the prefill pool (the pool prefill reads; with two pools only
    prompt pages are cached, and the insert transfer carries loaded pages to decode's). Page
    counts are padded to powers of two (few programs)."""
    store = self.host_store
    cap = self._tier_cap
    for g in range(0, len(plan.spills), cap):
      group = plan.spills[g:g + cap]
      ids = np.zeros((bucket(len(group), minimum=1),), np.int32)
      ids[:len(group)] = [sp.page for sp in group]
      leaves = jax.tree.leaves(_read_pages(self.kv, jax.device_put(ids)))
      for i, sp in enumerate(group):
        parts = tuple(leaf[:, i] for leaf in leaves)  # K and V (int8: values and scales)
        for part in parts:
          part.copy_to_host_async()
        store.put(sp.key, parts)
    for key in plan.forget:
      store.discard(key)
    for g in range(0, len(plan.loads), cap):
      group = plan.loads[g:g + cap]
      n = bucket(len(group), minimum=1)
      ids = np.full((n,), self.config.num_pages, np.int32)
      ids[:len(group)] = [ld.page for ld in group]
      parts = [store.take(ld.key) for ld in group]
      leaves = []
      for j, first in enumerate(parts[0]):
        x = np.zeros((first.shape[0], n) + first.shape[1:], first.dtype)
        for i, page in enumerate(parts):
          x[:, i] = page[j]
        leaves.append(jax.device_put(x))
      k, v = jax.tree.unflatten(jax.tree.structure((self.kv.k_pages, self.kv.v_pages)), leaves)
      self.kv = _write_pages(self.kv, jax.device_put(ids), k, v)

  def _copy(self, src: jax.Array, dst: jax.Array) -> None:
    self.kv = _copy_call(self.kv, src, dst)
    if self.decode is not None:
      self.kv_dec = _copy_call(self.kv_dec, src, dst)

  @property
  def _tier_cap(self) -> int:
    """Pages per host-tier copy call: a sequence's worth (larger plans are split)."""
    return bucket(self.config.pages_per_seq, minimum=1)

  def _warm_host_tier(self) -> int:
    """Compiles the host tier's copies (every bucket up to ``_tier_cap``) without changing
    state: reads of page 0, writes to padding ids only."""
    n, count = 1, 0
    while n <= self._tier_cap:
      k, v = _read_pages(self.kv, jnp.zeros((n,), jnp.int32))
      self.kv = _write_pages(self.kv, jnp.full((n,), self.config.num_pages, jnp.int32), k, v)
      n, count = n * 2, count + 2
    return count

  def seal(self) -> None:
    """Readiness: every program a plan can reach is compiled; any other is a hole to report."""
    self.sealed = True

  def flush(self) -> list[StepResult]:
    out = [p.result() for p in self._held]
    self._held.clear()
    return out

  def reset(self) -> None:
    """Drops the results in flight (after a failed step: the scheduler has ended their
    sequences). Device state needs nothing: freed slots' table rows are the null page."""
    self._held.clear()

  def _arrange(self, slots: Sequence[int], shards: int, cap: int | None = None
               ) -> tuple[int, list[int]]:
    """(rows R, row of each slot): unsharded, rows 0..; else grouped by the shard of the slot's
    pages, ``R = shards * min(bucket(largest group), cap)`` (``cap``: the decode slots, whose
    buckets stop there, as ``buckets()`` does)."""
    if shards == 1:
      return bucket(len(slots), minimum=1), list(range(len(slots)))
    per_shard = self.config.num_pages // shards
    shard = []
    for s in slots:
      page = int(self._table[s, 0])
      if not 0 <= page < self.config.num_pages:
        raise ValueError(f"slot {s} holds no page: cannot place it on a kv shard")
      shard.append(page // per_shard)
    groups = collections.Counter(shard)
    r_s = bucket(max(groups.values()), minimum=1)
    if cap is not None:
      r_s = min(r_s, cap)
    seen: collections.Counter[int] = collections.Counter()
    row_of = []
    for sh in shard:
      row_of.append(sh * r_s + seen[sh])
      seen[sh] += 1
    return shards * r_s, row_of

  def _attend(self, end: int, phase: str) -> int:
    z = self.config.page_size
    cap = self.config.pages_per_seq * z
    if self.length_free[phase]:
      return cap
    a = bucket(end, minimum=max(16, z), maximum=cap)
    return min(-(-a // z) * z, cap)
