"""Endless streams: a long text scored token by token under KV cache policies (StreamingLLM).

Contract:
  * ``Policy(sinks, window)``: keep the first ``sinks`` tokens and the last ``window``
    (``window == 0``: every token, plain causal attention). ``FULL`` is the latter.
  * ``stream_nll(params, ids, cfg=, policies=, page_size=) -> [len(policies), len(ids) - 1]``
    negative log-likelihoods of each next token, one batch row per policy, the text fed one
    token at a time (teacher-forced decode steps in one ``lax.scan``) over a sink paged pool
    (``models.paged_kv``: queries and keys at their in-cache positions, the window's pages a
    ring). With only window policies the table is the largest
    ``ring_pages`` (bounded, whatever the text's length); a full-attention row makes it cover
    the whole text (attention then reads all of it every step: slower).
  * ``ring_pages(policy, page_size)``: the table entries a window row needs (the sink page plus
    a ring long enough for the window): the bounded KV of an endless stream.
  * ``dense_nll(params, ids, cfg=)`` -> ``[len(ids) - 1]``: the same under full attention in one
    causal forward (the reference a window policy is compared with; within the context).
  * ``recompute_logits(params, ids, cfg=, window=, positions=)`` -> ``[len(positions), V]``: the
    sliding window with re-computation baseline (StreamingLLM's "window recompute"): for each
    position t, a fresh prefill of the last ``window`` tokens up to t at positions from 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import paged_kv, transformer
from models.config import ModelConfig
from models.kv_cache import init_cache
from models.weights import Params


@dataclasses.dataclass(frozen=True)
class Policy:
  sinks: int = 0
  window: int = 0

  @property
  def name(self) -> str:
    if not self.window:
      return "full"
    return f"sinks{self.sinks}+window{self.window}" if self.sinks else f"window{self.window}"


FULL = Policy()


def ring_pages(policy: Policy, page_size: int) -> int:
  """Table entries a window row needs: entry 0 (the sinks) plus a ring holding every page a
  window of ``policy.window`` positions can touch (``(window - 1) // Z + 2``)."""
  if policy.window <= 0:
    raise ValueError("a full-attention row has no ring")
  if policy.sinks > page_size:
    raise ValueError(f"sinks {policy.sinks} > page size {page_size}: the sinks live in page 0")
  return paged_kv.ring_entries(policy.window, page_size)


@functools.partial(jax.jit, static_argnames=("cfg", "page_size", "attend_len"))
def _scan(params, ids_T, sinks_B, window_B, *, cfg: ModelConfig, page_size: int,
          attend_len: int) -> jax.Array:
  b = sinks_B.shape[0]
  m = attend_len // page_size
  kv = paged_kv.init_paged(cfg, b, b * m, page_size, m, params["final_norm"].dtype,
                           sink_pool=True)
  kv = kv.replace(page_table=jnp.arange(b * m, dtype=jnp.int32).reshape(b, m), sinks=sinks_B,
                  window=window_B)

  def step(kv, pair):
    tok, nxt = pair
    logits_BV, kv = transformer.decode_step(params, jnp.full((b,), tok, jnp.int32), kv,
                                            cfg=cfg, attend_len=attend_len)
    logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    return kv, -logp_BV[:, nxt]

  _, nll_TB = jax.lax.scan(step, kv, (ids_T[:-1], ids_T[1:]))
  return nll_TB.T


def stream_nll(params: Params, ids: Sequence[int], *, cfg: ModelConfig,
               policies: Sequence[Policy], page_size: int = 16) -> np.ndarray:
  if len(ids) < 2:
    raise ValueError("a stream needs two or more tokens")
  for p in policies:
    if p.window:
      ring_pages(p, page_size)  # validates
  n = len(ids)
  if all(p.window for p in policies):
    attend_len = max(ring_pages(p, page_size) for p in policies) * page_size
  else:
    attend_len = -(-n // page_size) * page_size
    if attend_len > cfg.max_seq_len:
      raise ValueError(f"full attention over {n} tokens exceeds the context {cfg.max_seq_len}")
  return np.asarray(_scan(params, jnp.asarray(ids, jnp.int32),
                          jnp.asarray([p.sinks for p in policies], jnp.int32),
                          jnp.asarray([p.window for p in policies], jnp.int32),
                          cfg=cfg, page_size=page_size, attend_len=attend_len))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _dense(params, ids_T, *, cfg: ModelConfig) -> jax.Array:
  logp_TV = jax.nn.log_softmax(transformer.forward(params, ids_T[None], cfg=cfg)[0], axis=-1)
  return -jnp.take_along_axis(logp_TV[:-1], ids_T[1:, None], axis=1)[:, 0]


def dense_nll(params: Params, ids: Sequence[int], *, cfg: ModelConfig) -> np.ndarray:
  if not 2 <= len(ids) <= cfg.max_seq_len:
    raise ValueError(f"dense scoring needs 2..{cfg.max_seq_len} tokens, got {len(ids)}")
  return np.asarray(_dense(params, jnp.asarray(ids, jnp.int32), cfg=cfg))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _recompute_one(params, window_ids, n, *, cfg: ModelConfig):
  w = window_ids.shape[0]
  cache = init_cache(cfg, 1, w, params["final_norm"].dtype)
  logits, _ = transformer.prefill(params, window_ids[None], cache, jnp.zeros((1,), jnp.int32),
                                  n[None], cfg=cfg, attend_len=w)
  return logits[0]


def recompute_logits(params: Params, ids: Sequence[int], *, cfg: ModelConfig, window: int,
                     positions: Sequence[int]) -> np.ndarray:
  ids_np = np.asarray(ids, np.int32)
  out = []
  for t in positions:
    lo = max(0, t + 1 - window)
    chunk = np.zeros((window,), np.int32)
    chunk[:t + 1 - lo] = ids_np[lo:t + 1]
    out.append(_recompute_one(params, jnp.asarray(chunk), jnp.asarray(t + 1 - lo, jnp.int32),
                              cfg=cfg))
  return np.asarray(jnp.stack(out))


__all__ = ["Policy", "FULL", "ring_pages", "stream_nll", "dense_nll", "recompute_logits"]
