"""KV pages from one serving loop into another (``serving.kv_transfer``; prefill and decode in
separate processes): the pages' bytes, the prefix cache's ``adopt``, and two real loops on the
tiny model, where the decode side's greedy ids with the prefill side's pages equal a loop that
computed the whole prompt, and only the prompt's last partial page is computed there."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_preset
from models.step import UnshardedStep
from models.text.tokenizer import ByteTokenizer
from models.weights import init_params
from serving import stack
from serving.kv_pages import PageBudget, PagePool
from serving.kv_transfer import KvPages, export_prefix, import_prefix, layout_of
from serving.prefix_cache import PrefixCache
from serving.request import Request
from serving.stop import StopCriteria
from tests.cpu_policies import NATIVE

CFG = get_preset("tiny")
PROMPT = tuple(range(30, 100))  # 70 ids: 4 whole pages of 16, then 6


def test_pages_survive_bytes():
  parts = (np.arange(24, dtype=np.float32).reshape(2, 3, 4), np.ones((2, 3, 1), np.int8),
           np.asarray(np.linspace(-3, 3, 12).reshape(2, 3, 2), jnp.bfloat16))
  p = KvPages((1, 2, 3), parts, layout_of(parts, 16))
  q = KvPages.from_bytes(p.to_bytes())
  assert q.tokens == p.tokens and q.layout == p.layout and q.num_pages == 3
  for a, b in zip(p.parts, q.parts):
    np.testing.assert_array_equal(a, b)
    assert a.dtype == b.dtype
  with pytest.raises(ValueError, match="not a KV page transfer"):
    KvPages.from_bytes(b"not an npz")


def _cache(host_pages: int) -> PrefixCache:
  return PrefixCache(PagePool(PageBudget(4, 8), max_seq_tokens=32), host_pages)


def test_adopt_adds_host_nodes_below_what_is_cached():
  c = _cache(host_pages=3)
  tokens = list(range(20))  # 5 pages of 4
  assert c.pool.allocate("a", 4) is None  # the first page already on the device
  assert c.insert(tokens[:4], c.pool.table("a"), 0) == 1
  added = c.adopt(tokens, 0)
  assert [i for i, _ in added] == [1, 2, 3]  # the host tier holds 3: page 4 stops it
  assert len({k for _, k in added}) == 3 and c.adopted == 3 and c.host_pages_used == 3
  c.check()
  m = c.match(tokens + [99], 0, count=False)
  assert len(m.nodes) == 1 and len(m.host) == 3
  assert c.adopt(tokens, 0) == []  # nothing new; and a full tier forgets no path it walks


def test_adopt_without_a_host_tier_adds_nothing():
  c = _cache(host_pages=0)
  assert c.adopt(list(range(12)), 0) == [] and c.adopted == 0
  c.check()


def _loop(host: bool, kv_dtype: str = "float32"):
  params = init_params(CFG, jax.random.key(0), jnp.float32)
  loop = stack.build(UnshardedStep(CFG, backend=NATIVE), params, ByteTokenizer(),
                     stack.ServingConfig(max_slots=2, page_size=16, kv_pages=32, max_chunk=32,
                                         max_prefill_chunks=2, max_context=128,
                                         host_tier_bytes=(8 << 20) if host else 0,
                                         kv_dtype=kv_dtype))
  loop.start()
  return loop


def _generate(loop, rid: str, n: int):
  done, out = threading.Event(), {"ids": []}

  def cb(o):
    out["ids"] += list(o.token_ids)
    if o.finished:
      out["usage"] = o.usage
      done.set()
  loop.submit(Request(rid, PROMPT, stop=StopCriteria(n, ignore_eos=True)), cb)
  assert done.wait(120), rid
  return out


@pytest.fixture(scope="module")
def loops():
  made = {"prefill": _loop(host=True), "decode": _loop(host=True), "plain": _loop(host=False)}
  yield made
  for loop in made.values():
    loop.stop()


def test_the_decode_side_computes_only_the_rest_and_agrees(loops):
  _generate(loops["prefill"], "p0", 1)  # the prefill leg: the prompt, one id
  pages = export_prefix(loops["prefill"], PROMPT)
  assert pages is not None and pages.tokens == PROMPT[:64] and pages.num_pages == 4
  pages = KvPages.from_bytes(pages.to_bytes())  # as it would cross between processes
  assert import_prefix(loops["decode"], pages) == 64
  got = _generate(loops["decode"], "d0", 8)
  want = _generate(loops["plain"], "c0", 8)
  assert got["ids"] == want["ids"] and len(got["ids"]) == 8
  assert got["usage"].cached_tokens == 64 and want["usage"].cached_tokens == 0
  cache = loops["decode"].scheduler.kv.prefix_cache
  assert cache.adopted == 4 and cache.loaded == 4
  cache.check()


def test_nothing_to_export_and_mismatched_layouts(loops):
  assert export_prefix(loops["prefill"], tuple(range(200, 240))) is None  # never seen
  pages = export_prefix(loops["prefill"], PROMPT)
  assert pages is not None
  assert import_prefix(loops["plain"], pages) == 0  # no host tier to adopt into
  other = KvPages(pages.tokens, tuple(p.astype(np.float16) for p in pages.parts),
                  layout_of([p.astype(np.float16) for p in pages.parts], 16))
  assert import_prefix(loops["decode"], other) == 0  # not this pool's dtype
  liar = KvPages(pages.tokens, other.parts, pages.layout)  # claims a layout it does not have
  assert import_prefix(loops["decode"], liar) == 0
  short = KvPages(pages.tokens[:20], pages.parts, pages.layout)  # tokens for 1.25 of 4 pages
  assert import_prefix(loops["decode"], short) == 0
  assert loops["decode"].dead is None  # nothing malformed reached its engine
