"""serving.grammar_rows on the byte tokenizer: masks per row, accepted ids, a slot reused by
another request while an id of the old one is in flight, a resumed request's replay."""

from __future__ import annotations

import json

import numpy as np
import pytest

from models.text.tokenizer import ByteTokenizer
from serving.grammar import GrammarCompiler
from serving.grammar_rows import GrammarRows
from serving.grammar_spec import Grammar
from serving.token_mask import allowed_ids

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def choice():
  return GrammarCompiler(TOK).compile(Grammar("choice", json.dumps(["yes", "no"])))


def test_masks_follow_accepted_ids_and_unconstrained_rows_are_off(choice):
  g = GrammarRows(TOK.VOCAB_SIZE)
  assert not g.active and g.masks([("a", 0, 0)], 2) is None
  g.setup(3, "a", choice)
  g.setup(5, "b", None)
  assert g.active and g.constrained([("a", 3)]) and not g.constrained([("b", 5), ("z", 3)])
  mask_RW, on_R = g.masks([("b", 5, 0), ("a", 3, 1)], 4)
  assert on_R.tolist() == [False, True, False, False]
  assert set(allowed_ids(mask_RW[1], TOK.VOCAB_SIZE)) == {ord("y"), ord("n")}
  assert not mask_RW[0].any()
  g.accept({"a": ord("n"), "b": 7})
  mask_RW, _ = g.masks([("a", 3, 0)], 1)
  assert allowed_ids(mask_RW[0], TOK.VOCAB_SIZE).tolist() == [ord("o")]
  g.accept({"a": ord("o")})
  mask_RW, _ = g.masks([("a", 3, 0)], 1)
  assert allowed_ids(mask_RW[0], TOK.VOCAB_SIZE).tolist() == [TOK.EOS]  # complete: eos only


def test_a_reused_slot_ignores_the_old_requests_late_id(choice):
  g = GrammarRows(TOK.VOCAB_SIZE)
  g.setup(0, "old", choice)
  g.setup(0, "new", choice)
  g.accept({"old": ord("y")})  # the old request's last id, read after the slot moved on
  mask_RW, _ = g.masks([("new", 0, 0)], 1)
  assert set(allowed_ids(mask_RW[0], TOK.VOCAB_SIZE)) == {ord("y"), ord("n")}
  assert g.masks([("old", 0, 0)], 1) is None


def test_a_resumed_request_replays_its_ids_and_a_refused_id_unconstrains(choice):
  g = GrammarRows(TOK.VOCAB_SIZE)
  g.setup(1, "r", choice, output_ids=list(b"ye"))
  mask_RW, _ = g.masks([("r", 1, 0)], 1)
  assert allowed_ids(mask_RW[0], TOK.VOCAB_SIZE).tolist() == [ord("s")]
  g.accept({"r": ord("x")})  # not allowed: constraining that slot ends
  assert not g.active
  g.setup(2, "bad", choice, output_ids=list(b"maybe"))
  assert not g.active
