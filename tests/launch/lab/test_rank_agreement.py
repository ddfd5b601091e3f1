"""launch.lab.rank_agreement: layout rankings judged against the measurements' own noise, by hand."""

from launch.lab.rank_agreement import Timed, band, judge, resolved


def test_bands_resolve_only_when_disjoint():
  assert band((1.3, 1.0, 9.0)) == (1.0, 9.0)
  assert resolved((1.0, 1.1), (1.2, 1.3))
  assert not resolved((1.0, 1.25), (1.2, 1.3))  # overlapping bands: a tie at this resolution
  assert not resolved((1.0, 1.1, 5.0), (1.2, 1.3, 1.3))  # one slow call makes a tie
  assert not resolved((1.0,), (1.0,))
  assert resolved((2.0,), (1.0, 1.5))


def test_resolved_pairs_counted_and_ordered():
  a = Timed((1.0, 1.05), 10.0)  # fastest measured, and predicted fastest
  b = Timed((1.02, 1.2), 30.0)  # overlaps a: unresolved from it
  c = Timed((2.0, 2.1), 20.0)  # resolved from both; predicted faster than b: wrong order
  r = judge([a, b, c])
  assert (r.pairs, r.resolved) == (3, 2)
  assert r.agree == 1 and r.rate == 0.5  # a < c agrees; b < c is predicted the other way
  assert r.pick_within_noise is True  # the pick is the best


def test_pick_within_noise_and_predicted_ties():
  best = Timed((1.0, 1.1), 5.0)
  near = Timed((1.04, 1.3), 4.0)  # the pick: slower by min, but its band overlaps best's
  far = Timed((3.0, 3.1), 5.0)  # predicted tie with best: cannot order a resolved pair
  r = judge([best, near, far])
  assert r.pick_within_noise is True
  assert r.resolved == 2 and r.agree == 1  # near < far agrees; best vs far is a predicted tie
  assert judge([Timed((1.0, 1.1), 5.0), Timed((2.0, 2.2), 1.0)]).pick_within_noise is False
  assert judge([Timed((1.0,), None)]).pick_within_noise is None  # nothing predicted
