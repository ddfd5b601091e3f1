"""serving.sampling: the kept set against a numpy sorted-definition reference (fast cap path and
exact bisection path), empirical distributions (chi-square), greedy rows, seeds and batch
independence, NaN rows, top-n logprobs against ``jax.nn.log_softmax``, parameter validation."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from serving import sampling as S
from serving.request import Request
from serving.sampling import SamplingArrays, SamplingParams, argmax, kept_mask, logprobs, sample


def _ref_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float
               ) -> tuple[np.ndarray, float]:
  """The sorted definition in float64: (filtered distribution [V], distance of the top-p
  decision to its boundary, to skip cases that float rounding may decide either way)."""
  z = logits.astype(np.float32) / np.float32(temperature)  # the scaling the sampler does
  v = z.shape[0]
  order = np.argsort(-z.astype(np.float64), kind="stable")
  k = top_k if 0 < top_k < v else v
  zs = z[order][:k].astype(np.float64)
  p = np.exp(zs - zs[0])
  p /= p.sum()
  before = np.cumsum(p) - p
  keep = before < top_p if top_p < 1 else np.ones(k, bool)
  margin = float(np.min(np.abs(before[1:] - top_p))) if top_p < 1 and k > 1 else 1.0
  out = np.zeros(v)
  q = np.where(keep, p, 0.0)
  out[order[:k]] = q / q.sum()
  return out, margin


def _distinct_logits(rng: np.random.Generator, v: int, scale: float) -> np.ndarray:
  while True:
    x = (rng.standard_normal(v) * scale).astype(np.float32)
    if np.unique(x).size == v:  # ties excluded
      return x


_sample = jax.jit(sample, static_argnums=3)

TOP_KS = (0, 1, 5, S.K_MAX, S.K_MAX + 1, 300, 1999, 2000, 5000)
TOP_PS = (1.0, 0.95, 0.6, 0.05)


def test_kept_set_equals_the_sorted_reference():
  rng = np.random.default_rng(0)
  v = 2000
  rows, params = [], []
  for top_k in TOP_KS:
    for top_p in TOP_PS:
      for scale, temp in ((0.3, 1.0), (4.0, 0.5), (2.0, 1.7)):
        while True:
          x = _distinct_logits(rng, v, scale)
          ref, margin = _ref_probs(x, temp, top_k, top_p)
          z = x / np.float32(temp)
          if margin > 2e-5 and np.unique(z).size == v:
            break
        rows.append((x, ref))
        params.append(SamplingParams(temp, top_k, top_p, seed=1))
  logits = jnp.asarray(np.stack([r[0] for r in rows]))
  s = SamplingArrays.from_params(params)
  got = np.asarray(jax.jit(kept_mask)(logits, s))
  for i, ((_, ref), p) in enumerate(zip(rows, params)):
    np.testing.assert_array_equal(got[i], ref > 0, err_msg=f"row {i}: {p}")
  # Both paths ran: some rows fit the K_MAX cap, others needed the exact bisection.
  f = S._filter(logits, s)
  assert bool(jnp.any(f.cap_B)) and bool(jnp.any(f.search_k_B)) and bool(jnp.any(f.search_p_B))
  assert bool(jnp.any(f.cap_B & (f.k_B == v) & (s.top_p < 1)))  # a nucleus inside the cap


def _draws(logits_V: np.ndarray, p: SamplingParams, n: int) -> np.ndarray:
  s = SamplingArrays.from_params([p] * n)
  return np.asarray(_sample(
      jnp.asarray(np.tile(logits_V, (n, 1))), jnp.arange(n), s, False))


@pytest.mark.parametrize("top_k,top_p,temp", [(12, 1.0, 1.0),  # cap path, top-k
                                              (0, 0.8, 1.0),  # cap path, nucleus
                                              (0, 1.0, 0.8),  # no filter: all V
                                              (120, 0.9, 1.3)])  # exact path (top_k > K_MAX)
def test_draws_follow_the_filtered_distribution(top_k, top_p, temp):
  """Chi-square goodness of fit, 6000 draws (one per position), fixed seed; fails at p < 1e-3."""
  rng = np.random.default_rng(7)
  x = _distinct_logits(rng, 300, 1.5)
  ref, _ = _ref_probs(x, temp, top_k, top_p)
  n = 6000
  got = _draws(x, SamplingParams(temp, top_k, top_p, seed=5), n)
  assert set(got.tolist()) <= set(np.flatnonzero(ref).tolist())  # never outside the kept set
  # Pool the ids with expected count < 5 into one cell.
  order = np.argsort(-ref)
  ref_sorted = ref[order][ref[order] > 0]
  counts = np.bincount(got, minlength=ref.size)[order][:ref_sorted.size]
  big = ref_sorted * n >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(ref_sorted[big] * n, ref_sorted[~big].sum() * n)
  obs, exp = obs[exp > 0], exp[exp > 0]
  chi2 = float(np.sum((obs - exp) ** 2 / exp))
  assert chi2 < stats.chi2.ppf(1 - 1e-3, obs.size - 1), (chi2, obs.size)


def test_full_vocabulary_draw_across_blocks():
  """The full-vocabulary draw (inverse CDF over blocks of ``S._BLOCK`` ids) lands only on kept
  ids wherever they sit: mass in the last, partial block only; one kept id at the very end; a
  row with all its mass in one block between empty ones; plain temperature rows beside a top-k
  row (the cap's top_k skipped only when no row filters)."""
  v = 2 * S._BLOCK + 77
  x = np.full(v, -np.inf, np.float32)
  x[2 * S._BLOCK + 3:] = np.linspace(-1, 1, v - 2 * S._BLOCK - 3)
  last = np.full(v, -np.inf, np.float32)
  last[-1] = 0.0
  mid = np.full(v, -np.inf, np.float32)
  mid[S._BLOCK + 10:S._BLOCK + 20] = 0.5
  for logits, ok in ((x, set(range(2 * S._BLOCK + 3, v))), (last, {v - 1}),
                     (mid, set(range(S._BLOCK + 10, S._BLOCK + 20)))):
    got = set(_draws(logits, SamplingParams(1.0, seed=11), 400).tolist())
    assert got <= ok and len(got) >= min(len(ok), 5), (sorted(got)[:10], len(ok))
  rng = np.random.default_rng(2)
  y = _distinct_logits(rng, v, 1.0)
  s = SamplingArrays.from_params([SamplingParams(1.0, seed=4), SamplingParams(1.0, top_k=3,
                                                                             seed=4)])
  top3 = set(np.argsort(-y)[:3].tolist())
  for i in range(30):
    t = np.asarray(_sample(jnp.asarray(np.stack([y, y])), jnp.full(2, i), s, False))
    assert 0 <= t[0] < v and int(t[1]) in top3


def test_small_vocab_support():
  logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
  assert set(_draws(logits, SamplingParams(1.0, top_k=2, seed=3), 600)) == {0, 1}
  # top_p 0.6: 0.5 alone is below 0.6, so the nucleus is {0, 1}.
  assert set(_draws(logits, SamplingParams(1.0, top_p=0.6, seed=3), 600)) == {0, 1}
  c = collections.Counter(_draws(logits, SamplingParams(1.0, seed=3), 600).tolist())
  assert set(c) == {0, 1, 2, 3} and c[0] > c[1] > c[2] > c[3]


def test_argmax_matches_numpy_including_ties():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((5, 1000)).astype(np.float32)
  x[2, 10] = x[2, 500] = 9.0  # tie: first index wins, as np.argmax
  np.testing.assert_array_equal(argmax(jnp.asarray(x)), np.argmax(x, -1))
  assert int(argmax(jnp.full((1, 7), jnp.nan))[0]) == 6  # stays a valid id


@pytest.mark.parametrize("v", [8192, 49152, 50257])
def test_two_level_argmax_is_the_first_index_of_the_maximum(v):
  from serving.sampling import _argmax_blocks
  nb = _argmax_blocks(v)
  assert nb > 1 and v % nb == 0  # these sizes take the two-level search
  s = v // nb
  rng = np.random.default_rng(v)
  x = rng.standard_normal((8, v)).astype(np.float32)
  x[1, [s - 1, s, 3 * s]] = 9.0  # a tie across blocks: the first block's id
  x[2, [s + 5, s + 6]] = 9.0  # a tie inside a block
  x[3, -1] = 9.0  # the last id
  x[4] = -np.inf  # nothing but -inf: id 0, as np.argmax
  x[5, 7] = 9.0
  got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
  np.testing.assert_array_equal(got[:6], np.argmax(x[:6], -1))
  x[6, s + 3] = np.nan  # a NaN anywhere: the last id (a valid id), as the one-level search
  x[7, :] = np.nan
  got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
  assert got[6] == got[7] == v - 1


def _mixed_batch(rng: np.random.Generator, v: int = 3000
                 ) -> tuple[np.ndarray, list[SamplingParams]]:
  params = [SamplingParams(0.0, top_k=5, top_p=0.5),  # greedy, filters ignored
            SamplingParams(0.9, top_k=20, seed=11),  # cap path
            SamplingParams(1.0, top_k=0, top_p=0.99, seed=12),  # flat: exact nucleus path
            SamplingParams(1.1, top_k=500, top_p=0.9, seed=13),  # exact top-k path
            SamplingParams(0.7, seed=14),  # no filter
            SamplingParams(0.0)]
  x = np.stack([_distinct_logits(rng, v, 0.5 if i % 2 else 3.0) for i in range(len(params))])
  return x, params


def test_greedy_rows_seeds_and_batch_independence():
  rng = np.random.default_rng(3)
  x, params = _mixed_batch(rng)
  step = _sample
  s = SamplingArrays.from_params(params)
  toks = np.stack([np.asarray(step(jnp.asarray(x), jnp.full(6, i), s, False)) for i in range(12)])
  again = np.stack([np.asarray(step(jnp.asarray(x), jnp.full(6, i), s, False)) for i in range(12)])
  np.testing.assert_array_equal(toks, again)  # same seed, same tokens
  np.testing.assert_array_equal(toks[:, [0, 5]], np.tile(np.argmax(x[[0, 5]], -1), (12, 1)))
  assert all(len(set(toks[:, j])) > 1 for j in (1, 2, 3, 4))  # sampled rows vary by position
  for j in (1, 2, 3, 4):  # each sampled row alone, and amid greedy-only rows, draws the same ids
    alone = SamplingArrays.from_params([params[j]])
    for i in range(12):
      assert int(step(jnp.asarray(x[j:j + 1]), jnp.array([i]), alone, False)[0]) == toks[i, j]
    # Same batch size, other neighbours (all greedy, other positions): the same ids.
    quiet = SamplingArrays.from_params([params[0]] * j + [params[j]] + [params[0]] * (5 - j))
    for i in (0, 3):
      pos = jnp.asarray(np.arange(6) * 7 + 1).at[j].set(i)
      assert int(step(jnp.asarray(x[::-1]).at[j].set(x[j]), pos, quiet, False)[j]) == toks[i, j]
  other = SamplingArrays.from_params([dataclasses.replace(p, seed=99) for p in params])
  moved = np.stack([np.asarray(step(jnp.asarray(x), jnp.full(6, i), other, False))
                    for i in range(12)])
  assert (moved[:, 1:5] != toks[:, 1:5]).any()  # another seed, other tokens
  np.testing.assert_array_equal(moved[:, [0, 5]], toks[:, [0, 5]])


def test_edge_cases_top_k_beyond_vocab_top_p_one_and_nan_rows():
  rng = np.random.default_rng(4)
  v = 500
  x = _distinct_logits(rng, v, 1.0)
  off = SamplingParams(1.0, seed=2)
  for same in (SamplingParams(1.0, top_k=v, seed=2), SamplingParams(1.0, top_k=10 * v, seed=2),
               SamplingParams(1.0, top_p=1.0, seed=2)):
    np.testing.assert_array_equal(_draws(x, same, 50), _draws(x, off, 50))
  # NaN logits are never drawn; an all-NaN sampled row gives a valid id; other rows unaffected.
  y = np.stack([x, x, np.full(v, np.nan, np.float32), x])
  y[0, ::2] = np.nan
  params = [SamplingParams(1.0, seed=1), SamplingParams(1.0, top_p=0.9, seed=1),
            SamplingParams(1.0, top_k=3, seed=1), SamplingParams(0.0)]
  s = SamplingArrays.from_params(params)
  for i in range(20):
    t = np.asarray(_sample(jnp.asarray(y), jnp.full(4, i), s, False))
    assert t[0] % 2 == 1 and 0 <= t[2] < v and t[3] == np.argmax(x)
    clean = _sample(jnp.asarray(np.stack([x] * 4)), jnp.full(4, i), s, False)
    assert t[1] == int(clean[1])


def test_logprobs_match_log_softmax():
  rng = np.random.default_rng(5)
  x = jnp.asarray(np.stack([_distinct_logits(rng, 1000, 2.0) for _ in range(3)]))
  tok = jnp.array([3, 999, 0])
  ref = np.asarray(jax.nn.log_softmax(x, axis=-1))
  for n in (0, 1, S.LOGPROBS_MAX):
    chosen, ids, lps = jax.jit(logprobs, static_argnums=2)(x, tok, n)
    assert ids.shape == lps.shape == (3, n) and ids.dtype == jnp.int32
    np.testing.assert_allclose(chosen, ref[np.arange(3), np.asarray(tok)], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ids, np.argsort(-ref, axis=-1)[:, :n])
    np.testing.assert_allclose(lps, np.take_along_axis(ref, np.asarray(ids), -1), atol=1e-5)
  with pytest.raises(ValueError):
    logprobs(x, tok, S.LOGPROBS_MAX + 1)


def test_seed_none_draws_a_fresh_seed_at_request_creation():
  assert SamplingParams().seed is None
  a, b = Request("a", (1, 2)), Request("b", (1, 2))
  assert isinstance(a.sampling.seed, int) and a.sampling.seed != b.sampling.seed
  assert Request("c", (1,), SamplingParams(1.0, seed=7)).sampling.seed == 7
  p = SamplingParams(1.0, top_k=4)
  assert p.resolved().seed is not None and p.resolved() != p and SamplingParams(seed=3).resolved(
  ).seed == 3
  seeds = SamplingArrays.from_params([SamplingParams(), p, p]).seed
  assert int(seeds[0]) == 0 and int(seeds[1]) != int(seeds[2])  # greedy 0, sampled fresh


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(logprobs=-1),
                                 dict(logprobs=S.LOGPROBS_MAX + 1)])
def test_invalid_params_raise(bad):
  with pytest.raises(ValueError):
    SamplingParams(**bad)


def test_nan_temperature_and_out_of_range_seed_raise():
  with pytest.raises(ValueError):
    SamplingParams(temperature=float("nan"))
  for seed in (-1, 2**32):
    with pytest.raises(ValueError):
      SamplingParams(seed=seed)


def test_no_full_vocabulary_sort_is_compiled():
  """XLA:CPU keeps lax.top_k as its TopK call (no sort over V) in sample and logprobs."""
  x = jnp.zeros((4, 500), jnp.float32)
  s = SamplingArrays.from_params([SamplingParams(1.0, seed=1)] * 4)
  for text in (_sample.lower(x, jnp.arange(4), s, False).compile().as_text(),
               jax.jit(logprobs, static_argnums=2).lower(x, jnp.arange(4), 8).compile().as_text()):
    assert "TopK" in text and " sort(" not in text


@pytest.mark.parametrize("min_p,top_p,temp", [(0.05, 1.0, 0.8), (0.2, 0.9, 1.5)])
def test_min_p_drops_the_unlikely_then_top_p(min_p, top_p, temp):
  """min_p as vLLM applies it (on the temperature-scaled probabilities, before top-p): every draw
  has p >= min_p * p_max, and the draws follow the reference renormalised over what is left."""
  rng = np.random.default_rng(11)
  x = _distinct_logits(rng, 300, 1.5)
  z = x.astype(np.float64) / temp
  kept = z >= z.max() + np.log(min_p)
  assert 3 < kept.sum() < 300  # the cut matters here
  ref, _ = _ref_probs(np.where(kept, x, np.float32(-1e30)), temp, 0, top_p)
  n = 6000
  got = _draws(x, SamplingParams(temp, 0, top_p, seed=9, min_p=min_p), n)
  assert set(got.tolist()) <= set(np.flatnonzero(ref).tolist())
  counts = np.bincount(got, minlength=x.size)
  idx = np.flatnonzero(ref * n >= 5)
  obs = np.append(counts[idx], n - counts[idx].sum())
  exp = np.append(ref[idx] * n, n - ref[idx].sum() * n)
  obs, exp = obs[exp > 0], exp[exp > 0]
  chi2 = float(np.sum((obs - exp) ** 2 / exp))
  assert chi2 < stats.chi2.ppf(1 - 1e-3, obs.size - 1), (chi2, obs.size)
  # min_p 0 (and greedy rows) leave the logits as they are.
  off = SamplingArrays.from_params([SamplingParams(temp, seed=1), SamplingParams(0.0, min_p=0.5)])
  x2 = np.stack([x, x])
  assert np.array_equal(np.asarray(S._min_p(jnp.asarray(x2), off)), x2)
