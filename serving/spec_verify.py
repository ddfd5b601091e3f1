"""Speculative decoding's verify call: a step's decode rows and their draft ids in one packed
model call, sampled at every position, the longest agreeing prefix of each row accepted.

Contract: ``pack_verify(rows, n, null_slot)`` lays decode rows (``serving.step_plan.DecodeRow``,
each its slot's last id then its ``draft``) end to end in ``N = n`` tokens (``verify_sizes``:
multiples of ``k + 1``), ``R = N`` rows (``VerifyArrays``). ``verify_call(params, kv, last_X, samp, ...)`` runs them as a packed prefill
(``models.step.Step.prefill`` with ``T = 1``: each token at its own position, KV written for
every one), samples every position ``p`` with its slot's parameters at key position ``p + 1``
(as a plain decode step would: ``serving.sampling``), counts per row the draft ids equal to the
id sampled before them (``acc_R``; at most ``k``, static) and returns the id sampled after the
last accepted one (``tok_R``); the slot's last id and KV length move past it. Rejected drafts'
KV stays written past the length (never attended; the scheduler gives their pages back).
Letters: ``models/config.py``; ``N`` tokens of a verify call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.paged_kv import PagedKV
from models.step import Step
from models.weights import Params
from serving.engine_calls import rows
from serving.engine_lora import SlotLoras, lora_rows
from serving.engine_shapes import powers
from serving.sampling import SamplingArrays, sample
from serving.step_plan import DecodeRow


@dataclasses.dataclass(frozen=True)
class VerifyArrays:
  """Host arrays of one verify call: per token its draft id (a row's first token: the slot's last
  id, ``first_N``), slot, position (-1: padding) and the draft id after it in its row (-1:
  none); per row its slot (padding: the null slot), first token and draft count."""
  tokens_N: np.ndarray
  first_N: np.ndarray
  slot_N: np.ndarray
  pos_N: np.ndarray
  next_N: np.ndarray
  slots_R: np.ndarray
  start_R: np.ndarray
  k_R: np.ndarray


def verify_sizes(k: int, max_rows: int) -> list[int]:
  """A verify call's warmed token counts ``N``: ``k + 1`` (one row's full draft) times 1, 2, 4,
  ... rows, and ``max_rows``. A row's full draft fills its call exactly: at batch 1, k = 4 runs
  5 tokens, not 8 (each token of a call costs compute once several share the weights' read)."""
  return [(k + 1) * r for r in powers(1, max(1, max_rows))]


def verify_tokens(num_rows: int, num_drafts: int, k: int, max_rows: int) -> int:
  """The smallest of ``verify_sizes(k, max_rows)`` that holds rows with ``num_drafts`` draft ids
  in all."""
  need = num_rows + num_drafts
  return next((n for n in verify_sizes(k, max_rows) if n >= need), need)


def pack_verify(decode: Sequence[DecodeRow], n: int, null_slot: int) -> VerifyArrays:
  out = VerifyArrays(np.zeros((n,), np.int32), np.zeros((n,), bool),
                     np.full((n,), null_slot, np.int32), np.full((n,), -1, np.int32),
                     np.full((n,), -1, np.int32), np.full((n,), null_slot, np.int32),
                     np.zeros((n,), np.int32), np.zeros((n,), np.int32))
  i = 0
  for j, r in enumerate(decode):
    k = len(r.draft)
    out.tokens_N[i + 1:i + 1 + k] = r.draft
    out.first_N[i] = True
    out.slot_N[i:i + 1 + k] = r.slot
    out.pos_N[i:i + 1 + k] = np.arange(r.position, r.position + 1 + k)
    out.next_N[i:i + k] = r.draft
    out.slots_R[j], out.start_R[j], out.k_R[j] = r.slot, i, k
    i += 1 + k
  return out


@functools.partial(jax.jit, static_argnames=("step", "attend_len", "valid_vocab", "k"),
                   donate_argnames=("kv", "last_X"))
def verify_call(params: Params, kv: PagedKV, last_X: jax.Array, samp: SamplingArrays,
                tokens_N: jax.Array, first_N: jax.Array, slot_N: jax.Array, pos_N: jax.Array,
                next_N: jax.Array, slots_R: jax.Array, start_R: jax.Array, k_R: jax.Array,
                lora: SlotLoras | None = None, *, step: Step, attend_len: int, valid_vocab: int,
                k: int):
  """-> (kv, last_X, tok_R, acc_R); see the module contract."""
  tok_N = jnp.where(first_N, rows(last_X, slot_N, 0), tokens_N)
  sub = kv.replace(page_table=rows(kv.page_table, slot_N, kv.num_pages),
                   lengths=rows(kv.lengths, slot_N, 0))
  valid_N = (pos_N >= 0).astype(jnp.int32)
  logits_NV, out = step.prefill(params, tok_N[:, None], sub, pos_N, valid_N,
                                attend_len=attend_len,  # T = 1: every token's logits, [N, V]
                                lora=lora_rows(lora, slot_N[:, None]))
  s_N = jax.tree.map(lambda a: rows(a, slot_N, 0), samp)
  got_N = sample(logits_NV[:, :valid_vocab], pos_N + 1, s_N, greedy_only=False)
  # Row r accepts its i-th draft id while every one before it and it equal the ids sampled.
  i_K = jnp.arange(k)
  hit_RK = rows(got_N == next_N, start_R[:, None] + i_K, False) & (i_K < k_R[:, None])
  acc_R = jnp.sum(jnp.cumprod(hit_RK.astype(jnp.int32), axis=1), axis=1)
  tok_R = rows(got_N, start_R + acc_R, 0)
  end_R = rows(pos_N, start_R, 0) + acc_R + 1
  kv = kv.replace(k_pages=out.k_pages, v_pages=out.v_pages,
                  lengths=kv.lengths.at[slots_R].set(end_R, mode="drop"))
  return kv, last_X.at[slots_R].set(tok_R, mode="drop"), tok_R, acc_R


__all__ = ["VerifyArrays", "pack_verify", "verify_call", "verify_sizes", "verify_tokens"]
