"""The service's Prometheus series, beside the loop's (``serving.lifecycle.Metrics``).

Contract: ``ServiceMetrics(registry, gauges)`` registers, in ``registry``:
  * ``phaseserve_requests_total{status, finish_reason, slo_class}``,
    ``phaseserve_rejections_total{reason}``, ``phaseserve_prefill_seconds``,
    ``phaseserve_ttft_prediction_ratio`` (actual / predicted TTFT), ``phaseserve_startup_seconds`` (and ``phaseserve_startup_stage_seconds{stage}``),
    ``phaseserve_live_streams``, ``phaseserve_prefix_cache_hit_tokens_total``,
    ``phaseserve_host_tier_bytes``, ``phaseserve_engine_faults_total``;
  * with ``watch_programs(serving.compiles.ProgramCounter)``: ``phaseserve_programs_loaded``,
    ``phaseserve_programs_after_ready`` (0 with a closed program set) and
    ``phaseserve_memory_mappings``;
  * JetStream's names where the series means the same thing (``jetstream_prefill_backlog_size``,
    ``jetstream_slots_used_percentage`` as a 0-1 fraction); its TTFT / TPOT are defined
    differently and not aliased;
  * vLLM's names for the load a router reads (``vllm:num_requests_running``,
    ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` as a 0-1 fraction, as vLLM's).
``gauges`` (``LiveGauges``) supplies the live values read at scrape time (no thread writes them).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import prometheus_client as prom

from serving import compiles
from serving.lifecycle import _LATENCY_BUCKETS


@dataclasses.dataclass(frozen=True)
class LiveGauges:
  waiting: Callable[[], float]
  running: Callable[[], float]
  kv_usage: Callable[[], float]  # fraction (0-1) of the KV pages sequences hold
  slots_used_fraction: Callable[[], float]
  live_streams: Callable[[], float]
  engine_faults: Callable[[], float]


class ServiceMetrics:
  def __init__(self, registry: prom.CollectorRegistry, gauges: LiveGauges):
    self.requests = prom.Counter("phaseserve_requests", "ended requests",
                                 ["status", "finish_reason", "slo_class"], registry=registry)
    self.rejections = prom.Counter("phaseserve_rejections", "requests refused at arrival",
                                   ["reason"], registry=registry)
    self.prefill = prom.Histogram("phaseserve_prefill_seconds",
                                  "first prefill chunk start to the last chunk end",
                                  buckets=_LATENCY_BUCKETS, registry=registry)
    self.ttft_prediction = prom.Histogram(
        "phaseserve_ttft_prediction_ratio", "actual / predicted TTFT of admitted requests",
        buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0), registry=registry)
    self.startup = prom.Gauge("phaseserve_startup_seconds", "model load + warm-up time",
                              registry=registry)
    self.startup_stage = prom.Gauge(
        "phaseserve_startup_stage_seconds", "start-up by stage: load, warmup; and the programs' "
        "trace, lower, compile_or_load, cache_read (summed over the warm-up's threads)",
        ["stage"], registry=registry)
    self.prefix_hit_tokens = prom.Counter("phaseserve_prefix_cache_hit_tokens",
                                          "prompt tokens served from the prefix cache",
                                          registry=registry)
    self.host_tier_bytes = prom.Gauge("phaseserve_host_tier_bytes",
                                      "KV bytes in the host-memory tier", registry=registry)
    prom.Gauge("phaseserve_live_streams", "client calls in progress",
               registry=registry).set_function(gauges.live_streams)
    prom.Gauge("phaseserve_engine_faults", "engine steps that raised",
               registry=registry).set_function(gauges.engine_faults)
    self._programs = (
        prom.Gauge("phaseserve_programs_loaded", "XLA programs compiled or loaded from the "
                   "persistent cache by this process", registry=registry),
        prom.Gauge("phaseserve_programs_after_ready", "XLA programs loaded after readiness "
                   "(0 with a closed program set)", registry=registry))
    prom.Gauge("phaseserve_memory_mappings", "memory mappings of this process (vm.max_map_count "
               "bounds them)", registry=registry).set_function(lambda: compiles.map_count() or 0)
    prom.Gauge("jetstream_prefill_backlog_size", "requests waiting for prefill (JetStream name)",
               registry=registry).set_function(gauges.waiting)
    prom.Gauge("jetstream_slots_used_percentage",
               "fraction (0-1) of decode slots in use (JetStream name)",
               registry=registry).set_function(gauges.slots_used_fraction)

    for name, doc, fn in (
        ("vllm:num_requests_running", "requests running (vLLM name)", gauges.running),
        ("vllm:num_requests_waiting", "requests waiting (vLLM name)", gauges.waiting),
        ("vllm:kv_cache_usage_perc", "fraction (0-1) of KV pages in use (vLLM name)",
         gauges.kv_usage)):
      prom.Gauge(name, doc, registry=registry).set_function(fn)

  def watch_programs(self, programs: compiles.ProgramCounter) -> None:
    loaded, after = self._programs
    loaded.set_function(lambda: programs.count)
    after.set_function(lambda: programs.since_mark)
