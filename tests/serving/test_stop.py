"""serving.stop: stop ids, stop strings across token boundaries, max/min tokens, held text."""

from __future__ import annotations

import numpy as np
import pytest

from models.text.tokenizer import ByteTokenizer
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


class _SpaceLeadByte(ByteTokenizer):
  """Bytes, plus id 300: ' ' followed by a UTF-8 lead byte, one token (SmolLM2's BPE has 39 such
  tokens, e.g. ' \\xe2'): its space is held back with the partial character."""

  SPACE_LEAD = 300

  def decode(self, ids):
    raw = b"".join(b" \xe2" if i == self.SPACE_LEAD else bytes([i]) for i in ids
                   if 0 <= i < 256 or i == self.SPACE_LEAD)
    return raw.decode("utf-8", errors="replace")

  @property
  def vocab_size(self) -> int:
    return 301


@pytest.mark.parametrize("tail,max_tokens", [([], 6), ([ByteTokenizer.EOS], 100)],
                         ids=["length", "stop_id"])
def test_text_held_with_a_partial_character_is_checked_at_the_end(tail, max_tokens):
  """The decoder holds ' ' + a partial byte; when the sequence ends there, the flushed text can
  complete a stop string: it is cut and the sequence finishes as ``stop``."""
  tok = _SpaceLeadByte()
  chk = StopChecker(tok, StopCriteria(max_tokens=max_tokens, stop_strings=("User: ",)))
  text, finish = "", None
  for i in list(b"User:") + [tok.SPACE_LEAD] + tail:
    step = chk.push(i)
    text += step.text
    finish = step.finish or finish
    if finish:
      break
  assert (text, finish) == ("", FinishReason.STOP)
  # Without the stop string the held text is released at the end, partial byte and all.
  chk = StopChecker(tok, StopCriteria(max_tokens=6))
  assert "".join(chk.push(i).text for i in list(b"User:") + [tok.SPACE_LEAD]) == "User: \ufffd"


def test_include_stop_str_and_stop_reason():
  ids = list(b"say END now")
  crit = StopCriteria(max_tokens=100, stop_strings=("XYZ", "END"), include_stop_str=True)
  chk = StopChecker(TOK, crit)
  text = "".join(chk.push(i).text for i in ids[:len("say END")])
  assert text == "say END" and chk.finish is FinishReason.STOP and chk.stop_reason == "END"
  text, finish, _, _ = _run(ids, StopCriteria(max_tokens=100, stop_strings=("END",)))
  assert text == "say "
  # An asked-for stop id is the reason; the tokenizer's own end id is not.
  chk = StopChecker(TOK, StopCriteria(max_tokens=9, stop_ids=(ord("!"),)))
  for i in b"ok!":
    chk.push(i)
  assert chk.stop_reason == ord("!")
  chk = StopChecker(TOK, StopCriteria(max_tokens=9))
  chk.push(ord("a"))
  assert chk.push(TOK.EOS).finish is FinishReason.STOP and chk.stop_reason is None


def test_keep_special_keeps_the_texts_of_special_tokens():
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers
  from models.text.tokenizer import TokenizersTokenizer, bytes_to_unicode
  chars = bytes_to_unicode()
  t = tokenizers.Tokenizer(models.BPE({chars[b]: b for b in range(256)}, []))
  t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  t.decoder = decoders.ByteLevel()
  t.add_special_tokens(["<s>", "<x>", "</s>"])
  tok = TokenizersTokenizer(t, bos_id=256, eos_ids=[258])
  ids = [ord("a"), 257, ord("b"), 258]
  for keep, want in ((False, "ab"), (True, "a<x>b")):
    chk = StopChecker(tok, StopCriteria(max_tokens=9, keep_special=keep))
    assert "".join(chk.push(i).text for i in ids) == want  # the end id's text never
