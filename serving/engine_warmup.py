"""The engine's warm-up: every program a plan can reach, compiled and run before readiness.

Contract: ``EngineWarmup`` is the part of ``serving.engine.Engine`` that lists the bucketed
programs (``buckets``), compiles and runs each with every row inactive (``warmup``: no state
changes) and closes the set (``seal``: any later program is a hole the ``ProgramSet``
reports). It reads the engine's pools, config and shape rules, declared below. Letters:
``models/config.py``.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any

import jax
import numpy as np

from models.transformer import bucket
from serving import host_moves
from serving.engine_calls import decode_call, packed_call, prefill_call, sample_call, want_lp
from serving.engine_lora import DeviceLoras, SlotLoras
from serving.engine_pool import Pool
from serving.engine_shapes import ProgramSet, decode_rows, packed_sizes, powers
from serving.penalties import warm_penalties
from serving.sampling import SamplingArrays
from serving.spec_verify import pack_verify, verify_call, verify_sizes


class EngineWarmup:
  """See the module contract; ``Engine`` sets these and defines the shape rules."""
  config: Any  # serving.engine.EngineConfig
  packed: bool
  prefill_pool: Pool
  decode_pool: Pool
  decode_step: Any  # models.step.Step
  pools: list[Pool]
  transfer: Any
  host_store: Any
  program_set: ProgramSet
  valid_vocab: int
  lora: DeviceLoras | None
  _samp: SamplingArrays
  _prefill_rows: int
  _warm_logits: dict[tuple[str, int], jax.Array]

  def _attend(self, end: int, phase: str) -> int:
    raise NotImplementedError

  def _masks(self, rows: list[tuple[str, int, int]], n: int) -> tuple[np.ndarray, np.ndarray]:
    raise NotImplementedError

  @property
  def _tier_cap(self) -> int:
    raise NotImplementedError

  def _loras(self) -> SlotLoras | None:
    return None if self.lora is None else self.lora.batch()

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
              for n in packed_sizes(most, self.config.min_packed)]
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
    spec = self.config.spec_tokens  # verify calls: the sizes that hold spec_rows' drafts
    verify = [("verify", v, 0, attends["decode"][-1])
              for v in verify_sizes(spec, self.config.spec_rows)] if spec else []
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
                     np.full((t,), -1, np.int32), none_R, z_R, z_R, self._loras())
      return packed_call, args, dict(step=pool.step, attend_len=attend), pool
    if phase == "prefill":
      pool = self.prefill_pool
      args = (pool.params, pool.kv, np.zeros((r, t), np.int32), none_R, z_R, z_R,
              self._loras())
      return prefill_call, args, dict(step=pool.step, attend_len=attend), pool
    if phase == "decode":
      pool = self.decode_pool
      args = (pool.params, pool.kv, pool.last_X, none_R, z_R, z_R.astype(bool), self._loras())
      return decode_call, args, dict(step=self.decode_step, n=r, attend_len=attend), pool
    if phase == "verify":  # r tokens, every one padding
      pool, v = self.decode_pool, pack_verify([], r, self.config.max_slots)
      args = (pool.params, pool.kv, pool.last_X, self._samp, v.tokens_N, v.first_N, v.slot_N,
              v.pos_N, v.next_N, v.slots_R, v.start_R, v.k_R, self._loras())
      return verify_call, args, dict(step=self.decode_step, attend_len=attend,
                                     k=self.config.spec_tokens,
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
    if self.lora is not None:  # the program that fills an adapter slot
      self.lora.warm()
      extra += 1
    if max(p.shards for p in self.pools) > 1:  # prefix pages copied across sub-pools
      for pool in self.pools:
        pool.kv, count = host_moves.warm_copies(pool.kv, self._tier_cap, self.config.num_pages)
        extra += count
    jax.block_until_ready(self.prefill_pool.last_X)
    return self.program_set.count - before + extra

  def seal(self) -> None:
    """Readiness: every program a plan can reach is compiled; any other is a hole to report."""
    self.program_set.seal()
