"""Attention sinks (StreamingLLM) over a sink paged pool: a stream 8x the window runs with a
fixed page table (the window's pages are a ring), stays finite, and its logits equal, token by
token, a plain-JAX reference of the same cache policy written from the paper's description:
keep the first ``sinks`` tokens and the last ``window``, store keys before RoPE, rotate them by
their index in the kept list (the query by its own index, the last). Also: attention with
explicit key positions against a dense masked softmax, a fully hidden key block, and a control
(the reference with another policy differs beyond the tolerance).

Tolerance (the pool in f32, the reference in float64 numpy): ``max |got - ref| <= 1e-4 *
max(1, max |ref|)`` per step; the two differ in precision, summation order and in where the
rotation happens (the same angles).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import prometheus_client as prom
import pytest

from models import attention, paged_kv as PK, transformer as T
from models.cpu import paged_attention as cpu_paged_attention
from models.cpu.backend import CpuBackend
from tests.cpu_policies import NATIVE
from models.config import get_preset
from models.step import UnshardedStep
from models.text.tokenizer import ByteTokenizer
from models.weights import init_params
from serving import stack
from serving.api.auth import KeyInfo
from serving.api.frontend import Frontend, FrontendConfig
from serving.request import MAX_STREAM_TOKENS, Request, Sinks
from serving.stop import FinishReason, StopCriteria
from serving.api.usage import UsageLog
from serving.api.validation import GenerateArgs, InvalidArgument, Limits, validate

CFG = get_preset("tiny").replace(num_kv_heads=2)
TOL = 1e-4


def _close(got, ref, what):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  err = float(np.max(np.abs(got - ref)))
  bound = TOL * max(1.0, float(np.max(np.abs(ref))))
  assert err <= bound, f"{what}: max |diff| {err:.3g} > {bound:.3g}"


def _np_rope(x, pos, theta):
  """x [..., n, H] rotated pairs (i, i + H/2) by pos [n] (float64)."""
  h = x.shape[-1]
  inv = theta ** (-np.arange(0, h, 2, dtype=np.float64) / h)
  ang = pos[:, None] * inv  # [n, H/2]
  shape = (1,) * (x.ndim - 2) + ang.shape
  cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
  x1, x2 = x[..., : h // 2], x[..., h // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _np_norm(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


class Reference:
  """float64 numpy, one token at a time over a contiguous kept list per layer: the kept keys
  (stored raw) rotated by their index in it, the query by its own (the last)."""

  def __init__(self, params, cfg, sinks: int, window: int):
    assert cfg.activation == "swiglu" and not (cfg.parallel_block or cfg.embed_scale
                                               or cfg.norm_plus_one or cfg.tie_embeddings)
    f64 = lambda a: np.asarray(a, np.float64)
    self.cfg, self.sinks, self.window = cfg, sinks, window
    self.layers = [{k: f64(v) for k, v in layer.items()} for layer in params["layers"]]
    self.embed, self.unembed = f64(params["embed"]), f64(params["unembed"])
    self.final = f64(params["final_norm"])
    self.kept = [[] for _ in self.layers]  # per layer: [(absolute position, raw k, v)]
    self.t = 0

  def feed(self, tok: int) -> np.ndarray:
    """Logits [V] after token ``tok`` at the next position."""
    cfg, t = self.cfg, self.t
    g = cfg.num_heads // cfg.num_kv_heads
    x = self.embed[tok]  # [D]
    for l, w in enumerate(self.layers):
      h = _np_norm(x, w["attn_norm"], cfg.norm_eps)
      q = np.einsum("d,dnh->nh", h, w["q"])
      kept = self.kept[l]
      kept.append((t, np.einsum("d,dkh->kh", h, w["k"]), np.einsum("d,dkh->kh", h, w["v"])))
      if self.window:
        kept[:] = [e for e in kept if e[0] < self.sinks or e[0] > t - self.window]
      n = len(kept)
      ks = _np_rope(np.stack([e[1] for e in kept]).transpose(1, 0, 2),  # [K, n, H]
                    np.arange(n, dtype=np.float64), cfg.rope_theta)
      vs = np.stack([e[2] for e in kept]).transpose(1, 0, 2)
      qr = _np_rope(q[:, None, :], np.asarray([n - 1.0]), cfg.rope_theta)[:, 0]  # [N, H]
      logits = np.einsum("nh,nsh->ns", qr, np.repeat(ks, g, axis=0)) / np.sqrt(cfg.head_dim)
      p = np.exp(logits - logits.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      att = np.einsum("ns,nsh->nh", p, np.repeat(vs, g, axis=0))
      x = x + np.einsum("nh,nhd->d", att, w["o"])
      hm = _np_norm(x, w["mlp_norm"], cfg.norm_eps)
      gate, up = hm @ w["gate"], hm @ w["up"]
      x = x + (gate / (1 + np.exp(-gate)) * up) @ w["down"]
    self.t += 1
    return _np_norm(x, self.final, cfg.norm_eps) @ self.unembed


def reference_stream(params, cfg, tokens, sinks: int, window: int) -> np.ndarray:
  """[len(tokens), V] logits of ``Reference`` fed ``tokens``."""
  ref = Reference(params, cfg, sinks, window)
  return np.stack([ref.feed(t) for t in tokens])


def reference_greedy(params, cfg, prompt, n: int, sinks: int, window: int, vocab: int):
  ref = Reference(params, cfg, sinks, window)
  for t in prompt:
    logits = ref.feed(t)
  out = []
  for _ in range(n):
    out.append(int(np.argmax(logits[:vocab])))
    logits = ref.feed(out[-1])
  return out


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(3), jnp.float32)


Z, M = 4, 5  # ring of 4 pages (16 positions) beside the sink page: a window of 12 fits
SINKS, WINDOW, PROMPT, STREAM = 4, 12, 10, 96  # 8x the window


@pytest.fixture(scope="module")
def stream(params):
  """Rows: sinks 4 + window 12, and window 12 alone; teacher-forced over the same ids."""
  rng = np.random.default_rng(0)
  ids = rng.integers(0, CFG.vocab_size, (2, STREAM)).astype(np.int32)
  ids[1] = ids[0]
  b = 2
  kv = PK.init_paged(CFG, b, b * M + 1, Z, M, jnp.float32, sink_pool=True)
  kv = kv.replace(page_table=jnp.arange(b * M, dtype=jnp.int32).reshape(b, M),
                  sinks=jnp.asarray([SINKS, 0], jnp.int32),
                  window=jnp.asarray([WINDOW, WINDOW], jnp.int32))
  prefill = jax.jit(lambda p, t, kv: T.prefill(p, t, kv, None, jnp.full((b,), PROMPT),
                                               cfg=CFG, attend_len=M * Z, all_logits=True))
  decode = jax.jit(lambda p, t, kv: T.decode_step(p, t, kv, cfg=CFG, attend_len=M * Z))
  logits, kv = prefill(params, jnp.asarray(ids[:, :PROMPT]), kv)
  steps = [np.asarray(logits)]
  for i in range(PROMPT, STREAM):
    lg, kv = decode(params, jnp.asarray(ids[:, i]), kv)
    steps.append(np.asarray(lg)[:, None])
  return ids, np.concatenate(steps, axis=1), kv  # logits [B, STREAM, V]


def test_a_stream_8x_the_window_is_bounded_finite_and_equals_the_reference(params, stream):
  ids, got, kv = stream
  assert np.all(np.isfinite(got))
  assert int(kv.lengths[0]) == STREAM and kv.page_table.shape == (2, M)  # table never grows
  # Nothing landed outside each row's M pages: the spare page is still zeros.
  assert float(jnp.max(jnp.abs(kv.k_pages[:, 2 * M]))) == 0.0
  for row, sinks in ((0, SINKS), (1, 0)):
    ref = reference_stream(params, CFG, ids[row].tolist(), sinks, WINDOW)
    for t in range(STREAM):
      _close(got[row, t], ref[t], f"row {row} (sinks {sinks}) step {t}")


def test_control_another_policy_differs(params, stream):
  ids, got, _ = stream
  ref = reference_stream(params, CFG, ids[0, :40].tolist(), 0, WINDOW)  # sinks dropped
  err = np.max(np.abs(got[0, :40] - ref))
  assert err > 100 * TOL * max(1.0, float(np.max(np.abs(ref))))


def test_full_attention_rows_of_a_sink_pool_equal_a_plain_pool(params):
  """Window 0 on a sink pool is plain causal attention: the same logits as storing keys
  rotated (the default pool), for a ragged prefill then decode."""
  rng = np.random.default_rng(1)
  toks = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 24)), jnp.int32)
  lens = jnp.asarray([24, 9], jnp.int32)
  out = {}
  for raw in (False, True):
    kv = PK.init_paged(CFG, 2, 16, 4, 8, jnp.float32, sink_pool=raw).replace(
        page_table=jnp.arange(16, dtype=jnp.int32).reshape(2, 8))
    l1, kv = T.jit_prefill(params, toks, kv, None, lens, cfg=CFG, attend_len=32)
    l2, _ = T.jit_decode_step(params, toks[:, 0], kv, cfg=CFG, attend_len=32)
    out[raw] = (l1, l2)
  for g, r in zip(out[True], out[False]):
    _close(g, r, "sink pool, full attention")


def test_explicit_key_positions_equal_a_dense_masked_softmax():
  """Keys in scrambled order with holes, sinks and windows per row, 600 keys (the online
  softmax over two key blocks); one row sees a block of only hidden keys first."""
  rng = np.random.default_rng(2)
  b, t, n, kh, h, s = 3, 2, 4, 2, 16, 600
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, kh, s, h)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, kh, s, h)), jnp.float32)
  kpos = np.stack([rng.permutation(s) for _ in range(b)]).astype(np.int32)
  kpos[0, :300] = -1  # no key in row 0's first block
  kpos[1, ::7] = -1
  qpos = np.asarray([[598, 599], [300, 301], [10, 11]], np.int32)
  sinks, window = np.asarray([4, 0, 2], np.int32), np.asarray([50, 100, 0], np.int32)
  keys = attention.KeyPositions(jnp.asarray(kpos), jnp.asarray(sinks), jnp.asarray(window))
  got = attention.attend(q, k, v, jnp.asarray(qpos), keys)
  vis = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= qpos[:, :, None]) & (
      (window[:, None, None] == 0) | (kpos[:, None, :] < sinks[:, None, None])
      | (kpos[:, None, :] > qpos[:, :, None] - window[:, None, None]))  # [B, T, S]
  g = n // kh
  kq = np.repeat(np.asarray(k), g, axis=1)  # [B, N, S, H]
  vq = np.repeat(np.asarray(v), g, axis=1)
  logits = np.einsum("btnh,bnsh->btns", np.asarray(q), kq) / np.sqrt(h)
  logits = np.where(vis[:, :, None, :], logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  ref = np.einsum("btns,bnsh->btnh", w, vq)
  _close(got, ref, "explicit key positions")
  none = attention.KeyPositions(jnp.full((b, s), -1, jnp.int32), keys.sinks_B, keys.window_B)
  assert float(jnp.max(jnp.abs(attention.attend(q, k, v, jnp.asarray(qpos), none)))) == 0.0


# -- the serving engine: the per-request policy ---------------------------------------------------

@pytest.fixture(scope="module")
def loop(params):
  return stack.build(UnshardedStep(CFG, backend=NATIVE), params, ByteTokenizer(), stack.ServingConfig(
      max_slots=4, page_size=Z, kv_pages=64, max_chunk=16, max_prefill_chunks=2, max_context=32,
      attention_sinks=True))


def _run(loop, reqs):
  got: dict[str, list[int]] = {}
  final = {}
  peak: dict[str, int] = {}  # most pages each request held
  for r in reqs:
    loop.submit(r, lambda o: (got.setdefault(o.request_id, []).extend(o.token_ids),
                              final.__setitem__(o.request_id, o) if o.finish_reason else None))
  while not loop.idle:
    loop.step()
    pool = loop.scheduler.kv.pool
    pool.check()
    for seq in pool.sequences:
      peak[seq] = max(peak.get(seq, 0), len(pool.table(seq)))
  return got, final, peak


def test_a_served_stream_8x_the_context_keeps_its_ring_and_equals_the_reference(params, loop):
  """A sinks request (window 12, sinks 4) generates 256 tokens on a server whose context is
  32, beside a plain request: the stream holds ring_entries(12, 4) = 5 pages throughout, its
  greedy ids equal the numpy reference's, and the plain request's ids equal an engine without
  sinks."""
  prompt = tuple(range(40, 50))
  stream = Request("s", prompt, stop=StopCriteria(256, ignore_eos=True), sinks=Sinks(12, 4))
  plain = Request("p", prompt, stop=StopCriteria(12, ignore_eos=True))
  got, final, peak = _run(loop, [stream, plain])
  assert final["s"].finish_reason is FinishReason.LENGTH and len(got["s"]) == 256
  assert peak["s"] == PK.ring_entries(12, Z) == 5 and loop.scheduler.kv.pool.pages_used == 0
  vocab = ByteTokenizer.VOCAB_SIZE
  assert got["s"] == reference_greedy(params, CFG, prompt, 256, 4, 12, vocab)
  other = stack.build(UnshardedStep(CFG, backend=NATIVE), params, ByteTokenizer(), stack.ServingConfig(
      max_slots=4, page_size=Z, kv_pages=64, max_chunk=16, max_prefill_chunks=2,
      max_context=32))
  again, _, _ = _run(other, [Request("p", prompt, stop=StopCriteria(12, ignore_eos=True))])
  assert got["p"] == again["p"]


@pytest.mark.parametrize("sinks,window,prompt_len,match", [
    (4, 8, 13, "exceeds sinks \\+ window"), (5, 12, 8, "must fit in one KV page"),
    (4, 200, 8, "exceeds a sequence's page table")])
def test_bad_sink_requests_are_rejected_with_the_reason(loop, sinks, window, prompt_len, match):
  req = Request("bad", tuple(range(1, prompt_len + 1)), stop=StopCriteria(4),
                sinks=Sinks(window, sinks))
  _, final, _ = _run(loop, [req])
  assert final["bad"].finish_reason is FinishReason.REJECTED
  assert re.search(match, final["bad"].message), final["bad"].message


def test_sinks_need_a_sink_pool(params):
  plain = stack.build(UnshardedStep(CFG, backend=NATIVE), params, ByteTokenizer(), stack.ServingConfig(
      max_slots=2, page_size=Z, kv_pages=16, max_chunk=16, max_context=32))
  req = Request("x", (1, 2, 3), stop=StopCriteria(4), sinks=Sinks(8))
  _, final, _ = _run(plain, [req])
  assert final["x"].finish_reason is FinishReason.REJECTED
  assert "--attention_sinks" in final["x"].message


# -- the front end: the request fields --------------------------------------------------------

SINK_LIMITS = Limits(max_context=32, attention_sinks=True, page_size=Z)


@pytest.mark.parametrize("args,limits,field", [
    (dict(sinks_window=8), Limits(max_context=32), "attention_sinks"),
    (dict(sinks_window=0), SINK_LIMITS, "attention_sinks.window"),
    (dict(sinks_window=8, sinks=Z + 1), SINK_LIMITS, "attention_sinks.sinks"),
    (dict(sinks_window=2, sinks=1), SINK_LIMITS, "prompt"),  # 4 prompt tokens > 1 + 2
    (dict(sinks_window=8, n=2), SINK_LIMITS, "n"),
    (dict(sinks_window=8, session_id="s"), SINK_LIMITS, "session_id"),
    (dict(sinks_window=8, max_tokens=MAX_STREAM_TOKENS + 1), SINK_LIMITS, "max_tokens")])
def test_bad_sink_fields_are_named(args, limits, field):
  with pytest.raises(InvalidArgument) as e:
    validate(GenerateArgs(token_ids=[1, 2, 3, 4], **args), ByteTokenizer(), limits)
  assert e.value.field == field, e.value


def test_a_stream_may_ask_for_more_than_the_context():
  v = validate(GenerateArgs(token_ids=[1, 2, 3], sinks_window=8, max_tokens=1000),
               ByteTokenizer(), SINK_LIMITS)
  assert v.sinks == Sinks(8, 4) and v.stop.max_tokens == 1000
  with pytest.raises(InvalidArgument, match="exceeds the context"):
    validate(GenerateArgs(token_ids=[1, 2, 3], max_tokens=1000), ByteTokenizer(), SINK_LIMITS)


def test_the_grpc_request_carries_the_policy():
  from serving.api.grpc_service import _args
  from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
  r = pb.GenerateRequest(text="hi", attention_sinks=pb.AttentionSinks(window=64, sinks=2))
  a = _args(r)
  assert (a.sinks_window, a.sinks) == (64, 2)
  a = _args(pb.GenerateRequest(text="hi", attention_sinks=pb.AttentionSinks(window=64)))
  assert (a.sinks_window, a.sinks) == (64, None)
  assert _args(pb.GenerateRequest(text="hi")).sinks_window is None


def test_the_frontend_streams_past_the_context(loop):
  fe = Frontend(loop, ByteTokenizer(), FrontendConfig(SINK_LIMITS), prom.CollectorRegistry(),
                UsageLog(None))
  fe.set_state("serving")
  loop.start()
  try:
    stream = fe.generate(GenerateArgs(token_ids=list(range(40, 50)), sinks_window=12,
                                      max_tokens=100, ignore_eos=True), KeyInfo("anonymous"))
    ids, final = [], None
    for _, out in stream.events():
      ids += out.token_ids
      final = out if out.finished else final
    assert len(ids) == 100 and final.finish_reason is FinishReason.LENGTH
  finally:
    loop.stop(timeout=10)


@pytest.mark.skipif(not cpu_paged_attention.available(),
                    reason="native paged attention unavailable (CPU / compiler)")
def test_decode_attends_the_rings_only_and_full_rows_see_every_key(params, monkeypatch):
  """A sink pool's decode batch: one row with sinks + a window (wrapped many times) beside rows
  without a window whose context is longer than the ring. ``attend_len`` covers the ring only
  (``rings_only``, what the engine passes); the full rows still see every key (the kernel), and
  every row equals its float64 reference. Control: the gather path alone at the same
  ``attend_len`` truncates the full rows."""
  z, m, n, stream_len = 4, 16, 3, 48
  ring = PK.ring_entries(WINDOW, z) * z  # 20 positions
  rng = np.random.default_rng(5)
  ids = rng.integers(0, CFG.vocab_size, (n, stream_len)).astype(np.int32)
  table = jnp.arange(n * m, dtype=jnp.int32).reshape(n, m)

  def run(native):
    backend = NATIVE if native else CpuBackend()
    kv = PK.init_paged(CFG, n, n * m + 1, z, m, jnp.float32, sink_pool=True,
                       backend=backend).replace(
        page_table=table, sinks=jnp.asarray([SINKS, 0, 0], jnp.int32),
        window=jnp.asarray([WINDOW, 0, 0], jnp.int32))
    assert kv.rings_only(CFG.num_heads) == native
    lg, kv = T.prefill(params, jnp.asarray(ids[:, :PROMPT]), kv, None,
                       jnp.full((n,), PROMPT, jnp.int32), cfg=CFG, attend_len=m * z,
                       all_logits=True, backend=backend)
    steps = [np.asarray(lg)]
    decode = jax.jit(lambda p, t, c: T.decode_step(p, t, c, cfg=CFG, attend_len=ring,
                                                   backend=backend))
    for i in range(PROMPT, stream_len):
      lg, kv = decode(params, jnp.asarray(ids[:, i]), kv)
      steps.append(np.asarray(lg)[:, None])
    return np.concatenate(steps, axis=1)

  got = run(True)
  refs = [reference_stream(params, CFG, ids[0], SINKS, WINDOW)] + [
      reference_stream(params, CFG, ids[r], 0, 0) for r in (1, 2)]
  for r in range(n):
    _close(got[r], refs[r], f"row {r}")
  control = run(False)
  err = np.max(np.abs(control[1] - refs[1]))
  assert err > 100 * TOL * max(1.0, float(np.max(np.abs(refs[1]))))
