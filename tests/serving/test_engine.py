"""serving.engine under serving.scheduler on a real (tiny, random) model: greedy tokens equal
the batch generator's (what ``launch.generate`` runs) for every request, with chunked prefill on
and off, preemption forced by a small page budget, results lagged or not; a control shows the
comparison can fail. f32 activations, float or weight-only int8 weights.

"Equal" is token by token up to the first position where the reference's top-2 logit margin is
below ``MARGIN_EPS`` (a near-tie that summation order may flip); with f32 on CPU the paged and
contiguous paths have agreed exactly so far, and the test reports how often a near-tie cut a
comparison short.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_preset
from models.step import UnshardedStep
from tests.cpu_policies import NATIVE
from models.text.tokenizer import ByteTokenizer
from models.weights import init_params, quantize
from serving.engine import Engine, EngineConfig
from serving.generator import Generator
from serving.kv_pages import PageBudget, PagePool
from serving.lifecycle import RequestTrace
from serving.request import Request
from serving.sampling import SamplingParams
from serving.drive import run_to_completion
from serving.scheduler import Scheduler
from serving.stop import StopCriteria
from tests.sched_steps import serve_all

CFG = get_preset("tiny").replace(max_seq_len=128)
MARGIN_EPS = 1e-4


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(3), jnp.float32)


def _requests(rng, n=16, target=None):
  reqs = []
  for i in range(n):
    plen = int(rng.integers(3, 40))
    reqs.append(Request(f"r{i}", tuple(int(t) for t in rng.integers(0, 256, plen)),
                        SamplingParams(),
                        StopCriteria(max_tokens=int(rng.integers(4, 24)), ignore_eos=True)))
  if target is not None:
    reqs[int(rng.integers(0, n))] = target
  return reqs


def _serve(params, reqs, *, pages, chunk, lag, page_size=8, slots=8, waits=None):
  pool = PagePool(PageBudget(page_size, pages), max_seq_tokens=CFG.max_seq_len)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=slots, max_step_tokens=max(chunk, slots) + 8,
                    max_chunk=chunk)
  engine = Engine(UnshardedStep(CFG, backend=NATIVE), params,
                  EngineConfig(max_slots=slots, num_pages=pages, page_size=page_size,
                               max_seq_tokens=CFG.max_seq_len, lag=lag))
  traces = {r.request_id: RequestTrace(r.request_id) for r in reqs}
  for r in reqs:
    assert sched.add(r, traces[r.request_id]) is None
  def execute(plan):
    res = engine.execute(plan)
    if res is not None and waits is not None:
      waits.append(res.wait_s)
    return res

  outs = run_to_completion(sched, execute)
  for res in engine.flush():
    outs += sched.update(res)
  got = {}
  for o in outs:
    got.setdefault(o.request_id, []).extend(o.token_ids)
  assert pool.pages_used == 0 and sched.idle
  return got, traces, engine


def _reference(params, req):
  gen = Generator(CFG, params, max_len=CFG.max_seq_len, steps_per_call=4)
  return [int(s[0]) for s in gen.stream([list(req.prompt_ids)], req.stop.max_tokens,
                                        req.sampling, stop_ids=())]


def _margin(params, req, ids, j):
  """Top-2 margin of the reference logits before generated position ``j``."""
  from models.transformer import forward
  seq = list(req.prompt_ids) + ids[:j]
  logits = np.sort(np.asarray(forward(params, jnp.asarray([seq]), cfg=CFG)[0, -1]))
  return float(logits[-1] - logits[-2])


def _compare(params, req, want, got):
  """'equal', 'near-tie' (first difference after a top-2 margin < MARGIN_EPS) or a failure."""
  if want == got:
    return "equal"
  j = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
  if j is None:
    return f"length {len(got)} != {len(want)}"
  # The margins are only computed where the sequences part (a forward per distinct length).
  if any(_margin(params, req, want, i) < MARGIN_EPS for i in range(j + 1)):
    return "near-tie"
  return f"differs at {j}"


@pytest.mark.parametrize("chunk,pages,lag", [(64, 200, 1), (8, 200, 0), (8, 14, 1)],
                         ids=["unchunked", "chunked", "chunked-preempting"])
def test_greedy_tokens_equal_generate(params, chunk, pages, lag):
  rng = np.random.default_rng(chunk + pages)
  target = Request("target", tuple(range(40, 77)), SamplingParams(),
                   StopCriteria(max_tokens=20, ignore_eos=True))
  reqs = _requests(rng, target=target)
  waits: list[float] = []
  got, traces, engine = _serve(params, reqs, pages=pages, chunk=chunk, lag=lag, waits=waits)
  # Each result timed the host's wait for its ids (serving.step_timeline's "wait" phase).
  assert waits and min(waits) >= 0 and sum(waits) > 0
  near = 0
  for r in reqs:
    want = _reference(params, r)
    verdict = _compare(params, r, want, got[r.request_id])
    near += verdict == "near-tie"
    assert verdict in ("equal", "near-tie"), (r.request_id, verdict)
  assert near <= 2, f"{near} comparisons cut short by near-ties"
  preempted = sum(e.kind == "preempted" for t in traces.values() for e in t.events)
  if pages < 20:
    assert preempted > 0  # the small budget did force recomputation
  print(f"[engine] chunk {chunk} pages {pages}: {engine.programs} programs, "
        f"{preempted} preemptions, {near} near-ties")


def test_int8_weights_and_a_failing_control(params):
  q = quantize(params, CFG, act_quant=False)
  rng = np.random.default_rng(7)
  reqs = _requests(rng, n=6)
  got, _, _ = _serve(q, reqs, pages=100, chunk=16, lag=1)
  for r in reqs:
    want = _reference(q, r)
    assert _compare(q, r, want, got[r.request_id]) in ("equal", "near-tie")
  # Control: another model's tokens differ, so the comparison above can fail.
  other = init_params(CFG, jax.random.key(4), jnp.float32)
  assert any(_reference(other, r) != got[r.request_id] for r in reqs)


def test_sampling_is_independent_of_the_batch(params):
  target = Request("t", tuple(range(5, 25)), SamplingParams(temperature=0.9, top_k=20, seed=11),
                   StopCriteria(max_tokens=12, ignore_eos=True))
  alone, _, _ = _serve(params, [target], pages=100, chunk=16, lag=1)
  crowd, _, _ = _serve(params, _requests(np.random.default_rng(1), n=8, target=target),
                       pages=100, chunk=16, lag=1)
  assert alone["t"] == crowd["t"]
  assert alone["t"] == _reference(params, target)


def test_logprobs_of_chosen_and_best_tokens(params):
  """top-n logprobs through the batched engine equal log_softmax of the model's own logits."""
  from models.transformer import forward
  target = Request("lp", tuple(range(30, 45)), SamplingParams(logprobs=3),
                   StopCriteria(max_tokens=5, ignore_eos=True))
  other = Request("plain", tuple(range(5, 12)), SamplingParams(),
                  StopCriteria(max_tokens=5, ignore_eos=True))
  pool = PagePool(PageBudget(8, 64), max_seq_tokens=CFG.max_seq_len)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=4, max_step_tokens=32, max_chunk=16)
  engine = Engine(UnshardedStep(CFG, backend=NATIVE), params, EngineConfig(
      max_slots=4, num_pages=64, page_size=8, max_seq_tokens=CFG.max_seq_len, lag=1))
  for r in (target, other):
    sched.add(r, RequestTrace(r.request_id))
  outs = run_to_completion(sched, engine.execute)
  for res in engine.flush():
    outs += sched.update(res)
  ids = [i for o in outs if o.request_id == "lp" for i in o.token_ids]
  lps = [lp for o in outs if o.request_id == "lp" for lp in o.logprobs]
  assert len(lps) == len(ids) == 5
  assert all(not o.logprobs for o in outs if o.request_id == "plain")
  seq = list(target.prompt_ids) + ids
  ref = np.asarray(jax.nn.log_softmax(forward(params, jnp.asarray([seq]), cfg=CFG)[0], axis=-1))
  for j, lp in enumerate(lps):
    row = ref[len(target.prompt_ids) - 1 + j]
    assert lp.token_id == ids[j] and len(lp.top) == 3
    assert lp.top[0][0] == ids[j]  # greedy: the chosen id is the best one
    assert abs(lp.logprob - row[ids[j]]) <= 1e-4 * max(1.0, abs(row[ids[j]]))
    best = np.argsort(-row)[:3]
    assert [t for t, _ in lp.top] == best.tolist()
    assert np.allclose([v for _, v in lp.top], row[best], rtol=1e-4, atol=1e-4)


def test_warmup_compiles_every_bucket_then_serving_adds_none(params):
  """After warmup(), a mixed trace dispatches no program that was not compiled (greedy). The
  warm-up compiles its programs side by side (two threads) and then runs each once: XLA compiles
  each program exactly once (counted with JAX's own compile events), not again when it runs, and
  serving compiles nothing more."""
  pool = PagePool(PageBudget(8, 64), max_seq_tokens=CFG.max_seq_len)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=4, max_step_tokens=24, max_chunk=16,
                    max_prefill_chunks=2)
  engine = Engine(UnshardedStep(CFG, backend=NATIVE), params, EngineConfig(
      max_slots=4, num_pages=64, page_size=8, max_seq_tokens=CFG.max_seq_len, lag=1))
  compiles = []

  def on_event(name, secs, fun_name="", **kw):
    if name == "/jax/core/compile/backend_compile_duration" and (
        "prefill_call" in fun_name or "decode_call" in fun_name):
      compiles.append(fun_name)
  jax.monitoring.register_event_duration_secs_listener(on_event)
  try:
    n = engine.warmup(max_prefill_rows=2, max_chunk=16, threads=2)
    assert n - 1 == engine.programs == len(engine.buckets(2, 16))  # 1: penalty rows' fill
    assert len(compiles) <= n, compiles  # once each (fewer if a test compiled one already)
    warm = len(compiles)
  finally:
    jax.monitoring.unregister_event_duration_listener(on_event)
  reqs = _requests(np.random.default_rng(2), n=6)
  got = serve_all(sched, engine, reqs)
  assert engine.programs == n - 1, "serving compiled a program the warm-up missed"
  assert warm > 0
  for r in reqs[:2]:  # the warm-up changed no state
    assert got[r.request_id] == _reference(params, r)


def test_native_attention_makes_one_program_per_rows_and_chunk(params):
  """With the native paged attention (work follows each query's position) every model program
  attends the cap: one program per (phase, rows, chunk), not one per attended power of two; a
  sink pool's decode (the gather path: ring and shift) keeps the attended-length buckets."""
  kw = dict(max_slots=4, num_pages=64, page_size=8, max_seq_tokens=CFG.max_seq_len)
  engine = Engine(UnshardedStep(CFG, backend=NATIVE), params, EngineConfig(**kw))
  sinks = Engine(UnshardedStep(CFG, backend=NATIVE), params, EngineConfig(**kw, sinks=True))
  native = NATIVE.paged_attention
  assert engine.length_free == {"prefill": native, "decode": native}
  assert sinks.length_free == {"prefill": native, "decode": False}
  model = lambda e, p: [b for b in e.buckets(2, 32) if b[0] == p]
  rows_chunks = lambda e, p: {b[:3] for b in model(e, p)}
  assert len(model(sinks, "decode")) > len(rows_chunks(sinks, "decode"))  # several lengths
  if native:
    for e, phases in ((engine, ("prefill", "decode")), (sinks, ("prefill",))):
      for p in phases:
        assert {b[3] for b in model(e, p)} == {CFG.max_seq_len}
        assert len(model(e, p)) == len(rows_chunks(e, p)) > 1


def test_a_program_outside_the_sealed_set_runs_as_a_larger_warmed_one(params):
  """A hole in the warmed set (here made by hand: the 1- and 2-row decode programs and the
  16-token chunks forgotten after warm-up) never compiles while serving: the step runs as the
  smallest warmed program that covers it (more rows, a longer chunk), and the tokens are the
  reference's."""
  pool = PagePool(PageBudget(8, 64), max_seq_tokens=CFG.max_seq_len)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=4, max_step_tokens=40, max_chunk=32,
                    max_prefill_chunks=1)
  engine = Engine(UnshardedStep(CFG, backend=NATIVE), params, EngineConfig(
      max_slots=4, num_pages=64, page_size=8, max_seq_tokens=CFG.max_seq_len, lag=1))
  engine.warmup(max_prefill_rows=1, max_chunk=32, threads=1)
  holes = {k for k in engine.program_set.shapes if (k[0] == "decode" and k[1] < 4)
           or (k[0] == "prefill" and k[2] == 16)}
  assert holes
  engine.program_set.shapes -= holes
  engine.seal()
  reqs = _requests(np.random.default_rng(5), n=3)
  got = serve_all(sched, engine, reqs)
  assert engine.program_set.covered > 0 and engine.program_set.unwarmed == 0
  assert not holes & engine.program_set.shapes  # nothing outside the set was dispatched
  for r in reqs:
    assert _compare(params, r, _reference(params, r), got[r.request_id]) in ("equal", "near-tie")
