"""serving.draft_model on the tiny model (f32): the proposer's ids are the draft model's greedy
continuation (a dense forward re-run per id), also after a rejection (rolled back to the prefix
shared with the context: only the new ids prefilled) and with more keys than slots (the least
recent gives its slot up); in the engine, a self-draft (the target's own weights) is accepted
nearly always, a different model's draft rarely, and both keep the ids of a run without
speculation; no program compiles after the warm-up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.step import UnshardedStep
from models.text.tokenizer import ByteTokenizer
from models.transformer import forward
from models.weights import init_params
from serving.draft_model import DraftModel, build_draft, check_tokenizers
from serving.speculative import DraftQuery
from tests.cpu_policies import NATIVE
from tests.serving.test_spec_engine import CFG, SPEC_ROWS, _requests, _serve

MARGIN = 1e-4  # a top-2 logit gap below this is a near-tie: summation order may flip it


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(3), jnp.float32)  # test_spec_engine's target


@pytest.fixture(scope="module")
def other():
  return init_params(CFG, jax.random.key(11), jnp.float32)


def _proposer(params, k=4, slots=SPEC_ROWS, chunk=16):
  p = build_draft(DraftModel(UnshardedStep(CFG, backend=NATIVE), params, "tiny"), k=k,
                  slots=slots, context=CFG.max_seq_len, chunk=chunk,
                  valid_vocab=CFG.vocab_size, kv_dtype="float32")
  assert p.warmup() > 0
  p.seal()
  return p


def _greedy(params, tokens, k) -> tuple[list[int], bool]:
  """The draft's k greedy ids after ``tokens`` by dense forwards, and whether a near-tie came."""
  ctx, out, tie = list(tokens), [], False
  for _ in range(k):
    logits = np.asarray(forward(params, jnp.asarray([ctx]), cfg=CFG)[0, -1], np.float32)
    top2 = np.sort(logits)[-2:]
    tie |= bool(top2[1] - top2[0] < MARGIN)
    out.append(int(np.argmax(logits)))
    ctx.append(out[-1])
  return out, tie


def _agree(got, want_tie):
  want, tie = want_tie
  assert len(got) == len(want)
  if not tie:
    assert list(got) == want


@pytest.fixture(scope="module")
def other_draft(other):
  return _proposer(other)


def test_drafts_are_the_draft_models_greedy_ids_across_rollbacks_and_evictions(other,
                                                                                 other_draft):
  p = other_draft
  rng = np.random.default_rng(5)
  a = [int(t) for t in rng.integers(0, 256, 37)]  # three chunks of 16 to catch up
  b = [int(t) for t in rng.integers(0, 256, 9)]
  got = p.draft([DraftQuery("a", a, 4), DraftQuery("b", b, 3)])
  _agree(got[0], _greedy(other, a, 4))
  _agree(got[1], _greedy(other, b, 3))
  assert p.caught_up == 37 + 9 and p.calls == 1
  # "a" accepted two drafts and sampled its own third id: the drafts' KV is the draft's
  # already, only the last id is new.
  a2 = a + list(got[0][:2]) + [(got[0][2] + 1) % 256]
  got2 = p.draft([DraftQuery("a", a2, 4)])
  _agree(got2[0], _greedy(other, a2, 4))
  assert p.caught_up == 37 + 9 + 1
  # A fourth key in three slots: "b" (least recent) gives its slot up and later starts over.
  c = [int(t) for t in rng.integers(0, 256, 5)]
  _agree(p.draft([DraftQuery("c", c, 2)])[0], _greedy(other, c, 2))
  _agree(p.draft([DraftQuery("c2", c[:3], 2)])[0], _greedy(other, c[:3], 2))
  assert set(p._keys) == {"a", "c", "c2"}
  b2 = b + [int(got[1][0])]
  _agree(p.draft([DraftQuery("b", b2, 3)])[0], _greedy(other, b2, 3))
  assert p.caught_up == 37 + 9 + 1 + 5 + 3 + 10  # "b" from scratch
  for key in ("c", "c2", "b"):
    p.forget(key)
  assert not p.pool.sequences and sorted(p._free) == [0, 1, 2]
  # k is capped by the proposer's own k and by the context's end.
  assert len(p.draft([DraftQuery("d", a, 9)])[0]) == 4
  end = [1] * (CFG.max_seq_len - 1)
  assert len(p.draft([DraftQuery("e", end, 4)])[0]) == 2  # positions up to the last one
  assert p.engine.program_set.unwarmed == 0 and p.engine.program_set.covered == 0
  for key in ("d", "e"):
    p.forget(key)


def test_tokenizers_must_match():
  check_tokenizers(ByteTokenizer(), ByteTokenizer())

  class Other(ByteTokenizer):
    def encode(self, text):
      return [t + 1 for t in super().encode(text)]

  with pytest.raises(ValueError, match="tokenizer"):
    check_tokenizers(ByteTokenizer(), Other())


@pytest.fixture(scope="module")
def reference(params):
  reqs = _requests(16)
  greedy = [r for r in reqs if r.sampling.temperature == 0]
  return {"all": (reqs, _serve(params, reqs)[0]), "greedy": (greedy, _serve(params, greedy)[0])}


@pytest.mark.parametrize("draft", ["self", "other"])
def test_engine_ids_with_a_draft_model_equal_plain(params, other_draft, reference, draft):
  """The self-draft on greedy rows: its proposals are the target's own ids (all accepted but
  after a near-tie); another random model on greedy and sampled rows: rarely accepted."""
  reqs, want = reference["greedy" if draft == "self" else "all"]
  proposer = _proposer(params) if draft == "self" else other_draft
  got, sched = _serve(params, reqs, proposer=proposer)
  assert got == want
  c = sched.spec
  assert c.drafts >= 5 and c.failures == 0
  rate = c.accepted_tokens / c.draft_tokens
  assert rate > 0.9 if draft == "self" else rate < 0.3, (draft, c)
  assert not proposer._keys  # every finished sequence was forgotten
  assert proposer.engine.program_set.unwarmed == 0
