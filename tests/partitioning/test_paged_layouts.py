"""Paged KV under the partitioning layouts (``partitioning.paged_step``) == the unsharded model
over the same PagedKV contents, on 8 fake CPU devices.

Tolerance as tests/partitioning/test_layouts.py (f32 activations, f32 or weight-only int8 weights; only the
summation order changes): ``max |sharded - ref| <= 1e-5 * max(1, max |ref|)`` for logits and the
KV of valid positions; lengths equal. Covered: chunked ragged prefill over scattered pages within
each shard's range, then decode with idle rows, under every attention layout with ws_2d, and
wg_xyz + batch_xyz (every other attention layout runs the same program under wg_xyz: checked
by plan), f32 and int8; the pool really page-sharded; prefill in one layout
and decode in another with the re-lay; the disaggregated page transfer between sub-meshes; and
the serving engine over the sharded step (greedy tokens equal the unsharded engine's).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from models.config import get_preset
from models.paged_kv import PagedKV, init_paged, to_cache
from models.step import UnshardedStep
from models.weights import init_params, quantize
from partitioning import paged_step as PS
from partitioning.mesh import make_mesh, make_submeshes
from tests.partitioning.test_layouts import assert_close

CFG = get_preset("tiny").replace(num_heads=8, vocab_size=256, max_seq_len=64)
B, Z, M, NP = 8, 4, 8, 64  # rows, page size, table width (max_len 32), pages (8 per row's shard)
S = Z * M
ATTN = ("heads", "batch_z", "batch_yz", "batch_xyz")


@pytest.fixture(scope="module")
def mesh8():
  return make_mesh(jax.devices()[:8])


def _table() -> np.ndarray:
  """Row r's pages: a random permutation of the 8 pages [8r, 8r+8): within its shard's range for
  every kv shard count dividing 8 (row r is on shard r // (8 / n), which owns them)."""
  rng = np.random.default_rng(0)
  return np.stack([8 * r + rng.permutation(8) for r in range(B)]).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _case(quantized: bool):
  params = init_params(CFG, jax.random.key(0))
  if quantized:
    params = quantize(params, CFG)
  k = jax.random.split(jax.random.key(1), 3)
  x = dict(
      toks1=jax.random.randint(k[0], (B, 12), 0, CFG.vocab_size),
      lens1=jnp.array([12, 5, 0, 12, 7, 1, 12, 3], jnp.int32),
      toks2=jax.random.randint(k[1], (B, 8), 0, CFG.vocab_size),
      lens2=jnp.array([8, 0, 6, 3, 8, 2, 0, 8], jnp.int32),
      nxt=jax.random.randint(k[2], (B,), 0, CFG.vocab_size),
      active=jnp.array([1, 1, 0, 1, 1, 1, 0, 1], jnp.int32))
  kv = init_paged(CFG, B, NP, Z, M).replace(page_table=jnp.asarray(_table()))
  ref = _run(UnshardedStep(CFG), UnshardedStep(CFG), params, kv, x)
  return params, x, ref


def _run(pre, dec, params, kv, x, between=None):
  """Two prefill chunks (the second continuing at each row's length) then a decode step, in one
  program unless ``between`` (a re-lay) runs between the phases."""

  def prefill(p, kv):
    l1, kv = pre.prefill(p, x["toks1"], kv, jnp.zeros((B,), jnp.int32), x["lens1"],
                         attend_len=S)
    l2, kv = pre.prefill(p, x["toks2"], kv, kv.lengths, x["lens2"], attend_len=S)
    return l1, l2, kv

  def decode(p, kv):
    return dec.decode(p, x["nxt"], kv, x["active"], attend_len=S)

  if between is None:
    @jax.jit
    def both(p, kv):
      l1, l2, mid = prefill(p, kv)
      return l1, l2, mid, *decode(p, mid)

    l1, l2, mid, l3, kv = both(params, kv)
  else:
    l1, l2, mid = jax.jit(prefill)(params, kv)
    l3, kv = jax.jit(decode)(params, between(mid))
  return dict(l1=l1, l2=l2, l3=l3, mid=mid, kv=kv)


def _valid_kv(kv: PagedKV):
  c = to_cache(kv, S)
  mask = (np.arange(S)[None, :] < np.asarray(kv.lengths)[:, None])[None, :, None, :, None]
  return np.where(mask, np.asarray(c.k), 0), np.where(mask, np.asarray(c.v), 0)


def _check(got, ref, what):
  for name in ("l1", "l2", "l3"):
    assert_close(got[name], ref[name], f"{what} {name} logits")
  for name in ("mid", "kv"):
    np.testing.assert_array_equal(got[name].lengths, ref[name].lengths)
    gk, gv = _valid_kv(got[name])
    rk, rv = _valid_kv(ref[name])
    assert_close(gk, rk, f"{what} {name} k")
    assert_close(gv, rv, f"{what} {name} v")


def _sharded_run(mesh, ffn, attn, quantized):
  params, x, ref = _case(quantized)
  step = PS.PagedShardedStep.make(CFG, mesh, ffn, attn)
  kv = step.init_kv(B, NP, Z, M, jnp.float32).replace(page_table=jnp.asarray(_table()))
  got = _run(step, step, step.place_params(params), kv, x)
  _check(got, ref, f"{ffn}+{attn}")
  return step, got


CASES = [("ws_2d", a, q) for q in (False, True) for a in ATTN]
CASES += [("wg_xyz", "batch_xyz", q) for q in (False, True)]


# int8 pools under every layout in `make test-slow`; in `make test` under ws_2d+heads and
# wg_xyz+batch_xyz (prefill's and decode's usual picks) only (suite time).
_INT8_FAST = (("ws_2d", "heads"), ("wg_xyz", "batch_xyz"))


@pytest.mark.parametrize("ffn,attn,quantized", [
    pytest.param(f, a, q, id=f"{f}-{a}-{'int8' if q else 'f32'}",
                 marks=[pytest.mark.slow] if q and (f, a) not in _INT8_FAST else [])
    for f, a, q in CASES])
def test_paged_sharded_matches_unsharded(mesh8, ffn, attn, quantized):
  step, got = _sharded_run(mesh8, ffn, attn, quantized)
  k = got["kv"].k_pages
  n = step.kv_shards
  assert k.sharding.is_equivalent_to(step.kv_sharding().k_pages, k.ndim)
  # Each kv shard holds only its P / n pages; distinct page ranges = n (replicated over the
  # head-sharding chips, i.e. 8 / n copies of each, only where kv_axes do not cover the mesh).
  assert k.sharding.shard_shape(k.shape)[1] == NP // n
  ranges = {s.index[1].indices(NP) for s in k.addressable_shards}
  assert len(ranges) == n
  expected = {"heads": 1, "batch_z": 2, "batch_yz": 4, "batch_xyz": 8}[attn] if ffn == "ws_2d" \
      else 8  # ws_2d: the attention axes alone; wg_xyz: the residual batch is already xyz
  assert n == expected, (ffn, attn, step.kv_axes)
  d = step.describe()
  assert d["kv_shards"] == n and d["ffn"] == ffn and d["attn"] == attn
  assert ("replicated over" in d["kv"]) == (n < 8)


@pytest.mark.parametrize("attn", ATTN[:3])
def test_wg_xyz_runs_one_program_under_every_attention_layout(mesh8, attn):
  """wg_xyz's residual batch is already xyz, so every attention layout runs exactly the
  collectives (LayoutPlan.key) and pool sharding of wg_xyz + batch_xyz, tested numerically above."""
  step = PS.PagedShardedStep.make(CFG, mesh8, "wg_xyz", attn)
  ref = PS.PagedShardedStep.make(CFG, mesh8, "wg_xyz", "batch_xyz")
  assert step.plan(B).key() == ref.plan(B).key() and step.kv_axes == ("x", "y", "z")
  assert step.kv_sharding() == ref.kv_sharding()


def test_rows_must_split_over_kv_shards(mesh8):
  params, x, _ = _case(False)
  step = PS.PagedShardedStep.make(CFG, mesh8, "ws_2d", "batch_xyz")
  kv = step.init_kv(4, NP, Z, M, jnp.float32)
  with pytest.raises(ValueError, match="multiple"):
    jax.eval_shape(lambda p, kv: step.decode(p, x["nxt"][:4], kv, x["active"][:4],
                                             attend_len=S), params, kv)
  with pytest.raises(ValueError, match="sub-pools"):
    step.init_kv(B, 60, Z, M, jnp.float32)
  good = init_paged(CFG, B, NP, Z, M).replace(page_table=jnp.asarray(_table()))
  assert int(PS.misplaced(good, 8)) == 0
  assert int(PS.misplaced(good.replace(page_table=good.page_table[::-1]), 8)) > 0


def test_prefill_and_decode_in_two_layouts_with_relayout(mesh8):
  params, x, ref = _case(False)
  steps = PS.phase_steps(CFG, mesh8, ("ws_2d", "heads"), ("ws_2d", "batch_xyz"))
  assert steps.shared_params and steps.relayout and steps.kv_shards() == 8
  p_pre, p_dec = steps.place_params(params)
  assert p_pre is p_dec
  kv = steps.prefill.init_kv(B, NP, Z, M, jnp.float32).replace(page_table=jnp.asarray(_table()))
  seen = {}

  def relay(kv):
    seen["before"] = kv.k_pages.sharding.is_fully_replicated
    out = PS.relayout(kv, steps.decode)
    seen["after"] = out.k_pages.sharding.spec
    return out

  got = _run(steps.prefill, steps.decode, p_pre, kv, x, between=relay)
  _check(got, ref, "ws_2d+heads -> ws_2d+batch_xyz")
  assert seen["before"] and seen["after"] == P(None, ("x", "y", "z"))
  d = steps.describe()
  assert d["param_copies"] == 1 and d["kv_relayout"]
  # ws_1d stores its own weight layout: kept in the family, or two copies charged.
  fam = PS.phase_steps(CFG, mesh8, ("ws_1d", "batch_xyz"), ("ws_2d", "batch_xyz"))
  assert fam.shared_params and fam.decode.ffn.name == "ws_1d"
  two = PS.phase_steps(CFG, mesh8, ("ws_1d", "batch_xyz"), ("ws_2d", "batch_xyz"),
                       on_mismatch="two_copies")
  assert not two.shared_params and two.decode.ffn.name == "ws_2d"
  one = PS.param_bytes(CFG, mesh8, two.prefill.ffn, False)
  assert two.describe()["param_bytes"] == one + PS.param_bytes(CFG, mesh8, two.decode.ffn, False)
  assert "two resident params copies" in " ".join(two.describe()["notes"])


def test_disaggregated_transfer_then_decode():
  params, x, ref = _case(False)
  pre_mesh, dec_mesh = make_submeshes(jax.devices()[:8], 4)
  steps = PS.phase_steps(CFG, pre_mesh, ("ws_2d", "heads"), ("wg_xyz", "batch_xyz"),
                         decode_mesh=dec_mesh)
  assert not steps.shared_params and steps.decode.kv_shards == 4
  p_pre, p_dec = steps.place_params(params)
  table = _table()
  kv_pre = steps.prefill.init_kv(B, NP, Z, M, jnp.float32).replace(
      page_table=jnp.asarray(table))

  @jax.jit
  def prefill(p, kv):
    _, kv = steps.prefill.prefill(p, x["toks1"], kv, jnp.zeros((B,), jnp.int32), x["lens1"],
                                  attend_len=S)
    return steps.prefill.prefill(p, x["toks2"], kv, kv.lengths, x["lens2"], attend_len=S)

  _, kv_pre = prefill(p_pre, kv_pre)
  # The decode pool's allocator puts each page elsewhere in the same 4-way sub-pool.
  per = NP // 4
  remap = lambda g: (g // per) * per + (per - 1 - g % per)
  kv_dec = steps.decode.init_kv(B, NP, Z, M, jnp.float32)
  lengths = np.asarray(kv_pre.lengths)
  for r in range(B):  # one transfer per sequence: the chunk of pages it holds
    held = -(-int(lengths[r]) // Z)
    src = np.full((M,), -1, np.int32)
    src[:held] = table[r, :held]
    dst = np.where(src >= 0, remap(src), NP).astype(np.int32)
    kv_dec = PS.transfer_pages(kv_pre, kv_dec, src, dst)
  assert kv_dec.k_pages.sharding.mesh == dec_mesh
  kv_dec = kv_dec.replace(page_table=jnp.asarray(remap(table).astype(np.int32)),
                          lengths=jnp.asarray(lengths))

  @jax.jit
  def decode(p, kv):
    return steps.decode.decode(p, x["nxt"], kv, x["active"], attend_len=S)

  l3, kv_dec = decode(p_dec, kv_dec)
  assert_close(l3, ref["l3"], "disaggregated decode logits")
  np.testing.assert_array_equal(kv_dec.lengths, ref["kv"].lengths)
  for got, want, what in zip(_valid_kv(kv_dec), _valid_kv(ref["kv"]), "kv"):
    assert_close(got, want, f"disaggregated {what}")


@pytest.fixture(scope="module")
def engine_serve():
  """``(serve, want)``: ``serve(step, shards, decode=None, pages=64)`` runs 6 ragged requests
  through the scheduler and an engine over ``step`` (8 slots, chunks of 16) and gives their
  greedy ids and the engine; ``want``: the unsharded engine's ids."""
  from models.text.tokenizer import ByteTokenizer
  from serving.engine import Engine, EngineConfig
  from serving.kv_pages import PageBudget, PagePool
  from serving.request import Request
  from serving.sampling import SamplingParams
  from serving.scheduler import Scheduler
  from serving.stop import StopCriteria
  from tests.sched_steps import serve_all

  params = init_params(CFG, jax.random.key(3), jnp.float32)
  rng = np.random.default_rng(5)
  reqs = [Request(f"r{i}", tuple(int(t) for t in rng.integers(0, 256, int(rng.integers(3, 24)))),
                  SamplingParams(), StopCriteria(max_tokens=int(rng.integers(3, 8)),
                                                 ignore_eos=True)) for i in range(6)]

  def serve(step, shards, decode=None, pages=64):
    pool = PagePool(PageBudget(8, pages // shards, shards), max_seq_tokens=CFG.max_seq_len)
    sched = Scheduler(pool, ByteTokenizer(), max_slots=8, max_step_tokens=40, max_chunk=16)
    engine = Engine(step, params, EngineConfig(max_slots=8, num_pages=pages, page_size=8,
                                               max_seq_tokens=CFG.max_seq_len, lag=1),
                    decode=decode)
    got = serve_all(sched, engine, reqs)
    assert pool.pages_used == 0 and sched.idle
    return got, engine
  return serve, serve(UnshardedStep(CFG), 1)[0]


def test_engine_over_the_sharded_step(mesh8, engine_serve):
  """One layout, then a layout per phase on one mesh (the paper's point), then prefill and
  decode on two sub-meshes: the unsharded engine's greedy ids each time."""
  from models.step import PhaseDecode

  serve, want = engine_serve
  step = PS.PagedShardedStep.make(CFG, mesh8, "ws_2d", "batch_xyz")
  got, engine = serve(step, step.kv_shards)
  assert engine.prefill_pool.kv.k_pages.sharding.spec == P(None, ("x", "y", "z"))
  assert got == want
  # One mesh, one pool, one params copy, a layout per phase (the paper's point): decode runs
  # its own program, wg_xyz's (every weight all-gathered whole, [E, F] = [64, 128] among
  # them), over the pages and weights ws_2d stored; ws_2d's own decode program gathers none.
  from partitioning.deployment import Deployment, make_steps
  from serving.engine_calls import decode_call
  steps = make_steps(CFG, Deployment("interleaved", prefill_layout="ws_2d:batch_xyz",
                                     decode_layout="wg_xyz:batch_xyz"),
                     max_slots=8, max_chunk=16, max_context=CFG.max_seq_len, quantized=False,
                     devices=jax.devices()[:8])
  assert steps.decode is not None and steps.decode.transfer is None
  assert steps.description["kv_pools"] == 1
  assert steps.description["decode_program"] == "wg_xyz+batch_xyz"
  per_phase, per_phase_engine = serve(steps.step, steps.kv_shards, decode=steps.decode)
  assert per_phase == want
  assert per_phase_engine.pools == [per_phase_engine.prefill_pool]
  pool = per_phase_engine.decode_pool
  none_R = np.zeros((8,), np.int32)

  def gathers_a_whole_weight(step) -> bool:
    hlo = decode_call.lower(pool.params, pool.kv, pool.last_X, none_R, none_R,
                            none_R.astype(bool), None, step=step, n=8,
                            attend_len=64).compile().as_text()
    return f"f32[{CFG.embed_dim},{CFG.mlp_dim}]" in "".join(
        line.split(" all-gather(")[0] for line in hlo.splitlines() if " all-gather(" in line)

  assert per_phase_engine.decode_step == steps.decode.step
  assert gathers_a_whole_weight(per_phase_engine.decode_step)
  assert not gathers_a_whole_weight(steps.step)
  # Disaggregated: prefill ws_2d+heads on chips 0-3, decode wg_xyz+batch_xyz on chips 4-7, pages
  # transferred at insert; the allocator's sub-pools are the finer (decode) ones.
  pre_mesh, dec_mesh = make_submeshes(jax.devices()[:8], 4)
  steps = PS.phase_steps(CFG, pre_mesh, ("ws_2d", "heads"), ("wg_xyz", "batch_xyz"),
                         decode_mesh=dec_mesh)
  split, split_engine = serve(steps.prefill, steps.kv_shards(),
                              decode=PhaseDecode(steps.decode, PS.transfer_pages))
  assert split_engine.decode_pool.kv.k_pages.sharding.mesh == dec_mesh
  assert split == want


@pytest.mark.slow  # suite time (~25 s); the three engine identities above stay in `make test`
def test_engine_over_odd_submeshes_two_pools_and_the_planner(mesh8, engine_serve):
  """Disaggregated over 3 and 2 chips (kv shards dividing neither way), interleaved with a pool
  per phase (the KV re-laid at insert), and both layouts left to the planner: the unsharded
  engine's greedy ids each time."""
  from models.step import PhaseDecode
  from partitioning.deployment import Deployment, make_steps

  serve, want = engine_serve
  # 3 prefill chips and 2 decode chips: 3 and 2 kv shards, neither dividing the other. The
  # allocator's 6 sub-pools each lie in one shard of each pool, so no sequence straddles a
  # decode shard (with 3 sub-pools one did, and decode read its foreign page as zeros).
  pre3, dec2 = make_submeshes(jax.devices()[:5], 3)
  odd = PS.phase_steps(CFG, pre3, ("wg_xyz", "batch_xyz"), ("wg_xyz", "batch_xyz"),
                       decode_mesh=dec2)
  assert (odd.prefill.kv_shards, odd.decode.kv_shards, odd.kv_shards()) == (3, 2, 6)
  got_odd, _ = serve(odd.prefill, odd.kv_shards(), PhaseDecode(odd.decode, PS.transfer_pages),
                     pages=24)
  assert got_odd == want
  # Interleaved on one mesh, a layout per phase through partitioning.deployment: prefill ws_2d+heads,
  # decode ws_2d+batch_xyz (one params copy, the KV re-laid into decode's own pool at insert);
  # then both layouts left to the planner (a fixed hardware preset, calibrated by the
  # calibration shipped for it: no measuring in tests).
  two = make_steps(CFG, Deployment("interleaved", "ws_2d:heads", "ws_2d:batch_xyz"),
                   max_slots=8, max_chunk=16, max_context=CFG.max_seq_len, quantized=False)
  assert two.decode is not None and two.description["kv_pools"] == 2
  assert two.description["param_copies"] == 1 and two.description["kv_relayout"]
  inter, inter_engine = serve(two.step, two.kv_shards, decode=two.decode)
  assert inter == want
  assert inter_engine.decode_pool.kv.k_pages.sharding.spec == P(None, ("x", "y", "z"))
  planned = make_steps(CFG, Deployment("interleaved", hardware="tpu-v4"), max_slots=8,
                       max_chunk=16, max_context=CFG.max_seq_len, quantized=False)
  for phase in ("prefill", "decode"):
    assert planned.description[f"{phase}_choice"].startswith(
        "planner (tpu-v4, calibrated by "), planned.description
  auto, _ = serve(planned.step, planned.kv_shards, decode=planned.decode)
  assert auto == want
  print(f"[paged engine] {inter_engine.programs} programs (two layouts, one mesh); planner: "
        f"{planned.description['prefill_choice']} / {planned.description['decode_choice']}")


@pytest.mark.slow  # suite time (32-48 s); the sharded engine's own identity stays (above)
def test_prefix_cache_under_sharded_pools_and_disaggregated(mesh8):
  """The prefix cache over 8 batch-sharded sub-pools (ws_2d+batch_xyz: a request goes to the
  shard holding its prefix) and over two pools (disaggregated: only prompt pages, which prefill
  wrote into its own pool, are reused): the same greedy ids as the unsharded engine without the
  cache, with cached tokens counted."""
  from models.text.tokenizer import ByteTokenizer
  from models.step import PhaseDecode
  from serving.engine import Engine, EngineConfig
  from serving.kv_pages import PageBudget, PagePool
  from serving.lifecycle import RequestTrace
  from serving.prefix_cache import PrefixCache
  from serving.request import Request
  from serving.drive import run_to_completion
  from serving.scheduler import Scheduler
  from serving.stop import StopCriteria

  params = init_params(CFG, jax.random.key(3), jnp.float32)
  base = tuple(range(60, 85))  # 25 tokens: 3 whole pages of 8
  first = Request("r0", base + (1,), stop=StopCriteria(max_tokens=12, ignore_eos=True))

  def serve(step, shards, decode=None, cache=True, two_pools=False):
    pool = PagePool(PageBudget(8, 64 // shards, shards), max_seq_tokens=CFG.max_seq_len)
    sched = Scheduler(pool, ByteTokenizer(), max_slots=8, max_step_tokens=40, max_chunk=16,
                      prefix_cache=PrefixCache(pool) if cache else None,
                      cache_generated=not two_pools)
    engine = Engine(step, params, EngineConfig(max_slots=8, num_pages=64, page_size=8,
                                               max_seq_tokens=CFG.max_seq_len, lag=1),
                    decode=decode)
    got: dict[str, list[int]] = {}
    cached = {}

    def run(reqs):
      for r in reqs:
        assert sched.add(r, RequestTrace(r.request_id)) is None
      outs = run_to_completion(sched, engine.execute)
      for res in engine.flush():
        outs += sched.update(res)
      for o in outs:
        got.setdefault(o.request_id, []).extend(o.token_ids)
        if o.finished:
          cached[o.request_id] = o.usage.cached_tokens

    run([first])
    turn2 = base + (1,) + tuple(got["r0"]) + (7, 8)
    run([Request(f"r{i}", base + (i, i), stop=StopCriteria(max_tokens=5, ignore_eos=True))
         for i in range(2, 5)] + [Request("t2", turn2, stop=StopCriteria(max_tokens=4,
                                                                         ignore_eos=True))])
    assert pool.pages_used == 0 and sched.idle
    last = Request("c", base + (9, 9), stop=StopCriteria(max_tokens=5, ignore_eos=True))
    if cache and shards > 1:  # fill every shard holding the prefix: its pages are copied across
      c = sched.kv.prefix_cache
      for sh in range(shards):
        m = c.match(last.prompt_ids, sh, count=False)
        if m.nodes:
          c.lock(m)
          c.evict(sh, 64)  # only the locked prefix stays cached there
          k = 0
          while pool.usage()[sh].free:
            n = min(pool.usage()[sh].free, pool.max_pages_per_seq)
            assert pool.allocate(f"filler{sh}-{k}", n * 8, shard=sh) is None
            k += 1
    before = (sched.kv.prefix_copied_pages, engine.copied_pages)
    run([last])
    if cache and shards > 1:
      assert (sched.kv.prefix_copied_pages - before[0], engine.copied_pages - before[1]) == (3, 3)
      for seq in [q for q in pool.sequences if str(q).startswith("filler")]:
        pool.release(seq)
    pool.check()
    return got, cached

  want, none = serve(UnshardedStep(CFG), 1, cache=False)
  assert set(none.values()) == {0}
  step = PS.PagedShardedStep.make(CFG, mesh8, "ws_2d", "batch_xyz")
  got, cached = serve(step, step.kv_shards)
  assert got == want
  # t2 extends r0's prompt + answer: 37 positions written -> 4 whole pages.
  assert cached == {"r0": 0, "r2": 24, "r3": 24, "r4": 24, "t2": 32, "c": 24}
  pre_mesh, dec_mesh = make_submeshes(jax.devices()[:8], 4)
  steps = PS.phase_steps(CFG, pre_mesh, ("ws_2d", "heads"), ("wg_xyz", "batch_xyz"),
                         decode_mesh=dec_mesh)
  split, split_cached = serve(steps.prefill, steps.kv_shards(),
                              decode=PhaseDecode(steps.decode, PS.transfer_pages), two_pools=True)
  assert split == want
  # Only r0's prompt pages (26 prompt tokens -> 3 whole pages) are reusable in two pools.
  assert split_cached == {"r0": 0, "r2": 24, "r3": 24, "r4": 24, "t2": 24, "c": 24}


def test_sharded_decode_rows_stay_inside_the_warmed_buckets(mesh8):
  """With kv-sharded pools and ``max_slots`` not a power of two, the rows of a decode call are
  ``shards x bucket(most slots on one shard)``, capped at the slots as ``buckets()`` caps them:
  12 slots whose pages all lie on one shard make 8 x 12 rows (a warmed program), not 8 x 16."""
  from serving.engine import Engine, EngineConfig
  params = init_params(CFG, jax.random.key(3), jnp.float32)
  step = PS.PagedShardedStep.make(CFG, mesh8, "ws_2d", "batch_xyz")
  engine = Engine(step, params, EngineConfig(max_slots=12, num_pages=64, page_size=8,
                                             max_seq_tokens=CFG.max_seq_len))
  warmed = {r for phase, r, _, _ in engine.buckets() if phase == "decode"}
  engine._table_XM[:, 0] = 1  # every slot's first page on shard 0 (pages 0-7)
  for n in range(1, 13):
    rows, row_of = engine._arrange(list(range(n)), step.kv_shards, cap=12)
    assert rows in warmed and len(set(row_of)) == n and max(row_of) < rows, (n, rows)


GQA = CFG.replace(num_kv_heads=2)  # 4 query heads a kv head: sharded heads take the GQA path


@functools.lru_cache(maxsize=None)
def _gqa_case():
  params = init_params(GQA, jax.random.key(0))
  _, x, _ = _case(False)
  kv = init_paged(GQA, B, NP, Z, M).replace(page_table=jnp.asarray(_table()))
  return params, x, _run(UnshardedStep(GQA), UnshardedStep(GQA), params, kv, x)


@pytest.mark.parametrize("ffn,attn", [(f, "heads") for f in ("ws_1d", "ws_2d", "wg_x", "wg_xyz")]
                         + [("ws_2d", "batch_z"), ("ws_2d", "batch_xyz"), ("unsharded", "")])
def test_stale_nan_in_reused_pages_never_reaches_the_output(mesh8, ffn, attn):
  """Every page starts as a freed page would: its last owner's values, here NaN and Inf. Keys
  past a row's end are masked, but a masked probability (0) times NaN is NaN, so the values
  no query can see must be zeroed on every path (the sharded GQA path reads the pages itself).
  The logits a server reads and the written KV equal the reference computed over a zeroed
  pool."""
  params, x, ref = _gqa_case()
  step = UnshardedStep(GQA) if ffn == "unsharded" else PS.PagedShardedStep.make(GQA, mesh8, ffn,
                                                                                attn)
  kv = step.init_kv(B, NP, Z, M, jnp.float32).replace(page_table=jnp.asarray(_table()))
  stale = jnp.where(jnp.arange(Z)[None, None, None, :, None] % 2 == 0, jnp.nan, jnp.inf)
  kv = kv.replace(k_pages=jnp.broadcast_to(stale, kv.k_pages.shape).astype(jnp.float32),
                  v_pages=jnp.broadcast_to(stale, kv.v_pages.shape).astype(jnp.float32))
  if ffn != "unsharded":
    kv = jax.device_put(kv, step.kv_sharding(jnp.float32))
  got = _run(step, step, step.place_params(params), kv, x)
  # The logits a server uses: each prefill row with tokens in the chunk, each active decode row.
  for name, used in (("l1", x["lens1"] > 0), ("l2", x["lens2"] > 0), ("l3", x["active"] > 0)):
    rows = np.asarray(used)
    g = np.asarray(got[name])[rows]
    assert np.isfinite(g).all(), f"{ffn}+{attn} {name}: NaN or Inf"
    assert_close(g, np.asarray(ref[name])[rows], f"{ffn}+{attn} {name} over stale pages")
  for name in ("mid", "kv"):
    np.testing.assert_array_equal(got[name].lengths, ref[name].lengths)
    for g, r, what in zip(_valid_kv(got[name]), _valid_kv(ref[name]), "kv"):
      assert_close(g, r, f"{ffn}+{attn} {name} {what} over stale pages")
