"""serving.lifecycle: derived latencies by the project's definitions, Chrome traces, metrics."""

from __future__ import annotations

import json

import prometheus_client as prom
import pytest

from serving.lifecycle import Metrics, RequestTrace, chrome_trace


class _Clock:
  def __init__(self):
    self.t = 100.0

  def __call__(self):
    return self.t


def _trace():
  clock = _Clock()
  tr = RequestTrace("r1", clock)
  for kind, t, detail in (("arrival", 100.0, ""), ("queued", 100.001, ""),
                          ("prefill_start", 100.5, ""), ("prefill_end", 100.7, ""),
                          ("prefill_start", 100.8, ""), ("prefill_end", 101.0, ""),
                          ("kv_transfer_start", 101.0, ""), ("kv_transfer_end", 101.05, ""),
                          ("first_token", 101.1, ""), ("token", 101.2, ""),
                          ("preempted", 101.25, ""), ("resumed", 101.4, ""),
                          ("token", 101.5, ""), ("token", 101.6, ""),
                          ("finished", 101.6, "stop")):
    clock.t = t
    tr.record(kind, detail)
  return tr


def test_timings_follow_the_definitions():
  t = _trace().timings()
  assert t["queue_s"] == pytest.approx(0.5)
  assert t["ttft_s"] == pytest.approx(1.1)
  assert t["e2e_s"] == pytest.approx(1.6)
  assert t["tpot_s"] == pytest.approx((1.6 - 1.1) / 3)
  assert _trace().inter_token_s() == pytest.approx([0.1, 0.3, 0.1])


def test_chrome_trace_parses_and_phases_are_in_order():
  data = json.loads(json.dumps(chrome_trace([_trace()])))
  spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
  names = [e["name"] for e in sorted(spans, key=lambda e: e["ts"])]
  assert names == ["queue", "prefill", "prefill", "kv_transfer", "decode"]
  tracks = {e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "thread_name"}
  assert tracks == {"queue", "prefill", "transfer", "decode", "session"}
  ends = [e for e in data["traceEvents"] if e["name"] == "finished"]
  assert ends[0]["args"]["detail"] == "stop"


def test_metrics_in_their_own_registry():
  reg = prom.CollectorRegistry()
  m = Metrics(reg)
  m.observe(_trace())
  assert reg.get_sample_value("phaseserve_ttft_seconds_count") == 1
  assert reg.get_sample_value("phaseserve_ttft_seconds_sum") == pytest.approx(1.1)
  assert reg.get_sample_value("phaseserve_requests_finished_total", {"reason": "stop"}) == 1
  m.kv_pages_used.set(3)
  assert reg.get_sample_value("phaseserve_kv_pages_used") == 3
  Metrics(prom.CollectorRegistry())  # a second engine's metrics do not clash


def test_unknown_event_rejected():
  with pytest.raises(ValueError):
    RequestTrace("x").record("teleported")
