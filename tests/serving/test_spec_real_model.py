"""Speculative decoding on the real model (SmolLM2-135M-Instruct, f32): 32 input-grounded chat
prompts (repeat, correct or shout a sentence of the project's English passages) give identical
greedy ids with n-gram drafts verified (k = 4) at batch 8 and (the first 16) at batch 1 as without
speculation at batch 8; the drafts are accepted often enough to matter; a control that accepts
every draft changes the ids.

f32: the verify call runs a row's k + 1 tokens through the matmul kernels of k + 1 rows, plain
decoding one row through the one-row kernel; in f32 both sum in the same order up to the last
bits, far below this model's top-2 margins. In bf16 the two kernels round differently and a
near-tie may flip (as between plain decoding at batch 1 and at batch 8): BUILD_NOTES
"Speculative decoding". A rare failure here (about one process in six to eight) is a known open
fault, not a near-tie (reproduced alone by ``launch.lab.verify_repro``): BUILD_NOTES
"Speculative decoding", "Open fault: a rare wrong computation".
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

from models.io.loader import load_model
from models.step import UnshardedStep
from serving import engine as engine_mod
from serving.engine import Engine, EngineConfig
from serving.kv_pages import PageBudget, PagePool
from serving.request import Request
from serving.sampling import SamplingParams
from serving.scheduler import Scheduler
from serving.speculative import NgramProposer
from serving.stop import StopCriteria
from launch.lab.passages import read_passages
from tests.cpu_policies import NATIVE
from tests.refenv import REPO
from tests.sched_steps import serve_all

TASKS = ("Repeat this sentence exactly: {}", "Correct the spelling of this sentence: {}",
         "Rewrite this sentence in capital letters: {}", "Copy this sentence, then stop: {}")
MAX_TOKENS = 16
Z, PAGES = 64, 64


@pytest.fixture(scope="module")
def model():
  cfg, params, tok = load_model("smollm2-135m", jnp.float32)
  return UnshardedStep(cfg, backend=NATIVE), params, tok


@pytest.fixture(scope="module")
def requests(model):
  _, _, tok = model
  text = " ".join(read_passages(REPO / "tests" / "data" / "english_passages.txt"))
  sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if 40 <= len(s) <= 140][:32]
  assert len(sentences) == 32
  reqs = []
  for i, s in enumerate(sentences):
    if i % 4 == 1:  # a typo to correct
      s = s.replace("e", "ee", 1)
    ids = tok.encode_chat([{"role": "user", "content": TASKS[i % 4].format(s)}])
    reqs.append(Request(f"p{i}", tuple(ids), SamplingParams(),
                        StopCriteria(max_tokens=MAX_TOKENS)))
  return reqs


def _serve(model, reqs, slots, k):
  """At most ``slots`` (1 or 8) sequences at a time. Every run's engine has the same shapes (8
  slots, lag 1), so the prefill, decode and sampling programs compile once for the module (a
  compile of this f32 model costs seconds); batch 1 serves the requests one after another."""
  step, params, tok = model
  pool = PagePool(PageBudget(Z, PAGES), max_seq_tokens=512)
  sched = Scheduler(pool, tok, max_slots=8, max_step_tokens=256, max_chunk=128,
                    max_prefill_chunks=2, proposer=NgramProposer(k) if k else None,
                    spec_max_rows=8)
  engine = Engine(step, params, EngineConfig(
      max_slots=8, num_pages=PAGES, page_size=Z, max_seq_tokens=512, lag=1,
      spec_tokens=k, spec_rows=8, valid_vocab=tok.vocab_size))
  assert slots in (1, 8)
  got: dict[str, list[int]] = {}
  for part in ([r] for r in reqs) if slots == 1 else [reqs]:
    got |= serve_all(sched, engine, part)
  assert pool.pages_used == 0
  return got, sched.spec


@pytest.fixture(scope="module")
def reference(model, requests):
  return _serve(model, requests, 8, 0)[0]


@pytest.mark.parametrize("slots", [1, 8])
def test_speculation_keeps_the_greedy_ids(model, requests, reference, slots):
  # Batch 1 serves the first 16 (four of each task): one at a time, it costs the most suite time.
  reqs = requests[:16] if slots == 1 else requests
  got, counts = _serve(model, reqs, slots, 4)
  assert got == {r.request_id: reference[r.request_id] for r in reqs}
  assert counts.drafts >= len(reqs) and counts.accepted_tokens >= 0.3 * counts.draft_tokens, counts


def test_control_accepting_every_draft_changes_the_ids(model, requests, reference, monkeypatch):
  real = engine_mod.verify_call

  def blind(*args, **kw):
    kv, last_X, tok_R, _ = real(*args, **kw)
    return kv, last_X, tok_R, jnp.asarray(args[11])

  monkeypatch.setattr(engine_mod, "verify_call", blind)
  got, _ = _serve(model, requests[:8], 8, 4)
  assert got != {r.request_id: reference[r.request_id] for r in requests[:8]}
