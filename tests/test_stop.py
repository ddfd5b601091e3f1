"""serving.stop: stop ids, stop strings across token boundaries, max/min tokens, held text."""

from __future__ import annotations

import numpy as np
import pytest

from models.tokenizer import ByteTokenizer
from serving.stop import FinishReason, StopChecker, StopCriteria

TOK = ByteTokenizer()


def _run(text_ids, criteria):
  chk = StopChecker(TOK, criteria)
  out, finish = [], None
  for i in text_ids:
    step = chk.push(i)
    out.append(step.text)
    if step.finish:
      finish = step.finish
      break
  return "".join(out), finish, chk.all_ids, out


def test_stop_string_spanning_tokens_is_cut_and_never_released():
  ids = list(b"Hello wor") + list(b"ld END more")
  text, finish, all_ids, pieces = _run(ids, StopCriteria(max_tokens=100, stop_strings=("END",)))
  assert finish == FinishReason.STOP
  assert text == "Hello world "
  assert all("E" not in p for p in pieces)  # held back while it could start "END"
  assert all_ids == ids[:len("Hello world END")]


def test_partial_match_released_when_it_diverges():
  ids = list(b"an ENtry")
  text, finish, _, pieces = _run(ids, StopCriteria(max_tokens=len(ids), stop_strings=("END",)))
  assert finish == FinishReason.LENGTH and text == "an ENtry"
  assert pieces[3] == "" and pieces[4] == ""  # "E", "EN" held


def test_stop_id_included_in_ids_excluded_from_text():
  ids = list(b"abc") + [ByteTokenizer.EOS] + list(b"zzz")
  text, finish, all_ids, _ = _run(ids, StopCriteria(max_tokens=10))
  assert (text, finish, all_ids) == ("abc", FinishReason.STOP, ids[:4])


def test_ignore_eos_and_min_tokens():
  ids = [ByteTokenizer.EOS] + list(b"ab") + [ByteTokenizer.EOS]
  _, finish, all_ids, _ = _run(ids, StopCriteria(max_tokens=4, ignore_eos=True))
  assert finish == FinishReason.LENGTH and all_ids == ids
  _, finish, all_ids, _ = _run(ids, StopCriteria(max_tokens=10, min_tokens=2))
  assert finish == FinishReason.STOP and all_ids == ids  # the first EOS came before min_tokens
  _, finish, all_ids, _ = _run(list(b"xSTOPy"), StopCriteria(max_tokens=10, stop_ids=(ord("y"),)))
  assert finish == FinishReason.STOP and all_ids[-1] == ord("y")


def test_utf8_never_split():
  ids = list("naïve café 🚀!".encode())
  text, _, _, pieces = _run(ids, StopCriteria(max_tokens=len(ids)))
  assert text == "naïve café 🚀!"
  assert all("\ufffd" not in p for p in pieces)


def test_random_texts_never_contain_a_stop_string():
  rng = np.random.default_rng(0)
  alphabet = list(b"abAB ")
  for _ in range(300):
    ids = [int(c) for c in rng.choice(alphabet, size=int(rng.integers(1, 40)))]
    stops = ("aB", "bA a", "BB")
    text, finish, all_ids, _ = _run(ids, StopCriteria(max_tokens=len(ids), stop_strings=stops))
    full = bytes(all_ids).decode()
    assert not any(s in text for s in stops)
    assert full.startswith(text)
    if finish == FinishReason.STOP:
      assert any(full[len(text):].startswith(s) for s in stops)
    else:
      assert text == full


def test_bad_criteria():
  for kw in (dict(max_tokens=0), dict(max_tokens=3, min_tokens=4), dict(max_tokens=3,
                                                                        stop_strings=("",))):
    with pytest.raises(ValueError):
      StopCriteria(**kw)
