"""Every request's lifecycle on one monotonic clock: events, derived latencies, metrics, traces.

Contract:
  * ``RequestTrace(request_id, clock, on_error)`` records ``Event(kind, t, detail)``s on
    ``clock`` (default ``time.monotonic``; engine, scheduler and servicer share one). Kinds:
    arrival, queued, prefill_start / prefill_end (per chunk), kv_transfer_start / _end,
    first_token, token, preempted, resumed, paused / resume, finished (detail: the reason).
    A failure while recording (other than an unknown kind) goes to ``on_error``.
  * The project's definitions: TTFT = first_token - arrival; TPOT = (e2e - TTFT) / (tokens - 1);
    e2e = finished - arrival; queue = first prefill_start - arrival; inter-token latencies = gaps
    between consecutive ids.
  * ``chrome_trace(traces)``: Chrome-trace JSON (Perfetto), one process per request, one track
    per phase (queue, prefill, transfer, decode, session).
  * ``Metrics(registry)``: the ``prometheus_client`` histograms, gauges and fault counters in the
    given registry (no global state); ``observe(trace)`` records a finished request;
    ``watch_timeline`` / ``watch_spec`` export the step timeline's and speculative decoding's
    totals at scrape time.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Iterable

import prometheus_client as prom
import prometheus_client.core as prom_core

from serving.speculative import SpecCounts
from serving.step_timeline import PHASES, StepTimeline

EVENT_KINDS = ("arrival", "queued", "prefill_start", "prefill_end", "kv_transfer_start",
               "kv_transfer_end", "first_token", "token", "preempted", "resumed", "paused",
               "resume", "finished")
_TRACKS = {"queue": 1, "prefill": 2, "transfer": 3, "decode": 4, "session": 5}


@dataclasses.dataclass(frozen=True)
class Event:
  kind: str
  t: float
  detail: str = ""


class RequestTrace:
  """The events of one request, in order of recording."""

  def __init__(self, request_id: str, clock: Callable[[], float] = time.monotonic,
               on_error: Callable[[str, BaseException], None] | None = None):
    self.request_id = request_id
    self._clock = clock
    self._on_error = on_error
    self.events: list[Event] = []

  def record(self, kind: str, detail: str = "", t: float | None = None) -> float:
    """Appends an event and returns its time; an unknown ``kind`` is a ValueError. Any other
    failure (the clock) is reported to ``on_error("lifecycle", exc)``, the event is lost and
    NaN returned: a trace only observes, it never stops its caller."""
    if kind not in EVENT_KINDS:
      raise ValueError(f"unknown lifecycle event {kind!r}")
    try:
      t = self._clock() if t is None else t
      self.events.append(Event(kind, t, detail))
      return t
    except Exception as e:
      if self._on_error is None:
        raise
      self._on_error("lifecycle", e)
      return math.nan

  def _first(self, kind: str) -> float | None:
    return next((e.t for e in self.events if e.kind == kind), None)

  def token_times(self) -> list[float]:
    return [e.t for e in self.events if e.kind in ("first_token", "token")]

  @property
  def finish_reason(self) -> str | None:
    return next((e.detail for e in reversed(self.events) if e.kind == "finished"), None)

  def timings(self) -> dict[str, float | None]:
    """queue_s, prefill_s, ttft_s, tpot_s, e2e_s (None where the request never got there);
    prefill_s spans the first chunk's start to the last chunk's end."""
    arrival = self._first("arrival")
    start = self._first("prefill_start")
    end = self._first("finished")
    toks = self.token_times()
    last_chunk = next((e.t for e in reversed(self.events) if e.kind == "prefill_end"), None)
    prefill = None if start is None or last_chunk is None else last_chunk - start
    if arrival is None:
      return {"queue_s": None, "prefill_s": None, "ttft_s": None, "tpot_s": None,
              "e2e_s": None}
    ttft = toks[0] - arrival if toks else None
    e2e = end - arrival if end is not None else None
    tpot = None
    if ttft is not None and e2e is not None and len(toks) > 1:
      tpot = (e2e - ttft) / (len(toks) - 1)
    return {"queue_s": None if start is None else start - arrival, "prefill_s": prefill,
            "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e}

  def inter_token_s(self) -> list[float]:
    toks = self.token_times()
    return [b - a for a, b in zip(toks, toks[1:])]


def _spans(trace: RequestTrace) -> Iterable[tuple[str, str, float, float]]:
  """(track, name, start, end) spans of one trace."""
  ev = trace.events
  arrival = trace._first("arrival")
  start = trace._first("prefill_start")
  if arrival is not None and start is not None:
    yield "queue", "queue", arrival, start
  open_at: dict[str, float] = {}
  for e in ev:
    for base, track in (("prefill", "prefill"), ("kv_transfer", "transfer")):
      if e.kind == f"{base}_start":
        open_at[base] = e.t
      elif e.kind == f"{base}_end" and base in open_at:
        yield track, base, open_at.pop(base), e.t
  paused, resumed = trace._first("paused"), trace._first("resume")
  if paused is not None and resumed is not None:  # the session's pause before this turn
    yield "session", "paused", paused, resumed
  first, end = trace._first("first_token"), trace._first("finished")
  if first is not None:
    yield "decode", "decode", first, end if end is not None else trace.token_times()[-1]


def chrome_trace(traces: Iterable[RequestTrace]) -> dict[str, list[dict[str, object]]]:
  events: list[dict[str, object]] = []
  for pid, tr in enumerate(traces, start=1):
    events.append({"name": "process_name", "ph": "M", "pid": pid,
                   "args": {"name": f"request {tr.request_id}"}})
    for track, tid in _TRACKS.items():
      events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"name": track}})
    for track, name, a, b in _spans(tr):
      events.append({"name": name, "ph": "X", "pid": pid, "tid": _TRACKS[track],
                     "ts": a * 1e6, "dur": max(0.0, b - a) * 1e6})
    for e in tr.events:
      if e.kind in ("first_token", "token", "preempted", "resumed", "paused", "resume",
                    "finished"):
        events.append({"name": e.kind, "ph": "i", "s": "t", "pid": pid,
                       "tid": _TRACKS["decode"], "ts": e.t * 1e6,
                       "args": {"detail": e.detail} if e.detail else {}})
  return {"traceEvents": events}


_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
                    30.0, 60.0)


class _TimelineCollector(prom.registry.Collector):
  def __init__(self, timeline: StepTimeline):
    self._tl = timeline

  def collect(self) -> Iterable[prom_core.Metric]:
    tl = self._tl
    wall = prom_core.CounterMetricFamily("phaseserve_step_phase_seconds",
                                         "busy serving steps' wall time by phase "
                                         "(serving.step_timeline)", labels=["phase"])
    cpu = prom_core.CounterMetricFamily("phaseserve_step_phase_cpu_seconds",
                                        "the loop thread's CPU time in busy steps by phase",
                                        labels=["phase"])
    for phase in PHASES:
      wall.add_metric([phase], tl.totals_wall[phase])
      cpu.add_metric([phase], tl.totals_cpu[phase])
    yield wall
    yield cpu
    yield prom_core.CounterMetricFamily("phaseserve_steps", "busy serving steps",
                                        value=tl.steps)
    yield prom_core.CounterMetricFamily("phaseserve_decode_only_steps",
                                        "busy steps with decode rows and no prefill",
                                        value=tl.decode_only_steps)
    yield prom_core.CounterMetricFamily("phaseserve_decode_only_step_seconds",
                                        "wall time of the decode-only steps",
                                        value=tl.decode_only_s)
    yield prom_core.CounterMetricFamily("phaseserve_step_rows_decoded",
                                        "decode rows summed over busy steps", value=tl.decode_rows)
    yield prom_core.CounterMetricFamily("phaseserve_step_tokens_prefilled",
                                        "prefill tokens summed over busy steps",
                                        value=tl.prefill_tokens)


class _SpecCollector(prom.registry.Collector):
  def __init__(self, counts: Callable[[], SpecCounts]):
    self._counts = counts

  def collect(self) -> Iterable[prom_core.Metric]:
    c = self._counts()
    name = "phaseserve_spec_decode_num_"  # vLLM's spec_decode counters, by the same names
    yield prom_core.CounterMetricFamily(name + "drafts", "decode rows that carried draft ids",
                                        value=c.drafts)
    yield prom_core.CounterMetricFamily(name + "draft_tokens", "draft ids proposed",
                                        value=c.draft_tokens)
    yield prom_core.CounterMetricFamily(name + "accepted_tokens", "draft ids accepted",
                                        value=c.accepted_tokens)
    per_pos = prom_core.CounterMetricFamily(name + "accepted_tokens_per_pos",
                                            "draft ids accepted by position in the draft",
                                            labels=["position"])
    for i, n in enumerate(list(c.accepted_per_pos)):
      per_pos.add_metric([str(i)], n)
    yield per_pos


class _LoraCollector(prom.registry.Collector):
  def __init__(self, info: Callable[[], tuple[int, list[str], list[str], int] | None]):
    self._info = info

  def collect(self) -> Iterable[prom_core.Metric]:
    got = self._info()
    if got is None:
      return
    slots, running, waiting, loads = got
    info = prom_core.GaugeMetricFamily(  # vLLM's lora_requests_info: labels, the time as value
        "phaseserve_lora_requests_info", "LoRA adapters of running and waiting requests",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    info.add_metric([str(slots), ",".join(running), ",".join(waiting)], time.time())
    yield info
    yield prom_core.CounterMetricFamily("phaseserve_lora_loads", "LoRA adapters moved onto "
                                        "the device's slots", value=loads)


class Metrics:
  """The serving metrics, registered in ``registry`` (one per engine or server)."""

  def __init__(self, registry: prom.CollectorRegistry):
    self.registry = registry
    hist = lambda name, doc: prom.Histogram(name, doc, buckets=_LATENCY_BUCKETS,
                                            registry=registry)
    self.ttft = hist("phaseserve_ttft_seconds", "arrival to the first generated token id")
    self.tpot = hist("phaseserve_tpot_seconds", "(e2e - TTFT) / (tokens - 1) per request")
    self.e2e = hist("phaseserve_e2e_seconds", "arrival to the end of the request")
    self.queue = hist("phaseserve_queue_seconds", "arrival to the first prefill chunk")
    self.itl = hist("phaseserve_inter_token_seconds", "gaps between consecutive token ids")
    self.queue_length = prom.Gauge("phaseserve_queue_length", "requests waiting",
                                   registry=registry)
    self.running = prom.Gauge("phaseserve_running_sequences", "sequences holding KV",
                              registry=registry)
    self.kv_pages_used = prom.Gauge("phaseserve_kv_pages_used", "KV pages in use",
                                    registry=registry)
    self.kv_pages_free = prom.Gauge("phaseserve_kv_pages_free", "KV pages free",
                                    registry=registry)
    self.kv_pages_cached = prom.Gauge("phaseserve_kv_pages_cached",
                                      "KV pages held only by the prefix cache (reclaimable)",
                                      registry=registry)
    self.finished = prom.Counter("phaseserve_requests_finished", "finished requests by reason",
                                 ["reason"], registry=registry)
    # Steps: what prefill puts beside the decodes (TPOT is the step time of a decoding row).
    self.step_seconds = hist("phaseserve_step_seconds",
                             "wall time of one busy engine call (a step's device time)")
    self.step_prefill_tokens = prom.Gauge("phaseserve_step_prefill_tokens",
                                          "prefill tokens of the last planned step",
                                          registry=registry)
    self.step_decode_rows = prom.Gauge("phaseserve_step_decode_rows",
                                       "decode rows of the last planned step", registry=registry)
    self.prefill_limit = prom.Gauge("phaseserve_prefill_limit_tokens",
                                    "the TPOT-aware prefill budget of the last decoding step "
                                    "(-1: none applied)", registry=registry)
    # Faults: what an observer raised (serving.guard) and what ended the loop itself.
    self.internal_errors = prom.Counter("phaseserve_internal_errors",
                                        "exceptions caught around what only observes the loop",
                                        ["part"], registry=registry)
    self.loop_failures = prom.Counter("phaseserve_loop_failures",
                                      "serving loop failures by kind (internal, fatal, hung)",
                                      ["kind"], registry=registry)
    self.loop_restarts = prom.Counter("phaseserve_loop_restarts",
                                      "serving loop rebuilt on the same engine after a failure",
                                      registry=registry)

  def watch_timeline(self, timeline: StepTimeline) -> None:
    """Exports ``timeline``'s totals at scrape time: ``phaseserve_step_phase_seconds_total`` and
    ``phaseserve_step_phase_cpu_seconds_total`` by phase, ``phaseserve_steps_total``, and the
    decode-only steps' count and seconds (``phaseserve_decode_only_step*``), and the decode rows
    and prefill tokens summed over steps (``phaseserve_step_{rows_decoded,tokens_prefilled}_total``)."""
    self.registry.register(_TimelineCollector(timeline))

  def watch_spec(self, counts: Callable[[], SpecCounts]) -> None:
    """Exports the speculative-decoding totals ``counts()`` returns at scrape time
    (``phaseserve_spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total`` and
    ``..._accepted_tokens_per_pos_total`` by position)."""
    self.registry.register(_SpecCollector(counts))

  def watch_lora(self, info: Callable[[], tuple[int, list[str], list[str], int] | None]
                 ) -> None:
    """Exports ``info()`` (``Scheduler.lora_info``) at scrape time: vLLM's
    ``lora_requests_info`` as ``phaseserve_lora_requests_info`` and
    ``phaseserve_lora_loads_total``; nothing without adapters."""
    self.registry.register(_LoraCollector(info))

  def observe(self, trace: RequestTrace) -> None:
    t = trace.timings()
    for hist, key in ((self.ttft, "ttft_s"), (self.tpot, "tpot_s"), (self.e2e, "e2e_s"),
                      (self.queue, "queue_s")):
      value = t[key]
      if value is not None:
        hist.observe(value)
    for gap in trace.inter_token_s():
      self.itl.observe(gap)
    self.finished.labels(reason=trace.finish_reason or "unknown").inc()
