"""serving.generator: ragged prompts batch together exactly as alone, chunked prompts equal
one-shot ones, stop ids end a row, and new lengths within a bucket reuse compiled code."""

import jax
import numpy as np

from models.config import get_preset
from models.weights import init_params
from serving import generator as G
from serving.sampling import SamplingParams

CFG = get_preset("tiny")
PARAMS = init_params(CFG, jax.random.key(0))


def _gen(prompts, n, **kw):
  g = G.Generator(CFG, PARAMS, **kw)
  return np.stack(list(g.stream(prompts, n))).T  # [rows, steps]


def test_ragged_batch_equals_individual_runs():
  prompts = [[1, 2, 3], list(range(10, 30)), [7] * 9]
  together = _gen(prompts, 10, steps_per_call=4)
  for row, p in enumerate(prompts):
    np.testing.assert_array_equal(together[row], _gen([p], 10, steps_per_call=4)[0])


def test_chunked_prompt_equals_one_shot_and_step_grouping_is_invisible():
  prompt = list(range(40, 90))
  one_shot = _gen([prompt], 12, prefill_chunk=512, steps_per_call=1)
  chunked = _gen([prompt], 12, prefill_chunk=16, steps_per_call=8)
  np.testing.assert_array_equal(one_shot, chunked)


def test_padding_rows_do_not_change_results():
  prompt = [3, 1, 4, 1, 5]
  np.testing.assert_array_equal(_gen([prompt], 6), _gen([prompt], 6, min_batch=8))


def test_sampled_rows_depend_only_on_their_own_seed():
  g = G.Generator(CFG, PARAMS)
  s = SamplingParams(temperature=1.0, seed=11)
  alone = np.stack(list(g.stream([[9, 9]], 8, s))).T[0]
  mixed = np.stack(list(g.stream([[9, 9], [1, 2, 3]], 8, [s, SamplingParams(1.0, seed=5)]))).T
  np.testing.assert_array_equal(alone, mixed[0])


def test_stop_id_ends_row():
  g = G.Generator(CFG, PARAMS)
  free = np.stack(list(g.stream([[1, 2]], 8))).T[0]
  stop = int(free[2])
  first = list(free).index(stop)
  out = np.stack(list(g.stream([[1, 2]], 8, stop_ids=[stop]))).T[0]
  assert list(out) == list(free[:first + 1])


def test_no_retrace_within_bucket():
  g = G.Generator(CFG, PARAMS, steps_per_call=4)
  list(g.stream([[1] * 20], 8))
  sizes = (G.prefill_and_sample._cache_size(), G.decode_n._cache_size())
  for n in (17, 21, 24):  # same prompt bucket (32) and cache bucket (n + 8 <= 32)
    list(g.stream([[2] * n], 8))
  assert (G.prefill_and_sample._cache_size(), G.decode_n._cache_size()) == sizes


def test_bad_arguments_raise_value_error():
  import pytest
  g = G.Generator(CFG, PARAMS)
  for args in [([], 4), ([[1]], 0), ([[1], [2]], 2, [SamplingParams(1.0)])]:
    with pytest.raises(ValueError):
      list(g.stream(*args))
  with pytest.raises(ValueError):
    G.Generator(CFG, PARAMS, steps_per_call=0)


def test_valid_vocab_limits_sampled_ids():
  g = G.Generator(CFG, PARAMS, valid_vocab=10)
  out = np.stack(list(g.stream([[1, 2, 3]], 12, SamplingParams(temperature=1.0, seed=4))))
  assert out.max() < 10
