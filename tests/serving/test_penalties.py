"""serving.penalties: ``apply`` against a numpy reference on the same logits and counts; the
engine end to end on the tiny model: every generated id of a greedy request with penalties is
the argmax of a numpy re-implementation over the model's own logits (frequency, presence,
repetition over the prompt, logit bias), in a batch with plain rows that get exactly their
unpenalised ids, with slots reused, under preemption and prefix-cache hits; a large logit bias
forces / bans an id (no program compiles after warm-up when penalties first appear:
tests/e2e/test_program_set.py); a control
shows the check can fail."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_preset
from models.step import UnshardedStep
from models.text.tokenizer import ByteTokenizer
from models.transformer import forward
from models.weights import init_params
from serving import penalties as P
from serving.engine import Engine, EngineConfig
from serving.kv_pages import PageBudget, PagePool
from serving.prefix_cache import PrefixCache
from serving.request import Request
from serving.sampling import LOGIT_BIAS_MAX, SamplingArrays, SamplingParams
from serving.scheduler import Scheduler
from serving.stop import StopCriteria
from tests.cpu_policies import NATIVE
from tests.penalty_ref import check_greedy, ref_apply
from tests.sched_steps import serve_all

CFG = get_preset("tiny").replace(max_seq_len=128)


def test_apply_matches_numpy_and_leaves_plain_rows_alone():
  rng = np.random.default_rng(0)
  v, rows = 1000, 6
  logits = (rng.standard_normal((rows, v)) * 8).astype(np.float32)
  counts = rng.integers(0, 4, (rows, v)).astype(np.int32) * (rng.random((rows, v)) < 0.05)
  prompt = rng.random((rows, v)) < 0.05
  params = [SamplingParams(),
            SamplingParams(presence_penalty=1.5),
            SamplingParams(frequency_penalty=-0.7),
            SamplingParams(repetition_penalty=1.3),
            SamplingParams(logit_bias=((3, 100.0), (999, -42.5), (7, 0.25))),
            SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.6,
                           logit_bias=tuple((int(t), 1.0) for t in range(LOGIT_BIAS_MAX)))]
  s = SamplingArrays.from_params(params)
  got = np.asarray(jax.jit(P.apply)(logits, counts, prompt, s))
  for i, p in enumerate(params):
    want = ref_apply(logits[i], counts[i], prompt[i], p)
    tol = 1e-6 * np.maximum(1.0, np.abs(want))  # relative to the magnitude (f32 rounding)
    assert np.all(np.abs(got[i] - want) <= tol), (i, np.max(np.abs(got[i] - want)))
  assert np.array_equal(got[0], logits[0])  # no penalty: bit for bit
  # The switch: a batch without penalties returns its logits; with one row, only that row moves.
  state = P.PenaltyState(jnp.asarray(counts), jnp.asarray(prompt))
  slots = jnp.arange(rows)
  off = SamplingArrays.from_params([SamplingParams()] * rows)
  assert np.array_equal(np.asarray(P.apply_if(logits, state, slots, off, lambda x: x)), logits)
  one = SamplingArrays.from_params([SamplingParams()] * 5 + [params[3]])
  mixed = np.asarray(P.apply_if(logits, state, slots, one, lambda x: x))
  assert np.array_equal(mixed[:5], logits[:5]) and not np.array_equal(mixed[5], logits[5])
  # Counting: only taken rows whose penalties read the ids; padding slots write nothing.
  sp = SamplingArrays.from_params([params[1], params[0], params[1], params[4]])
  zero = P.PenaltyState(jnp.zeros((3, v), jnp.int32), jnp.zeros((3, v), bool))
  out = P.count(zero, jnp.array([0, 1, 3, 2]), jnp.array([5, 6, 7, 8]),
                jnp.array([True, True, True, True]), sp)
  c = np.asarray(out.counts_XV)
  assert c[0, 5] == 1 and c.sum() == 1  # row 1: no penalty, row 2: slot 3 (padding), row 3: bias


def test_params_are_validated():
  for kw in (dict(presence_penalty=2.5), dict(frequency_penalty=-2.01),
             dict(frequency_penalty=float("nan")), dict(repetition_penalty=0.0),
             dict(repetition_penalty=float("inf")), dict(logit_bias=((1, 101.0),)),
             dict(logit_bias=((-1, 1.0),)), dict(logit_bias=((1, 1.0), (1, 2.0))),
             dict(logit_bias=tuple((t, 1.0) for t in range(LOGIT_BIAS_MAX + 1)))):
    with pytest.raises(ValueError):
      SamplingParams(**kw)
  assert SamplingParams(presence_penalty=0.1).penalized
  assert not SamplingParams(logit_bias=((1, 5.0),)).penalized


# -- the engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(3), jnp.float32)


def _engine(params, slots=5, pages=72):  # shapes of its own: no other module compiles them
  return Engine(UnshardedStep(CFG, backend=NATIVE), params, EngineConfig(
      max_slots=slots, num_pages=pages, page_size=8, max_seq_tokens=CFG.max_seq_len, lag=1))


@pytest.fixture(scope="module")
def engine(params):
  return _engine(params)  # shared: later tests reuse the slots earlier ones left counted


def _serve(engine, reqs, *, pages=72, chunk=16, cache=False, traces=None):
  pool = PagePool(PageBudget(8, pages), max_seq_tokens=CFG.max_seq_len)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=engine.config.max_slots,
                    max_step_tokens=chunk + engine.config.max_slots, max_chunk=chunk,
                    prefix_cache=PrefixCache(pool) if cache else None)
  return serve_all(sched, engine, reqs, traces)


def _req(rid, prompt, n=12, **kw):
  return Request(rid, tuple(prompt), SamplingParams(**kw), StopCriteria(max_tokens=n,
                                                                         ignore_eos=True))


def _check(params, req, ids) -> str:
  """``check_greedy`` over the model's own logits (one forward over the whole sequence)."""
  seq = list(req.prompt_ids) + ids[:-1]
  logits = np.asarray(forward(params, jnp.asarray([seq]), cfg=CFG)[0], np.float32)
  return check_greedy(logits, list(req.prompt_ids), ids, req.sampling)


PENALISED = [dict(presence_penalty=2.0), dict(frequency_penalty=1.5),
             dict(repetition_penalty=3.0), dict(frequency_penalty=-0.5, presence_penalty=0.5,
                                                 repetition_penalty=1.5, logit_bias=((65, 1.0),))]


def test_penalised_and_plain_rows_in_one_batch(params, engine):
  """Each penalised row follows the numpy reference over the model's logits; the plain rows in
  the same batches get exactly their ids of a plain run. Twice: the second batch reuses the
  slots of the first (their counts start over)."""
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, 256, int(rng.integers(5, 30))).tolist() for _ in range(4)]
  plain = [_req(f"p{i}", p) for i, p in enumerate(prompts)]
  alone = _serve(engine, plain)
  for rnd in range(2):
    reqs = [_req(f"x{i}", prompts[i], **PENALISED[(i + rnd) % 4]) for i in range(2)] + \
        [_req(f"p{i}", prompts[i]) for i in range(2, 4)]
    got = _serve(engine, reqs)
    for r in reqs[2:]:
      assert got[r.request_id] == alone[r.request_id]
    for r in reqs[:2]:
      assert _check(params, r, got[r.request_id]) in ("equal", "near-tie"), r.sampling
  # The penalties changed something, and the check can fail: plain ids against a penalty.
  pen = _req("c", prompts[0], n=24, presence_penalty=2.0)
  got = _serve(engine, [pen])["c"]
  assert len(set(got)) == len(got)  # a huge presence penalty: no id repeats here
  assert got != _serve(engine, [_req("c", prompts[0], n=24)])["c"]
  assert _check(params, pen, _serve(engine, [_req("c", prompts[0], n=24)])["c"]).startswith(
      "differs")


def test_logit_bias_forces_and_bans_an_id(engine):
  prompt = list(range(40, 60))
  plain = _serve(engine, [_req("a", prompt, n=16)])["a"]
  common = max(set(plain), key=plain.count)
  got = _serve(engine, [_req("f", prompt, n=16, logit_bias=((200, 100.0),)),
                        _req("b", prompt, n=16, logit_bias=((common, -100.0),)),
                        _req("a", prompt, n=16)])
  assert got["f"] == [200] * 16
  assert common not in got["b"] and got["a"] == plain


def test_preempted_and_cached_requests_rebuild_their_counts(params):
  """A small page budget preempts sequences (recomputed from prompt + generated ids) and a
  prefix cache hands a second request its prompt's pages: their penalty rows are written from
  the ids at admission, so every id still follows the reference."""
  engine = _engine(params, slots=4, pages=14)
  rng = np.random.default_rng(3)
  shared = rng.integers(0, 256, 24).tolist()
  reqs = [_req(f"r{i}", shared if i < 2 else rng.integers(0, 256, 20).tolist(), n=24,
               **PENALISED[i % 4]) for i in range(6)]
  traces: dict = {}
  got = _serve(engine, reqs, pages=14, chunk=8, cache=True, traces=traces)
  assert any(e.kind == "preempted" for t in traces.values() for e in t.events)
  for r in reqs:
    assert len(got[r.request_id]) == 24
    assert _check(params, r, got[r.request_id]) in ("equal", "near-tie"), (
        r.request_id, [e.kind for e in traces[r.request_id].events])
