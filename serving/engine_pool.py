"""One KV pool of the engine and what runs on it (``serving.engine``: one pool, or a prefill and
a decode pool when the phases are disaggregated).

Contract: ``Pool.create(step, params, slots=, num_pages=, page_size=, pages_per_seq=,
kv_dtype=, vocab=, sinks=)`` places the step's params and an empty paged KV (committed, as
every later step's outputs are), each slot's last sampled id ``last_X`` (zeros) and penalty
state (``serving.penalties``), all on the step's devices. ``receive(src, slots, ...)``: a decode
pool takes the sequences whose prompts the prefill pool ``src`` finished. Letters:
``models/config.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.paged_kv import PagedKV
from models.step import Step, Transfer
from models.weights import Params
from serving.penalties import PenaltyState, count_first


@dataclasses.dataclass
class Pool:
  """See the module contract."""
  step: Step
  params: Params
  kv: PagedKV
  last_X: jax.Array
  pen: PenaltyState

  @property
  def shards(self) -> int:
    return self.step.kv_shards

  @classmethod
  def create(cls, step: Step, params: Params, *, slots: int, num_pages: int, page_size: int,
             pages_per_seq: int, kv_dtype: str, vocab: int, sinks: bool = False) -> "Pool":
    kv = step.init_kv(slots, num_pages, page_size, pages_per_seq, jnp.dtype(kv_dtype),
                      **({"sink_pool": True} if sinks else {}))
    # Committed from the start, as every later step's outputs are: the warm-up's first program
    # would otherwise compile for uncommitted inputs and the first real step compile it again.
    kv = jax.tree.map(lambda a: jax.device_put(a, a.sharding), kv)
    last_X = jax.device_put(jnp.zeros((slots,), jnp.int32), kv.lengths.sharding)
    pen = PenaltyState.create(slots, vocab, kv.lengths.sharding)
    return cls(step, step.place_params(params), kv, last_X, pen)

  def receive(self, src: "Pool", slots: Sequence[int], table_XM: np.ndarray,
              transfer: Transfer, penalized_X: np.ndarray) -> None:
    """The sequences of ``slots`` whose prompt ``src`` (the prefill pool) just finished: their
    pages (one transfer per sequence, all its table entries, null ones padding) and first
    sampled ids, counted in the penalty state of the ``penalized_X`` slots."""
    for slot in slots:
      self.kv = transfer(src.kv, self.kv, table_XM[slot], table_XM[slot])
    mask_X = np.zeros(self.last_X.shape, bool)
    mask_X[list(slots)] = True
    sharding = self.kv.lengths.sharding  # per-slot state on this pool's chips
    self.last_X = jax.block_until_ready(jnp.where(  # read before the next sampling donates it
        jax.device_put(mask_X, sharding), jax.device_put(src.last_X, sharding), self.last_X))
    mask_X &= penalized_X  # its first id counted
    if mask_X.any():
      self.pen = count_first(self.pen, mask_X, self.last_X)


__all__ = ["Pool"]
