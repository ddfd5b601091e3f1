"""Speculative decoding on the engine (tiny random model, f32): the ids with draft ids verified
equal the ids without, greedy and sampled, with acceptance, partial acceptance and rejection all
exercised, pages rolled back under preemption, and no program compiled after the warm-up.

An oracle proposer (the ids of a run without speculation, corrupted at the second draft id of
every third proposal) guarantees accepted and rejected drafts on a random model, where n-gram
lookup accepts little; the control accepts every draft blindly and must change the ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_preset
from models.step import UnshardedStep
from models.text.tokenizer import ByteTokenizer
from models.weights import init_params
from serving import engine as engine_mod
from serving.engine import Engine, EngineConfig
from serving.kv_pages import PageBudget, PagePool
from serving.request import Request
from serving.sampling import SamplingParams
from serving.scheduler import Scheduler
from serving.spec_verify import verify_sizes, verify_tokens
from serving.speculative import ContextProposer, NgramProposer
from serving.stop import StopCriteria
from tests.cpu_policies import NATIVE
from tests.sched_steps import serve_all

CFG = get_preset("tiny").replace(max_seq_len=128)
SLOTS, Z, CHUNK = 8, 8, 32
# Speculate while at most 3 rows decode: a verify call then holds at most 16 tokens, the rows
# the native f32 kernel takes (DEFAULT policy), as a plain decode's 8 do. A random model's
# logits are nearly tied, and a 32- or 64-row call through XLA's dot summed them in another
# order: in one suite run two requests' ids flipped after a near-tie (isolated runs agreed).
SPEC_ROWS = 3


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(3), jnp.float32)


def _requests(n=12):
  rng = np.random.default_rng(0)
  reqs = []
  for i in range(n):
    pattern = [int(t) for t in rng.integers(0, 256, int(rng.integers(2, 7)))]
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=i) if i % 3 == 1 else \
        SamplingParams(seed=i)
    reqs.append(Request(f"r{i}", tuple(pattern * int(rng.integers(2, 6))), sampling,
                        StopCriteria(max_tokens=int(rng.integers(8, 28)), ignore_eos=True),
                        speculate=i != 5))
  return reqs


def _serve(params, reqs, *, proposer=None, pages=64, slots=SLOTS, k=4, lag=0):
  pool = PagePool(PageBudget(Z, pages), max_seq_tokens=CFG.max_seq_len)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=slots, max_step_tokens=64, max_chunk=CHUNK,
                    max_prefill_chunks=2, proposer=proposer, spec_max_rows=SPEC_ROWS)
  engine = Engine(UnshardedStep(CFG, backend=NATIVE), params, EngineConfig(
      max_slots=slots, num_pages=pages, page_size=Z, max_seq_tokens=CFG.max_seq_len, lag=lag,
      spec_tokens=k if proposer else 0, spec_rows=SPEC_ROWS))
  engine.warmup(2, CHUNK, max_tokens=64)
  engine.seal()
  got = serve_all(sched, engine, reqs)
  assert pool.pages_used == 0 and sched.idle
  assert engine.program_set.unwarmed == 0 and engine.program_set.covered == 0
  return got, sched


class _Oracle(ContextProposer):
  """Proposes the reference run's next ids for the context (every third proposal corrupted at
  its second id)."""
  k = 4

  def __init__(self, reqs, want):
    self.by_prompt = {r.prompt_ids: want[r.request_id] for r in reqs}
    self.calls = 0

  def propose(self, tokens, k):
    for prompt, ids in self.by_prompt.items():
      if tuple(tokens[:len(prompt)]) == prompt:
        out = list(ids[len(tokens) - len(prompt):][:k])
        self.calls += 1
        if self.calls % 3 == 0 and len(out) > 1:
          out[1] = (out[1] + 1) % 256
        return tuple(out)
    return ()


@pytest.fixture(scope="module")
def reference(params):
  reqs = _requests()
  return reqs, _serve(params, reqs)[0]


def test_oracle_drafts_give_the_same_ids(params, reference):
  reqs, want = reference
  got, sched = _serve(params, reqs, proposer=_Oracle(reqs, want))
  assert got == want
  c = sched.spec
  assert c.drafts >= 8 and 0 < c.accepted_tokens < c.draft_tokens
  assert c.accepted_per_pos[0] > c.accepted_per_pos[1] > 0  # the corruption bites at the second
  assert c.accepted_per_pos[3] > 0  # whole proposals accepted


def test_ngram_drafts_give_the_same_ids(params, reference):
  reqs, want = reference
  got, sched = _serve(params, reqs, proposer=NgramProposer(k=3))
  assert got == want
  assert sched.spec.drafts > 0


def test_preemption_with_drafts_in_a_small_pool(params, reference):
  reqs, want = reference
  got, sched = _serve(params, reqs, proposer=_Oracle(reqs, want), pages=12)
  assert got == want
  assert sched.spec.accepted_tokens > 0


def test_control_accepting_every_draft_changes_the_ids(params, reference, monkeypatch):
  reqs, want = reference
  real = engine_mod.verify_call

  def blind(*args, **kw):  # the counts a broken acceptance rule would give: every draft
    kv, last_X, tok_R, _ = real(*args, **kw)
    return kv, last_X, tok_R, jnp.asarray(args[11])

  blind.lower = real.lower  # the warm-up compiles the real program
  monkeypatch.setattr(engine_mod, "verify_call", blind)
  got, _ = _serve(params, reqs, proposer=_Oracle(reqs, want))
  assert got != want


def test_verify_sizes_fit_full_drafts_exactly():
  assert verify_sizes(4, 1) == [5]
  assert verify_sizes(4, 4) == [5, 10, 20]
  assert verify_sizes(7, 3) == [8, 16, 24]
  assert verify_tokens(1, 4, 4, 4) == 5  # batch 1, a full draft: no padding token
  assert verify_tokens(1, 2, 4, 4) == 5
  assert verify_tokens(2, 5, 4, 4) == 10
  assert verify_tokens(3, 12, 4, 4) == 20


def test_verify_calls_run_only_the_warmed_exact_sizes(params, reference, monkeypatch):
  """Every verify call ran one of ``verify_sizes(k, SPEC_ROWS)`` (k = 4, 3 rows: 5, 10, 15), the
  one-row size included, and none had to be covered by a larger program."""
  reqs, want = reference
  seen: list[int] = []
  real = engine_mod.verify_call

  def spy(*args, **kw):
    seen.append(int(args[4].shape[0]))
    return real(*args, **kw)

  spy.lower = real.lower  # the warm-up compiles the real program
  monkeypatch.setattr(engine_mod, "verify_call", spy)
  got, _ = _serve(params, reqs, proposer=_Oracle(reqs, want))
  assert got == want
  assert seen and set(seen) <= set(verify_sizes(4, SPEC_ROWS)) and 5 in seen, seen


def test_a_lagged_engine_speculates_while_the_driver_flushes(params, reference):
  """lag 1 (the server's default): while the scheduler is ``synchronous`` the driver collects
  each step before the next plan, so rows draft as at lag 0 and the ids are the same."""
  reqs, want = reference
  got, sched = _serve(params, reqs, proposer=_Oracle(reqs, want), lag=1)
  assert got == want
  assert sched.spec.drafts >= 8 and sched.spec.accepted_tokens > 0


def test_engine_refuses_speculation_with_sinks(params):
  with pytest.raises(ValueError, match="attention sinks"):
    Engine(UnshardedStep(CFG, backend=NATIVE), params, EngineConfig(
        max_slots=2, num_pages=8, page_size=Z, max_seq_tokens=64, lag=0, spec_tokens=2,
        sinks=True))
