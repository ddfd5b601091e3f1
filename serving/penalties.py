"""Frequency, presence and repetition penalties and logit bias: per row, on device.

Contract (vLLM v1's semantics and order; letters: ``models/config.py``):
  * ``apply(logits_RV, counts_RV, prompt_RV, s)``: row r's ``logit_bias`` added first, then the
    repetition penalty ``r`` over ids of its prompt or output (``logit / r`` where the logit is
    > 0, else ``logit * r``), then ``logit -= f * count`` and ``logit -= p * (count > 0)`` with
    ``count`` the times the id was generated (frequency ``f``, presence ``p``). A row with none
    of them returns its logits bit for bit. ``s`` holds the rows' parameters
    (``serving.sampling.SamplingArrays``; a padding row's zeros count as "none").
    Temperature, top-k and top-p then run on the result (``serving.sampling.sample``);
    logprobs stay those of the raw logits (vLLM's default).
  * ``apply_if(logits_RV, state, slots_R, s, then)``: ``then`` (the sampler) of the same under a
    ``lax.cond`` on "some row has a penalty or a bias", reading the rows' slots from ``state``:
    a batch with none skips the work at run time (one program serves both).
  * ``PenaltyState``: per-slot device state beside a pool's KV, ``counts_XV`` int32 (times each
    id was generated) and ``prompt_XV`` bool (ids of the prompt), over the sampled vocabulary.
    Only a slot whose request is ``SamplingParams.penalized`` keeps its row: ``fill_slot``
    writes it when the slot is assigned, from the prompt and the ids generated so far (so a
    preempted, recomputed request or a prefix-cache hit gets exactly the counts of an
    uninterrupted run), and ``count`` adds each id sampled for such a row. Other rows are stale
    and never read (their penalties are off). ``fill`` and ``count_first`` (a second pool's
    state: the id the prefill pool sampled) are fixed-shape programs; ``warm_penalties``
    compiles them at warm-up without writing anything.
Measured cost per step: BUILD_NOTES "Design: Serving core", sampling.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from serving.sampling import SamplingArrays

T = TypeVar("T")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyState:
  counts_XV: jax.Array  # int32: times slot x's sequence generated each id
  prompt_XV: jax.Array  # bool: ids of slot x's prompt

  @staticmethod
  def create(slots: int, vocab: int, sharding: jax.sharding.Sharding) -> "PenaltyState":
    return PenaltyState(jax.device_put(np.zeros((slots, vocab), np.int32), sharding),
                        jax.device_put(np.zeros((slots, vocab), bool), sharding))


def _switches(s: SamplingArrays) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(any change [R], reads the sequence's ids [R], repetition on [R])."""
  rep_R = (s.repetition > 0) & (s.repetition != 1)  # a padding row's 0 is off
  reads_R = rep_R | (s.presence != 0) | (s.frequency != 0)
  return reads_R | jnp.any(s.bias != 0, axis=-1), reads_R, rep_R


def apply(logits_RV: jax.Array, counts_RV: jax.Array, prompt_RV: jax.Array, s: SamplingArrays
          ) -> jax.Array:
  """Penalised and biased logits [R, V] f32 (see the module contract)."""
  on_R, _, rep_R = _switches(s)
  x_RV = jnp.asarray(logits_RV, jnp.float32)
  rows_RB = jnp.broadcast_to(jnp.arange(x_RV.shape[0])[:, None], s.bias_ids.shape)
  x_RV = x_RV.at[rows_RB, s.bias_ids].add(s.bias, mode="drop")
  r_R1 = jnp.where(rep_R, s.repetition, 1.0)[:, None]
  seen_RV = (prompt_RV | (counts_RV > 0)) & rep_R[:, None]
  x_RV = jnp.where(seen_RV, jnp.where(x_RV > 0, x_RV / r_R1, x_RV * r_R1), x_RV)
  x_RV = x_RV - s.frequency[:, None] * counts_RV.astype(jnp.float32)
  x_RV = x_RV - s.presence[:, None] * (counts_RV > 0).astype(jnp.float32)
  return jnp.where(on_R[:, None], x_RV, jnp.asarray(logits_RV, jnp.float32))


def apply_if(logits_RV: jax.Array, state: PenaltyState, slots_R: jax.Array, s: SamplingArrays,
             then: Callable[[jax.Array], T]) -> T:
  """``then(apply(...))`` for rows of slots ``slots_R`` (padding: slot X) where some row has a
  penalty or a bias, else ``then(logits_RV)``. ``then`` (the sampler) runs inside both branches
  so the cond's output is its (small) result: a cond returning the [R, V] logits copied them
  (+3.5 ms a step at R = 64, V = 49152, penalties off; BUILD_NOTES)."""
  def penalize() -> T:
    take = lambda a: a.at[slots_R].get(mode="fill", fill_value=0)
    return then(apply(logits_RV, take(state.counts_XV), take(state.prompt_XV), s))
  return jax.lax.cond(jnp.any(_switches(s)[0]), penalize, lambda: then(logits_RV))


def count(state: PenaltyState, slots_R: jax.Array, tok_R: jax.Array, take_R: jax.Array,
          s: SamplingArrays) -> PenaltyState:
  """Adds id ``tok_R[r]`` to slot ``slots_R[r]``'s counts where ``take_R`` and its row reads
  them (a scatter of R values: the buffer is updated in place when donated)."""
  add_R = (take_R & _switches(s)[1]).astype(jnp.int32)
  return dataclasses.replace(
      state, counts_XV=state.counts_XV.at[slots_R, tok_R].add(add_R, mode="drop"))


@functools.partial(jax.jit, donate_argnums=0)
def fill(state: PenaltyState, slot: jax.Array, counts_V: jax.Array, prompt_V: jax.Array
         ) -> PenaltyState:
  """Slot ``slot``'s row replaced (a slot out of range: nothing written)."""
  return PenaltyState(state.counts_XV.at[slot].set(counts_V, mode="drop"),
                      state.prompt_XV.at[slot].set(prompt_V, mode="drop"))


def rows_of(prompt_ids: Sequence[int], output_ids: Sequence[int], vocab: int
            ) -> tuple[np.ndarray, np.ndarray]:
  """The host rows a slot starts from: (counts [V] int32 of ``output_ids``, prompt mask [V])."""
  out = np.asarray(output_ids, np.int64)
  counts_V = np.bincount(out[(out >= 0) & (out < vocab)], minlength=vocab).astype(np.int32)
  prompt_V = np.zeros((vocab,), bool)
  ids = np.asarray(prompt_ids, np.int64)
  prompt_V[ids[(ids >= 0) & (ids < vocab)]] = True
  return counts_V, prompt_V


def fill_slot(state: PenaltyState, slot: int, prompt_ids: Sequence[int],
              output_ids: Sequence[int]) -> PenaltyState:
  """``state`` with slot ``slot`` started over from its prompt and the ids generated so far."""
  return fill(state, np.int32(slot), *rows_of(prompt_ids, output_ids, state.counts_XV.shape[1]))


@functools.partial(jax.jit, donate_argnums=0)
def count_first(state: PenaltyState, mask_X: jax.Array, last_X: jax.Array) -> PenaltyState:
  """Adds each masked slot's last id (a second pool's state: the id its prefill sampled)."""
  x = state.counts_XV.shape[0]
  return dataclasses.replace(state, counts_XV=state.counts_XV.at[jnp.arange(x), last_X].add(
      mask_X.astype(jnp.int32), mode="drop"))


def warm_penalties(state: PenaltyState, last_X: jax.Array | None = None) -> PenaltyState:
  """Compiles ``fill`` (and with ``last_X``, ``count_first``) on ``state``'s devices, writing
  nothing: slot X is out of range, the mask empty."""
  x, v = state.counts_XV.shape
  state = fill(state, np.int32(x), np.zeros((v,), np.int32), np.zeros((v,), bool))
  return state if last_X is None else count_first(state, np.zeros((x,), bool), last_X)
