"""Token sampling: greedy, temperature, top-k and top-p, per row, deterministic per seed; logprobs.

Contract:
  * ``sample(logits_BV, pos_B, s, greedy_only)`` returns int32 tokens [B]. Row b draws from key
    ``fold_in(key(s.seed[b]), pos_B[b])``: a request's tokens depend only on its own seed,
    positions and logits. Temperature, top-k and top-p are per-row arrays (``SamplingArrays``,
    a pytree: no retrace per value); only ``greedy_only`` is static.
  * ``min_p`` (vLLM's) drops ids below ``min_p`` x the likeliest one's probability (after
    temperature, before top-k and top-p). ``temperature == 0`` is the first-index ``argmax`` of
    the raw logits; ``top_k == 0`` (or
    ``>= V``) and ``top_p == 1`` disable those filters. The kept set is the sorted definition's
    (temperature, then top-k, then top-p over the top-k set), exact for any ``top_k``; draws are
    Gumbel-max over it when it fits the ``K_MAX`` cap, else the inverse CDF over all V at one
    uniform a row; a sampled row always returns a valid id.
  * ``logprobs(logits_BV, tokens_B, n)`` -> ``(chosen [B], top_ids [B, n], top_logprobs [B, n])``,
    ``log_softmax`` of the raw logits; ``logprobs_if(want, ...)`` under a traced bool.
  * Seeds: a request without one gets ``fresh_seed()`` when created (``serving.request``);
    ``SamplingArrays.from_params`` draws one for any sampled row still without a seed.
  * Penalties and logit bias (``SamplingParams.presence_penalty`` ... ``logit_bias``) are carried
    here per row (``SamplingArrays``: ``[B]`` factors, ``[B, LOGIT_BIAS_MAX]`` bias ids / values)
    but applied by ``serving.penalties`` before ``sample``; ``sample`` itself ignores them.
How it avoids a full sort, and its timings: BUILD_NOTES "Design: Serving core".
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from serving.grammar import CompiledGrammar

# The fast path's cap: lax.top_k of 64 costs 2.2 ms at B=32, V=49152 on XLA:CPU (128: 3.0 ms); 64
# covers the usual top_k (20-50) and most real nuclei; anything wider takes the exact slow path.
K_MAX = 64
LOGPROBS_MAX = 20  # the largest top-n logprobs a request may ask for (OpenAI's and vLLM's limit)
LOGIT_BIAS_MAX = 300  # logit_bias entries per request (OpenAI's cap; a fixed [B, 300] array)
PENALTY_MAX = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI)
BIAS_MAX = 100.0  # logit_bias values lie in [-100, 100] (OpenAI)
_SEARCH_STEPS = 32  # bisection steps over uint32: exact
_BLOCK = 256  # ids per block of the full-vocabulary draw's two-level cumulative mass


def fresh_seed() -> int:
  """A random 32-bit sampling seed (for a request that did not ask for one)."""
  return secrets.randbits(32)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int | None = None  # None: a fresh random seed (see the module contract)
  logprobs: int = 0  # top-n logprobs to return with each token (0: only if the engine asks)
  presence_penalty: float = 0.0  # minus p once for every id generated so far
  frequency_penalty: float = 0.0  # minus f per time an id was generated so far
  repetition_penalty: float = 1.0  # ids of the prompt or output: logit / r if > 0, else * r
  logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias) pairs, ids distinct
  grammar: CompiledGrammar | None = None  # structured output: allowed tokens per step
  min_p: float = 0.0  # drop ids less likely than min_p x the likeliest (after temperature)

  def __post_init__(self):
    if not self.temperature >= 0:  # also rejects NaN
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if not 0.0 <= self.min_p <= 1.0:
      raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
    if self.seed is not None and not 0 <= self.seed < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
    if not 0 <= self.logprobs <= LOGPROBS_MAX:
      raise ValueError(f"logprobs must be in [0, {LOGPROBS_MAX}], got {self.logprobs}")
    for name, value in (("presence_penalty", self.presence_penalty),
                        ("frequency_penalty", self.frequency_penalty)):
      if not -PENALTY_MAX <= value <= PENALTY_MAX:  # also rejects NaN
        raise ValueError(f"{name} must be in [-2, 2], got {value}")
    if not 0.0 < self.repetition_penalty < float("inf"):
      raise ValueError(f"repetition_penalty must be finite and > 0, got "
                       f"{self.repetition_penalty}")
    if len(self.logit_bias) > LOGIT_BIAS_MAX:
      raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most "
                       f"{LOGIT_BIAS_MAX}")
    if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
      raise ValueError("logit_bias names a token id twice")
    for t, b in self.logit_bias:
      if t < 0 or not -BIAS_MAX <= b <= BIAS_MAX:
        raise ValueError(f"logit_bias entries need an id >= 0 and a bias in [-100, 100], "
                         f"got {t}: {b}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def penalized(self) -> bool:
    """Penalties that read the sequence's ids (``serving.penalties`` keeps them per slot)."""
    return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0)

  def resolved(self) -> "SamplingParams":
    """These parameters with a seed: ``self`` if it has one, else a fresh random one."""
    return self if self.seed is not None else dataclasses.replace(self, seed=fresh_seed())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
  """Per-row sampling parameters as device arrays (a pytree; no retrace per value)."""
  seed: jax.Array  # [B] uint32
  temperature: jax.Array  # [B] f32
  top_k: jax.Array  # [B] int32
  top_p: jax.Array  # [B] f32
  presence: jax.Array  # [B] f32 (serving.penalties)
  frequency: jax.Array  # [B] f32
  repetition: jax.Array  # [B] f32 (1: off)
  bias_ids: jax.Array  # [B, LOGIT_BIAS_MAX] int32 (unused entries: id 0, bias 0)
  bias: jax.Array  # [B, LOGIT_BIAS_MAX] f32
  min_p: jax.Array  # [B] f32 (0: off)

  @staticmethod
  def from_params(rows: list[SamplingParams]) -> "SamplingArrays":
    seeds = [r.seed if r.seed is not None else (0 if r.greedy else fresh_seed()) for r in rows]
    f32 = lambda values: np.array(list(values), np.float32)
    bias_ids = np.zeros((len(rows), LOGIT_BIAS_MAX), np.int32)
    bias = np.zeros((len(rows), LOGIT_BIAS_MAX), np.float32)
    for i, r in enumerate(rows):
      if r.logit_bias:
        ids, values = zip(*r.logit_bias)
        bias_ids[i, :len(ids)] = ids
        bias[i, :len(ids)] = values
    # One device_put of them all (not jnp.asarray: no staging program compiled per shape).
    return SamplingArrays(*jax.device_put((
        np.array(seeds, np.uint32), f32(r.temperature for r in rows),
        np.array([r.top_k for r in rows], np.int32), f32(r.top_p for r in rows),
        f32(r.presence_penalty for r in rows), f32(r.frequency_penalty for r in rows),
        f32(r.repetition_penalty for r in rows), bias_ids, bias, f32(r.min_p for r in rows))))


def _argmax_blocks(v: int) -> int:
  """Blocks of ``argmax``'s two-level search over ``v`` ids: the divisor of ``v`` whose block
  is nearest 2,048 ids, between 512 and 4,096; 1 (one level) where none is."""
  cands = [n for n in range(max(1, v // 4096), v // 512 + 1) if v % n == 0 and n > 1]
  return min(cands, key=lambda n: abs(v // n - 2048), default=1)


def argmax(logits_BV: jax.Array) -> jax.Array:
  """First index of the row maximum, int32 [B]; a row holding a NaN gives ``v - 1`` (a valid
  id). Plain reductions: XLA:CPU lowers ``jnp.argmax`` to a variadic reduce that is ~9x slower
  (0.15 vs 0.02 ms at B=1, V=32000). Two levels where ``v`` splits into blocks
  (``_argmax_blocks``): the blocks' maxima, then the first index in the first block holding
  the maximum; one pass over the logits instead of two (B=64, V=49,152 on the Xeon: 0.8 vs
  1.4 ms; inside the sampler, where the logits are read by more than the search, more)."""
  b, v = logits_BV.shape
  nb = _argmax_blocks(v)
  s = v // nb
  x_BNS = logits_BV.reshape(b, nb, s)
  m_BN = jnp.max(x_BNS, axis=-1)
  m_B1 = jnp.max(m_BN, axis=-1, keepdims=True)
  blk_B = jnp.min(jnp.where(m_BN == m_B1, jnp.arange(nb, dtype=jnp.int32), nb), axis=-1)
  blk_B = jnp.minimum(blk_B, nb - 1)
  row_BS = jnp.take_along_axis(x_BNS, blk_B[:, None, None], axis=1)[:, 0]
  j_B = jnp.min(jnp.where(row_BS == m_B1, jnp.arange(s, dtype=jnp.int32), s), axis=-1)
  return jnp.where(j_B < s, blk_B * s + j_B, v - 1).astype(jnp.int32)


def _gumbel_argmax(keys_B: jax.Array, z_BN: jax.Array) -> jax.Array:
  """Index drawn from softmax(z) per row (Gumbel-max); masked ids hold -inf."""
  g_BN = jax.vmap(lambda k: jax.random.gumbel(k, z_BN.shape[-1:], jnp.float32))(keys_B)
  return argmax(z_BN + g_BN)


def _inverse_cdf(keys_B: jax.Array, z_BV: jax.Array) -> jax.Array:
  """Index drawn from softmax(z) per row by its inverse CDF at one uniform a row; masked ids
  hold -inf and are never drawn (a row with none kept: its argmax). The cumulative mass is
  two-level (blocks of ``_BLOCK`` ids, then ids within the chosen block): no V-wide random
  numbers (Gumbel-max over V drew one per id: 25 ms at B=32, V=49152 on 2 Zen 4 vCPUs)."""
  b, v = z_BV.shape
  nb = -(-v // _BLOCK)
  zmax_B1 = jnp.max(z_BV, axis=-1, keepdims=True)
  e_BV = jnp.exp(z_BV - jnp.where(jnp.isfinite(zmax_B1), zmax_B1, 0.0))  # -inf -> 0
  e_BNS = jnp.pad(e_BV, ((0, 0), (0, nb * _BLOCK - v))).reshape(b, nb, _BLOCK)
  blk_BN = jnp.sum(e_BNS, axis=-1)
  cum_BN = jnp.cumsum(blk_BN, axis=-1)
  u_B = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys_B) * cum_BN[:, -1]
  j_B = jnp.minimum(jnp.sum(cum_BN <= u_B[:, None], axis=-1), nb - 1)
  before_B = jnp.take_along_axis(cum_BN - blk_BN, j_B[:, None], axis=-1)[:, 0]
  in_BS = jnp.take_along_axis(e_BNS, j_B[:, None, None], axis=1)[:, 0]
  t_B = jnp.minimum(jnp.sum(jnp.cumsum(in_BS, axis=-1) <= (u_B - before_B)[:, None], axis=-1),
                    _BLOCK - 1)
  idx_B = (j_B * _BLOCK + t_B).astype(jnp.int32)
  # Rounding may land past the last kept id (on a zero-mass one): the row's argmax instead.
  hit_B = jnp.take_along_axis(e_BNS.reshape(b, -1), idx_B[:, None], axis=-1)[:, 0] > 0
  return jnp.where(hit_B, idx_B, argmax(z_BV))


def _order_keys(z_BV: jax.Array) -> jax.Array:
  """uint32 image of f32 with the same order (no NaN here): radix-sort's sign flip."""
  u = jax.lax.bitcast_convert_type(z_BV, jnp.uint32)
  return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def _bisect(ok: Callable[[jax.Array], jax.Array], hi_B: jax.Array) -> jax.Array:
  """Largest x in [0, hi) with ok(x) [B] true, given ok(0) true, ok(hi) false, ok monotone."""
  def body(_: int, lohi: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    lo, hi = lohi
    mid = lo + (hi - lo) // 2
    good = ok(mid)
    return jnp.where(good, mid, lo), jnp.where(good, hi, mid)
  lo, _ = jax.lax.fori_loop(0, _SEARCH_STEPS, body, (jnp.zeros_like(hi_B), hi_B))
  return lo


def _full_vocab_keep(z_BV: jax.Array, zmax_B1: jax.Array, k_B: jax.Array, top_p_B: jax.Array,
                     search_k_B: jax.Array, search_p_B: jax.Array) -> jax.Array:
  """Exact kept set over all V ids [B, V] bool: thresholds by bisection where a row needs one."""
  b = z_BV.shape[0]
  key_BV = _order_keys(z_BV)
  hi_B = jnp.max(key_BV, axis=-1) + jnp.uint32(1)  # the largest key is < 0xff800001
  zero_B = jnp.zeros((b,), jnp.uint32)

  def top_k_threshold() -> jax.Array:  # largest x with count(key >= x) >= k
    ok = lambda x: jnp.sum(key_BV >= x[:, None], axis=-1, dtype=jnp.int32) >= k_B
    return _bisect(ok, hi_B)
  thr_k = jax.lax.cond(jnp.any(search_k_B), top_k_threshold, lambda: zero_B)
  keep_BV = key_BV >= jnp.where(search_k_B, thr_k, 0)[:, None]
  e_BV = jnp.where(keep_BV, jnp.exp(z_BV - zmax_B1), 0.0)
  target_B = top_p_B * jnp.sum(e_BV, axis=-1)

  def top_p_threshold() -> jax.Array:  # largest x with (kept mass at keys >= x) >= target
    ok = lambda x: jnp.sum(jnp.where(key_BV >= x[:, None], e_BV, 0.0), axis=-1) >= target_B
    return _bisect(ok, hi_B)
  thr_p = jax.lax.cond(jnp.any(search_p_B), top_p_threshold, lambda: zero_B)
  return keep_BV & (key_BV >= jnp.where(search_p_B, thr_p, 0)[:, None])


@dataclasses.dataclass(frozen=True)
class _Filter:
  """One batch's filtered distribution: scaled logits, the K_MAX cap and which rows it serves."""
  z_BV: jax.Array  # scaled logits, NaN -> -inf
  vals_BK: jax.Array  # the K_MAX best scaled logits, descending
  idx_BK: jax.Array  # their ids
  keep_BK: jax.Array  # kept among them (valid where cap_B)
  cap_B: jax.Array  # the cap holds the row's whole kept set
  full_B: jax.Array  # a sampled row that needs the exact full-vocabulary path
  search_k_B: jax.Array  # ... with a top-k threshold search (K_MAX < top_k < V)
  search_p_B: jax.Array  # ... with a top-p threshold search
  zmax_B1: jax.Array
  k_B: jax.Array
  top_p_B: jax.Array
  sampling_B: jax.Array


def _filter(logits_BV: jax.Array, s: SamplingArrays) -> _Filter:
  b, v = logits_BV.shape
  z_BV = logits_BV.astype(jnp.float32) / jnp.maximum(s.temperature, 1e-6)[:, None]
  z_BV = jnp.where(jnp.isnan(z_BV), -jnp.inf, z_BV)
  kcap = min(K_MAX, v)
  k_B = jnp.where((s.top_k <= 0) | (s.top_k >= v), v, s.top_k)  # v: top-k off
  top_p_B = s.top_p
  p_on_B = top_p_B < 1.0
  sampling_B = s.temperature > 0

  def best() -> tuple[jax.Array, jax.Array, jax.Array]:
    # The barrier keeps XLA's TopK custom call: a slice of the values fused into their users
    # makes XLA:CPU fall back to sorting all V (6 -> 0.1 ms at B=1, V=49152).
    vals_BK, idx_BK = jax.lax.optimization_barrier(jax.lax.top_k(z_BV, kcap))
    return vals_BK, idx_BK, vals_BK[:, :1]

  def no_best() -> tuple[jax.Array, jax.Array, jax.Array]:  # plain temperature: no cap needed
    return (jnp.full((b, kcap), -jnp.inf, jnp.float32), jnp.zeros((b, kcap), jnp.int32),
            jnp.max(z_BV, axis=-1, keepdims=True))
  # The cap's top_k (3 ms at B=32) only where a sampled row filters (top-k or top-p).
  filters = jnp.any(sampling_B & ((k_B <= kcap) | p_on_B))
  vals_BK, idx_BK, zmax_B1 = jax.lax.cond(filters, best, no_best)
  zmax_B1 = jnp.where(jnp.isfinite(zmax_B1), zmax_B1, 0.0)
  in_k_BK = jnp.arange(kcap) < k_B[:, None]
  e_BK = jnp.where(in_k_BK, jnp.exp(vals_BK - zmax_B1), 0.0)
  small_k_B = k_B <= kcap
  nucleus_B = sampling_B & ~small_k_B & (k_B == v) & p_on_B  # needs the full softmax mass

  def full_mass() -> jax.Array:
    return jnp.sum(jnp.exp(z_BV - zmax_B1), axis=-1)
  mass_V_B = jax.lax.cond(jnp.any(nucleus_B), full_mass, lambda: jnp.ones((b,), jnp.float32))
  cap_mass_B = jnp.sum(e_BK, axis=-1)
  mass_B = jnp.where(small_k_B, cap_mass_B, mass_V_B)
  cum_before_BK = jnp.cumsum(e_BK, axis=-1) - e_BK
  keep_BK = in_k_BK & ((cum_before_BK < (top_p_B * mass_B)[:, None]) | ~p_on_B[:, None])
  # The cap holds the whole kept set: top_k <= K_MAX, or a nucleus inside the K_MAX best ids
  # (their mass reaches top_p, so rank K_MAX's mass-before does too and it is dropped).
  cap_B = small_k_B | (nucleus_B & (cap_mass_B >= top_p_B * mass_B))
  full_B = sampling_B & ~cap_B
  return _Filter(z_BV, vals_BK, idx_BK, keep_BK, cap_B, full_B, full_B & (k_B < v),
                 full_B & p_on_B, zmax_B1, k_B, top_p_B, sampling_B)


def _full_keep(f: _Filter) -> jax.Array:
  return _full_vocab_keep(f.z_BV, f.zmax_B1, f.k_B, f.top_p_B, f.search_k_B, f.search_p_B)


def kept_mask(logits_BV: jax.Array, s: SamplingArrays) -> jax.Array:
  """The ids each sampled row may draw, [B, V] bool (the same code as ``sample``; for tests and
  debugging, it builds the V-wide mask that ``sample`` avoids on its fast path)."""
  f = _filter(logits_BV, s)
  b, v = logits_BV.shape
  rows_BK = jnp.broadcast_to(jnp.arange(b)[:, None], f.idx_BK.shape)
  cap_BV = jnp.zeros((b, v), bool).at[rows_BK, f.idx_BK].set(f.keep_BK)
  return jnp.where(f.cap_B[:, None], cap_BV, _full_keep(f))


def _min_p(logits_BV: jax.Array, s: SamplingArrays) -> jax.Array:
  """min_p (vLLM's, on the temperature-scaled distribution, before top-k / top-p): id i stays
  where p_i >= min_p * p_max, i.e. logit_i >= max logit + T * log(min_p); rows with min_p 0 (or
  greedy) keep every id."""
  on_B = (s.min_p > 0) & (s.temperature > 0)
  t_B = jnp.where(on_B, s.temperature, 1.0)
  floor_B1 = (jnp.max(logits_BV, axis=-1) + t_B * jnp.log(jnp.where(on_B, s.min_p, 1.0)))[:, None]
  keep_BV = (logits_BV >= floor_B1) | ~on_B[:, None]
  return jnp.where(keep_BV, logits_BV, jnp.array(-jnp.inf, logits_BV.dtype))


def sample(logits_BV: jax.Array, pos_B: jax.Array, s: SamplingArrays, greedy_only: bool
           ) -> jax.Array:
  """Next tokens [B] int32 (see the module contract). ``greedy_only`` is static."""
  greedy_B = argmax(logits_BV)
  if greedy_only:
    return greedy_B
  b = logits_BV.shape[0]

  def draw() -> jax.Array:
    keys_B = jax.vmap(lambda sd, p: jax.random.fold_in(jax.random.key(sd), p))(s.seed, pos_B)
    f = _filter(_min_p(logits_BV, s), s)
    choice_B = _gumbel_argmax(keys_B, jnp.where(f.keep_BK, f.vals_BK, -jnp.inf))
    cap_tok_B = jnp.take_along_axis(f.idx_BK, choice_B[:, None], axis=-1)[:, 0]

    def full_draw() -> jax.Array:
      return _inverse_cdf(keys_B, jnp.where(_full_keep(f), f.z_BV, -jnp.inf))
    full_tok_B = jax.lax.cond(jnp.any(f.full_B), full_draw, lambda: jnp.zeros((b,), jnp.int32))
    sampled_B = jnp.where(f.cap_B, cap_tok_B.astype(jnp.int32), full_tok_B)
    return jnp.where(f.sampling_B, sampled_B, greedy_B)
  # An all-greedy batch skips the filter and the draws: one program serves every mix of rows.
  return jax.lax.cond(jnp.any(s.temperature > 0), draw, lambda: greedy_B)


def logprobs(logits_BV: jax.Array, tokens_B: jax.Array, n: int
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(chosen [B] f32, top_ids [B, n] int32, top_logprobs [B, n] f32) of the raw distribution
  ``log_softmax(logits)`` (no temperature, no top-k / top-p), vLLM's default. ``n`` is static,
  ``0 <= n <= LOGPROBS_MAX``; ties among the best ids come lowest id first."""
  if not 0 <= n <= LOGPROBS_MAX:
    raise ValueError(f"n must be in [0, {LOGPROBS_MAX}], got {n}")
  x_BV = logits_BV.astype(jnp.float32)
  lse_B1 = jax.nn.logsumexp(x_BV, axis=-1, keepdims=True)
  chosen_B = jnp.take_along_axis(x_BV, tokens_B.astype(jnp.int32)[:, None], axis=-1)[:, 0]
  chosen_B = chosen_B - lse_B1[:, 0]
  b = x_BV.shape[0]
  if n == 0:
    return chosen_B, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32)
  vals_BN, ids_BN = jax.lax.optimization_barrier(jax.lax.top_k(x_BV, n))  # see _filter
  return chosen_B, ids_BN.astype(jnp.int32), vals_BN - lse_B1


def logprobs_if(want: jax.Array, logits_BV: jax.Array, tokens_B: jax.Array, n: int
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``logprobs(logits_BV, tokens_B, n)`` where the traced bool ``want`` holds, zeros of the same
  shapes otherwise (the work is skipped at run time)."""
  b = logits_BV.shape[0]
  zeros = lambda: (jnp.zeros((b,), jnp.float32), jnp.zeros((b, n), jnp.int32),
                   jnp.zeros((b, n), jnp.float32))
  return jax.lax.cond(want, lambda: logprobs(logits_BV, tokens_B, n), zeros)
