"""``serving.api.loads``: the load report in the gateway's schema, from made-up occupancies."""

from __future__ import annotations

import dataclasses
import datetime

from serving.api.loads import load_report, token_usage
from serving.loop_views import Capacity, Occupancy

CAP = Capacity(kv_pages=100, page_size=16, kv_bytes=0, bytes_per_page=0, max_slots=8,
               max_context=512, max_step_tokens=256, max_prefill_chunks=2, max_chunk=128,
               prefix_cache=True, host_tier_pages=0, attention_sinks=False, vocab_size=259)


def occ(**kw) -> Occupancy:
  base = dict(waiting=0, arriving=0, running=0, decoding=0, pages_used=0, pages_free=100,
              pages_cached=0, host_tier_pages_used=0)
  return Occupancy(**(base | kw))


def test_counts_and_usage():
  body = load_report(occ(waiting=3, arriving=2, running=5, decoding=4, pages_used=25,
                         pages_free=60, pages_cached=15), CAP, 0.0)
  assert body["dp_rank_count"] == 1
  (r,) = body["loads"]
  assert r["num_running_reqs"] == 5
  assert r["num_waiting_reqs"] == 5  # queued, and on the way to the scheduler
  assert r["num_total_reqs"] == 10
  assert r["num_used_tokens"] == 25 * 16  # cached-only pages are reclaimable: not counted
  assert r["max_total_num_tokens"] == 1600
  assert r["token_usage"] == 0.25
  assert r["max_running_requests"] == 8
  assert datetime.datetime.fromisoformat(body["timestamp"]).year == 1970


def test_idle_and_empty_pool():
  assert token_usage(occ(), CAP) == 0.0
  assert token_usage(occ(), dataclasses.replace(CAP, kv_pages=0)) == 0.0
  (r,) = load_report(occ(), CAP, 1e9)["loads"]
  assert (r["num_running_reqs"], r["num_waiting_reqs"], r["num_used_tokens"]) == (0, 0, 0)
