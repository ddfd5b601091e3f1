"""Token sampling: greedy, temperature, top-k and top-p, per row, deterministic per seed.

Contract: ``sample(logits_BV, seed_B, pos_B, temperature_B, top_k_B, top_p_B)`` returns int32
tokens [B]. Row b draws from key ``fold_in(key(seed_B[b]), pos_B[b])``, so a request's tokens
depend only on its own seed and positions, never on which other requests share the batch.
``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0

  def __post_init__(self):
    if not self.temperature >= 0:  # also rejects NaN
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if not 0 <= self.seed < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
  """Per-row sampling parameters as device arrays (a pytree; no retrace per value)."""
  seed: jax.Array  # [B] uint32
  temperature: jax.Array  # [B] f32
  top_k: jax.Array  # [B] int32
  top_p: jax.Array  # [B] f32

  @staticmethod
  def from_params(rows: list[SamplingParams]) -> "SamplingArrays":
    return SamplingArrays(
        seed=jnp.asarray(np.array([r.seed for r in rows], np.uint32)),
        temperature=jnp.asarray(np.array([r.temperature for r in rows], np.float32)),
        top_k=jnp.asarray(np.array([r.top_k for r in rows], np.int32)),
        top_p=jnp.asarray(np.array([r.top_p for r in rows], np.float32)))


def _sample_row(logits_V, key, temperature, top_k, top_p):
  v = logits_V.shape[0]
  order_V = jnp.argsort(-logits_V)
  sorted_V = logits_V[order_V] / jnp.maximum(temperature, 1e-6)
  rank_V = jnp.arange(v)
  keep_V = jnp.where(top_k > 0, rank_V < top_k, True)
  probs_V = jax.nn.softmax(jnp.where(keep_V, sorted_V, -jnp.inf))
  cum_before_V = jnp.cumsum(probs_V) - probs_V
  keep_V = keep_V & (cum_before_V < top_p)  # always keeps rank 0
  choice = jax.random.categorical(key, jnp.where(keep_V, sorted_V, -jnp.inf))
  return order_V[choice]


def argmax(logits_BV: jax.Array) -> jax.Array:
  """First index of the row maximum, int32 [B]. Two plain reductions: XLA:CPU lowers
  ``jnp.argmax`` to a variadic reduce that is ~9x slower (0.15 vs 0.02 ms at B=1, V=32000)."""
  v = logits_BV.shape[-1]
  m_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
  iota = jnp.arange(v, dtype=jnp.int32)
  idx_B = jnp.min(jnp.where(logits_BV == m_B1, iota, v), axis=-1)
  return jnp.minimum(idx_B, v - 1).astype(jnp.int32)  # an all-NaN row gives v - 1, not v


def sample(logits_BV: jax.Array, pos_B: jax.Array, s: SamplingArrays, greedy_only: bool
           ) -> jax.Array:
  """Next tokens [B] int32. ``greedy_only`` (static) skips the sort when no row samples."""
  greedy_B = argmax(logits_BV)
  if greedy_only:
    return greedy_B
  keys = jax.vmap(lambda sd, p: jax.random.fold_in(jax.random.key(sd), p))(s.seed, pos_B)
  sampled_B = jax.vmap(_sample_row)(logits_BV.astype(jnp.float32), keys, s.temperature,
                                    s.top_k, s.top_p).astype(jnp.int32)
  return jnp.where(s.temperature > 0, sampled_B, greedy_B)
