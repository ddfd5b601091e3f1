"""Multi-LoRA on the engine (tiny random model, f32): a batch mixing three adapters and the base
model, with two device slots, gives each request the ids it gets alone (up to a near-tie: a
first difference after a top-2 logit margin below ``MARGIN`` of the reference forward with the
adapter, which another row count's summation order may flip; at most one per test); the base
rows equal an engine without LoRA; the prefix cache never hands one adapter's KV to another; no
program is compiled after the warm-up.

Adapters are written in PEFT's format by ``launch.lab.make_adapters`` (their numerics against
transformers + peft are ``tests/models/test_lora.py``'s). Controls: ids under different
adapters differ, and a prefix cache keyed without the adapter changes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch.lab.make_adapters import write_peft_adapter
from models.config import get_preset
from models.step import UnshardedStep
from models.text.tokenizer import ByteTokenizer
from models.weights import init_params
from serving import kv_manager
from serving.engine import Engine, EngineConfig
from serving.kv_pages import PageBudget, PagePool
from serving.lora import LoraRegistry, LoraSlots
from serving.prefix_cache import PrefixCache
from serving.request import Request
from serving.sampling import SamplingParams
from serving.scheduler import Scheduler
from serving.stop import StopCriteria
from tests.cpu_policies import NATIVE
from tests.sched_steps import serve_all

CFG = get_preset("tiny").replace(max_seq_len=96)  # not test_engine's programs (it counts compiles)
MARGIN = {jnp.float32: 1e-4, jnp.bfloat16: 0.1}  # a near-tie's top-2 margin, by activation dtype
SLOTS, Z, CHUNK, PAGES = 4, 8, 32, 64


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(5), jnp.float32)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
  root = tmp_path_factory.mktemp("adapters")
  reg = LoraRegistry(CFG, max_rank=16, max_cpu_loras=2)  # 3 adapters: one re-read from disk
  for i, (rank, targets) in enumerate(((8, ("q", "k", "v", "o", "gate", "up", "down")),
                                       (16, ("q", "v")), (4, ("gate", "up", "down")))):
    reg.load(f"ad{i}", write_peft_adapter(root / f"ad{i}", CFG, rank=rank, seed=i,
                                          targets=targets, strength=1.0))
  return reg


def _requests(registry, n=12, prompt=None):
  rng = np.random.default_rng(1)
  refs = [None] + registry.names()
  out = []
  for i in range(n):
    ids = prompt or tuple(int(t) for t in rng.integers(0, 256, int(rng.integers(5, 40))))
    sampling = SamplingParams(temperature=0.9, seed=i) if i % 4 == 3 else SamplingParams(seed=i)
    out.append(Request(f"r{i}", ids, sampling, StopCriteria(max_tokens=int(rng.integers(4, 16)),
                                                          ignore_eos=True),
                       lora=refs[i % len(refs)]))
  return out


def _serve(params, reqs, registry=None, *, max_loras=2, cache=False, slots=SLOTS, pages=PAGES):
  pool = PagePool(PageBudget(Z, pages), max_seq_tokens=CFG.max_seq_len)
  loras = LoraSlots(max_loras) if registry is not None else None
  sched = Scheduler(pool, ByteTokenizer(), max_slots=slots, max_step_tokens=64,
                    max_chunk=CHUNK, max_prefill_chunks=2, loras=loras,
                    prefix_cache=PrefixCache(pool) if cache else None)
  engine = Engine(UnshardedStep(CFG, backend=NATIVE), params, EngineConfig(
      max_slots=slots, num_pages=pages, page_size=Z, max_seq_tokens=CFG.max_seq_len,
      max_loras=max_loras if registry is not None else 0), loras=registry)
  engine.warmup(2, CHUNK, max_tokens=64)
  engine.seal()
  traces: dict = {}
  got = serve_all(sched, engine, reqs, traces)
  preempted = sum(e.kind == "preempted" for t in traces.values() for e in t.events)
  assert sched.idle and (loras is None or loras.held == 0)
  assert engine.program_set.unwarmed == 0 and engine.program_set.covered == 0
  return got, engine, loras, preempted


@pytest.fixture(scope="module")
def alone(params, registry):
  """Every request served by itself (one engine slot, one adapter slot: one after the other)."""
  return _serve(params, _requests(registry), registry, max_loras=1, slots=1)[0]


def _margin(params, registry, req, ids) -> float:
  """Top-2 margin of the next id's logits after ``ids`` under the request's adapter."""
  from models import lora
  from models.transformer import forward
  w = lora.empty_weights(CFG, 1, registry.slot_rank, jnp.float32)
  if req.lora is not None:
    w = lora.place(w, jnp.int32(0), *registry.weights(req.lora.uid))
  seq = jnp.asarray([list(req.prompt_ids) + list(ids)])
  slot = jnp.full(seq.shape, 0 if req.lora is not None else -1, jnp.int32)
  top = np.sort(np.asarray(forward(params, seq, cfg=CFG, lora=lora.LoraBatch(w, slot))[0, -1],
                           np.float32))
  return float(top[-1] - top[-2])


def _agree(params, registry, reqs, want, got, dtype=jnp.float32) -> None:
  """``got`` equals ``want`` request by request, but for at most one near-tie."""
  near = 0
  for r in reqs:
    a, b = want[r.request_id], got[r.request_id]
    if a == b:
      continue
    j = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
    assert _margin(params, registry, r, a[:j]) < MARGIN[dtype], (r.request_id, j, a, b)
    near += 1
  assert near <= 1, f"{near} near-ties"


def test_mixed_batch_equals_each_request_alone(params, registry, alone):
  reqs = _requests(registry)
  got, engine, loras, _ = _serve(params, reqs, registry)
  _agree(params, registry, reqs, alone, got)
  assert loras.loads > 2 and engine.lora.loaded == loras.loads  # slots were given over
  by_adapter = {}
  for r in reqs:  # the control: an adapter changes the ids of a request
    by_adapter.setdefault(r.lora.name if r.lora else "", set()).add(r.request_id)
  first = [next(iter(sorted(v))) for v in by_adapter.values()]
  assert len(by_adapter) == 4 and len({tuple(alone[f][:3]) for f in first}) > 1


def test_preemption_in_a_small_pool_keeps_the_ids(params, registry, alone):
  reqs = _requests(registry)
  got, _, _, preempted = _serve(params, reqs, registry, pages=10)
  _agree(params, registry, reqs, alone, got)
  assert preempted > 0


def test_same_prompt_under_each_adapter_differs_and_base_rows_match_plain(params, registry):
  reqs = _requests(registry, n=4, prompt=tuple(range(40, 70)))
  got = _serve(params, reqs, registry)[0]
  assert len({tuple(v) for v in got.values()}) == 4  # base and three adapters all differ
  plain = _serve(params, [reqs[0]])[0]  # an engine without LoRA
  assert plain["r0"] == got["r0"]


def test_prefix_cache_is_keyed_by_adapter(params, registry, monkeypatch):
  prompt = tuple(range(10, 60))
  first = _requests(registry, n=4, prompt=prompt)
  again = [Request(f"again{r.request_id}", r.prompt_ids, r.sampling, r.stop, lora=r.lora)
           for r in first]
  want = _serve(params, first, registry)[0]

  def run(serial):  # one slot: each request after the previous one cached its pages
    return _serve(params, serial, registry, cache=True, slots=1)[0]
  order = first[:1] + again[1:]  # the base first; then each adapter on the base's cached pages
  got = run(order)
  assert [got[r.request_id] for r in order] == [want[r.request_id[len("again"):]]
                                                if r.request_id.startswith("again")
                                                else want[r.request_id] for r in order]
  monkeypatch.setattr(kv_manager, "namespace", lambda req: 0)  # the control: one namespace
  bad = run(order)
  assert [bad[r.request_id] for r in order] != [got[r.request_id] for r in order]


def test_unknown_and_unserved_adapters(params, registry):
  with pytest.raises(LookupError, match="unknown LoRA adapter 'nope'.*ad0, ad1, ad2"):
    registry.resolve("nope")
  pool = PagePool(PageBudget(Z, PAGES), max_seq_tokens=CFG.max_seq_len)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=2, max_step_tokens=64, max_chunk=CHUNK)
  from serving.lifecycle import RequestTrace
  out = sched.add(Request("x", (1, 2, 3), lora=registry.resolve("ad0")), RequestTrace("x"))
  assert out is not None and "serves none" in out.message


def test_int8_base_weights_take_adapters_too(params, registry):
  """Weight-only int8 base weights (bf16 activations, as the server runs them): a mixed batch
  still equals each request alone, and the adapters still change the ids."""
  from models import precision
  q = precision.apply(jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), CFG, "int8",
                      "weight_only")
  reqs = _requests(registry, n=4, prompt=tuple(range(40, 70)))
  got = _serve(q, reqs, registry)[0]
  alone = _serve(q, reqs, registry, max_loras=1, slots=1)[0]
  _agree(q, registry, reqs, alone, got, jnp.bfloat16)
  assert len({tuple(v) for v in got.values()}) == 4
