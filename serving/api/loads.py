"""A replica's load as routers read it: the ``GET /v1/loads`` body.

Contract: ``load_report(occupancy, capacity, now) -> dict`` is the body in the schema the SGLang
Model Gateway (``smg``) polls from every worker (its ``WorkerLoadResponse``: ``timestamp``,
``dp_rank_count``, ``loads``: one ``SchedulerLoadSnapshot`` per data-parallel rank; phaseserve
is one rank). The fields a load-aware or cache-aware policy acts on: ``num_running_reqs``,
``num_waiting_reqs`` (queued in the scheduler or on the way to it), ``num_used_tokens`` /
``max_total_num_tokens`` (KV pages held by sequences x page size; pages only the prefix cache
holds are reclaimable and not counted, as vLLM counts its free queue), ``token_usage`` (their
ratio), ``max_running_requests`` (decode rows). Fields phaseserve does not measure
(``gen_throughput``, ``cache_hit_rate``, ``utilization``, ``num_waiting_uncached_tokens``) are 0,
which the schema reads as "not reported".
The same three numbers are Prometheus gauges under vLLM's names (``serving.api.service_metrics``)
for routers that scrape ``/metrics`` instead.
"""

from __future__ import annotations

import datetime

from serving.loop_views import Capacity, Occupancy


def token_usage(occ: Occupancy, cap: Capacity) -> float:
  """Fraction (0-1) of the KV pages held by sequences."""
  return occ.pages_used / cap.kv_pages if cap.kv_pages else 0.0


def load_report(occ: Occupancy, cap: Capacity, now: float) -> dict:
  waiting = occ.waiting + occ.arriving
  rank = {
      "dp_rank": 0,
      "num_running_reqs": occ.running,
      "num_waiting_reqs": waiting,
      "num_waiting_uncached_tokens": 0,
      "num_total_reqs": occ.running + waiting,
      "num_used_tokens": occ.pages_used * cap.page_size,
      "max_total_num_tokens": cap.kv_pages * cap.page_size,
      "token_usage": token_usage(occ, cap),
      "gen_throughput": 0.0,
      "cache_hit_rate": 0.0,
      "utilization": 0.0,
      "max_running_requests": cap.max_slots,
  }
  stamp = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat()
  return {"timestamp": stamp, "dp_rank_count": 1, "loads": [rank]}
