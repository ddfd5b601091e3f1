"""serving.sampling: greedy argmax ties and NaNs, top-k / top-p support, seed determinism."""

import collections

import jax.numpy as jnp
import numpy as np
import pytest

from serving.sampling import SamplingArrays, SamplingParams, argmax, sample


def test_argmax_matches_numpy_including_ties():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((5, 1000)).astype(np.float32)
  x[2, 10] = x[2, 500] = 9.0  # tie: first index wins, as np.argmax
  np.testing.assert_array_equal(argmax(jnp.asarray(x)), np.argmax(x, -1))
  assert int(argmax(jnp.full((1, 7), jnp.nan))[0]) == 6  # stays a valid id


def _counts(logits, params, n=300):
  s = SamplingArrays.from_params([params])
  return collections.Counter(int(sample(logits, jnp.array([i]), s, False)[0]) for i in range(n))


LOGITS = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))


def test_top_k_and_top_p_restrict_support():
  assert set(_counts(LOGITS, SamplingParams(1.0, top_k=2, seed=3))) == {0, 1}
  # top_p 0.6: 0.5 alone is below 0.6, so the nucleus is {0, 1}.
  assert set(_counts(LOGITS, SamplingParams(1.0, top_p=0.6, seed=3))) == {0, 1}
  c = _counts(LOGITS, SamplingParams(1.0, seed=3), n=600)
  assert set(c) == {0, 1, 2, 3} and c[0] > c[1] > c[2] > c[3]


def test_greedy_rows_and_seeds():
  s = SamplingArrays.from_params([SamplingParams(0.0), SamplingParams(1.0, seed=7)])
  logits = jnp.concatenate([LOGITS, LOGITS])
  a = [tuple(np.asarray(sample(logits, jnp.array([i, i]), s, False))) for i in range(20)]
  b = [tuple(np.asarray(sample(logits, jnp.array([i, i]), s, False))) for i in range(20)]
  assert a == b and all(row[0] == 0 for row in a)
  assert len({row[1] for row in a}) > 1


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0),
                                 dict(top_p=1.5)])
def test_invalid_params_raise(bad):
  with pytest.raises(ValueError):
    SamplingParams(**bad)


def test_nan_temperature_and_out_of_range_seed_raise():
  with pytest.raises(ValueError):
    SamplingParams(temperature=float("nan"))
  for seed in (-1, 2**32):
    with pytest.raises(ValueError):
      SamplingParams(seed=seed)
