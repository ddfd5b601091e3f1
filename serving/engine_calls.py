"""The engine's jitted programs and how their outputs come back to the host.

Contract: the model programs (``prefill_call``, ``decode_call``) run a ``models.step.Step`` on
the rows ``R`` of one call, gathered from the pool's per-slot state (``X`` slots) by
``slots_R`` (padding rows name slot ``X``: the null page, inactive), and return logits;
sampling is a program of its own per row count (``sample_call``: greedy-or-sampled,
penalties-or-not and logprobs-or-not are run-time switches, not program variants).
``read_pages`` / ``write_pages`` / ``copy_call`` move pages ``C`` of the pool (the host tier,
prefix copies). ``Pending`` holds one step's sampled ids in flight; ``result()`` reads them on
the host (``to_host``: a local copy, or a replicate-then-read under several processes).
Letters: ``models/config.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.paged_kv import PagedKV, Pages, copy_pages
from models.step import Step
from models.weights import Params
from serving.engine_lora import SlotLoras, lora_rows
from serving.penalties import PenaltyState, apply_if, count
from serving.request import TokenLogprobs
from serving.sampling import LOGPROBS_MAX, SamplingArrays, logprobs_if, sample
from serving.scheduler import StepResult
from serving.token_mask import apply_bitmask


def rows(x: jax.Array, idx: jax.Array, fill) -> jax.Array:
  return x.at[idx].get(mode="fill", fill_value=fill)


def _sampling_rows(s: SamplingArrays, idx: jax.Array) -> SamplingArrays:
  return jax.tree.map(lambda a: rows(a, idx, 0), s)


def _policy_rows(kv: PagedKV, idx: jax.Array) -> dict[str, jax.Array]:
  """A sink pool's per-slot sinks / window for the rows of a call (nothing otherwise)."""
  if kv.sinks is None or kv.window is None:
    return {}
  return {"sinks": rows(kv.sinks, idx, 0), "window": rows(kv.window, idx, 0)}


copy_call = jax.jit(copy_pages, donate_argnums=0)


@jax.jit
def read_pages(kv: PagedKV, ids_C: jax.Array) -> tuple[Pages, Pages]:
  """K and V of pages ``ids_C`` (clipped; padding reads page 0): [L, C, K, Z, H] each (every
  leaf of ``Pages``: int8 values and their scales)."""
  ids_C = jnp.clip(ids_C, 0, kv.num_pages - 1)
  take = lambda a: a[:, ids_C]
  return jax.tree.map(take, kv.k_pages), jax.tree.map(take, kv.v_pages)


@jax.jit
def write_pages(kv: PagedKV, ids_C: jax.Array, k: Pages, v: Pages) -> PagedKV:
  """Writes K / V [L, C, K, Z, H] into pages ``ids_C``; ids outside the pool are padding."""
  ids_C = jnp.where((ids_C >= 0) & (ids_C < kv.num_pages), ids_C, kv.num_pages)
  put = lambda a, x: a.at[:, ids_C].set(x.astype(a.dtype), mode="drop")
  return kv.replace(k_pages=jax.tree.map(put, kv.k_pages, k),
                    v_pages=jax.tree.map(put, kv.v_pages, v))


# The model's programs (prefill, decode) return logits; sampling is a program of its own, keyed
# only by the row count: a sampling or logprobs variant would otherwise multiply every model
# program (each XLA:CPU kernel costs ~3 memory mappings: BUILD_NOTES "Staying in service").
@functools.partial(jax.jit, static_argnames=("step", "attend_len"), donate_argnames=("kv",))
def prefill_call(params: Params, kv: PagedKV, tokens_RT: jax.Array, slots_R: jax.Array,
                 start_R: jax.Array, lens_R: jax.Array, lora: SlotLoras | None = None, *,
                 step: Step, attend_len: int):
  sub = kv.replace(page_table=rows(kv.page_table, slots_R, kv.num_pages),
                   lengths=rows(kv.lengths, slots_R, 0), **_policy_rows(kv, slots_R))
  logits_RV, out = step.prefill(params, tokens_RT, sub, start_R, lens_R, attend_len=attend_len,
                                lora=lora_rows(lora, slots_R[:, None]))
  kv = kv.replace(k_pages=out.k_pages, v_pages=out.v_pages,
                  lengths=kv.lengths.at[slots_R].set(out.lengths, mode="drop"))
  return kv, logits_RV


@functools.partial(jax.jit, static_argnames=("step", "attend_len"), donate_argnames=("kv",))
def packed_call(params: Params, kv: PagedKV, tokens_N: jax.Array, slot_N: jax.Array,
                pos_N: jax.Array, slots_R: jax.Array, end_R: jax.Array, last_R: jax.Array,
                lora: SlotLoras | None = None, *, step: Step, attend_len: int):
  """A prefill of ``R`` chunks packed into ``N`` tokens, each token its own row (T = 1): token n
  of slot ``slot_N[n]`` at position ``pos_N[n]`` (-1: padding, no work, no write); chunk r
  (slot ``slots_R[r]``) ends at ``end_R[r]`` and samples from token ``last_R[r]``."""
  sub = kv.replace(page_table=rows(kv.page_table, slot_N, kv.num_pages),
                   lengths=rows(kv.lengths, slot_N, 0))
  valid_N = (pos_N >= 0).astype(jnp.int32)
  logits_RV, out = step.prefill(params, tokens_N[:, None], sub, pos_N, valid_N,
                                attend_len=attend_len, logits_at=last_R,
                                lora=lora_rows(lora, slot_N[:, None]))
  kv = kv.replace(k_pages=out.k_pages, v_pages=out.v_pages,
                  lengths=kv.lengths.at[slots_R].set(end_R, mode="drop"))
  return kv, logits_RV


@functools.partial(jax.jit, static_argnames=("step", "n", "attend_len"), donate_argnames=("kv",))
def decode_call(params: Params, kv: PagedKV, last_X: jax.Array, slots_R: jax.Array,
                pos_R: jax.Array, active_R: jax.Array, lora: SlotLoras | None = None, *,
                step: Step, n: int, attend_len: int):
  # Row r runs slot slots_R[r] (padding rows: slot X, the null page, inactive).
  sub = kv.replace(page_table=rows(kv.page_table, slots_R, kv.num_pages), lengths=pos_R,
                   **_policy_rows(kv, slots_R))
  logits_RV, out = step.decode(params, rows(last_X, slots_R, 0), sub, active_R,
                               attend_len=attend_len, lora=lora_rows(lora, slots_R))
  keep_R = rows(kv.lengths, slots_R, 0)
  lengths = kv.lengths.at[slots_R].set(jnp.where(active_R, out.lengths, keep_R), mode="drop")
  return kv.replace(k_pages=out.k_pages, v_pages=out.v_pages, lengths=lengths), logits_RV


@functools.partial(jax.jit, static_argnames=("valid_vocab",), donate_argnames=("last_X", "pen"))
def sample_call(logits_RV: jax.Array, last_X: jax.Array, pen: PenaltyState,
                samp: SamplingArrays, slots_R: jax.Array, pos_R: jax.Array, take_R: jax.Array,
                want_lp: jax.Array, mask_RW: jax.Array, masked_R: jax.Array, *,
                valid_vocab: int):
  """Row r's next id from its logits, penalised and biased (``serving.penalties``, a run-time
  switch) and sampled with its slot's parameters at key position ``pos_R``; rows with
  ``take_R`` write it into their slot's last id and penalty counts, the others keep theirs
  (and return it); logprobs (of the raw logits) under the run-time switch ``want_lp``. Rows
  ``masked_R`` sample only ids their structured-output bitmask ``mask_RW`` allows
  (``serving.token_mask``)."""
  logits_RV = logits_RV[:, :valid_vocab]
  keep_R = rows(last_X, slots_R, 0)
  s_R = _sampling_rows(samp, slots_R)
  # The bitmask only where a row has one: applied unconditionally, its [R, V] select is read
  # twice by the sampler (XLA:CPU materializes it; 5 ms a step at R=64, V=49,152 on the Xeon).
  # The sampler runs inside both branches, so the cond returns ids, not [R, V] logits.
  pick = lambda x_RV: jax.lax.cond(
      jnp.any(masked_R),
      lambda: sample(apply_bitmask(x_RV, mask_RW, masked_R), pos_R, s_R, greedy_only=False),
      lambda: sample(x_RV, pos_R, s_R, greedy_only=False))
  tok_R = jnp.where(take_R, apply_if(logits_RV, pen, slots_R, s_R, pick), keep_R)
  return (last_X.at[slots_R].set(tok_R, mode="drop"), count(pen, slots_R, tok_R, take_R, s_R),
          tok_R, logprobs_if(want_lp, logits_RV, tok_R, LOGPROBS_MAX))


def to_host(a: jax.Array) -> np.ndarray:
  """The value of a step output on this process. Under several processes (``jax.distributed``)
  an output spans devices of other processes: a sharded one is first replicated over its own
  devices (a collective: every process reads the same outputs in the same order, since each
  runs the same plans), then read from a local copy. Every mesh spans every process
  (``partitioning.mesh.split_devices``), so each process holds a copy."""
  if a.is_fully_addressable:
    return np.asarray(a)
  if not a.sharding.is_fully_replicated:
    a = jax.device_put(a, jax.sharding.NamedSharding(a.sharding.mesh,  # type: ignore[attr-defined]  # a mesh's output
                                                     jax.sharding.PartitionSpec()))
  return np.asarray(a.addressable_shards[0].data)


LogprobArrays = tuple[jax.Array, jax.Array, jax.Array]  # chosen [R], top ids [R, n], top [R, n]
Row = tuple[str, int, int]  # (request id, row of the call, top-n logprobs it asked for)


def want_lp(rows: Sequence[Row]) -> np.bool_:
  """The calls' traced logprobs switch (host side): on when any sampled row asked for them."""
  return np.bool_(any(k for _, _, k in rows))


@dataclasses.dataclass
class Part:
  """One call's sampled ids [R] (and logprobs), and which request each row answers; a verify
  call's also its accepted draft counts [R] and each answered row's draft ids."""
  ids: jax.Array
  rows: list[Row]
  lp: LogprobArrays | None = None
  acc: jax.Array | None = None
  drafts: list[tuple[int, ...]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Pending:
  step: int
  parts: list[Part]
  _result: StepResult | None = None
  accepted: bool = False  # its ids went to the structured-output matchers (the engine's)

  def result(self) -> StepResult:
    """Blocks on each part's copy to the host (timed: ``StepResult.wait_s``); read once."""
    if self._result is None:
      self._result = self._read()
    return self._result

  def _read(self) -> StepResult:
    tokens: dict[str, int] = {}
    lps: dict[str, TokenLogprobs] = {}
    accepted: dict[str, tuple[int, ...]] = {}
    wait = 0.0
    for part in self.parts:
      t0 = time.perf_counter()
      host = to_host(part.ids)
      lp = None if part.lp is None or not any(k for _, _, k in part.rows) else \
          [to_host(a) for a in part.lp]
      acc = None if part.acc is None else to_host(part.acc)
      wait += time.perf_counter() - t0
      for j, (rid, i, k) in enumerate(part.rows):
        tokens[rid] = int(host[i])
        if acc is not None and acc[i]:
          accepted[rid] = part.drafts[j][:int(acc[i])]
        if lp is not None and k:
          lps[rid] = TokenLogprobs(int(host[i]), float(lp[0][i]),
                                   tuple(zip(lp[1][i, :k].tolist(), lp[2][i, :k].tolist())))
    return StepResult(self.step, tokens, lps, wait_s=wait, accepted=accepted)
