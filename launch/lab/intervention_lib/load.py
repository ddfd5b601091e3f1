"""One segment's open-loop run against one server: the same seeded schedule for every config.

Contract: ``run_segment(target, segment, rate_per_s, seed, slo, out_dir)`` builds the segment's
sessions and Poisson arrivals from ``seed`` alone (the server's vocabulary and context, read
from its ``ServerInfo``, only clip lengths, so configs of one model get identical requests),
sends two short warm-up requests, drives the run with the phaseserve gRPC driver (streaming,
greedy, ``ignore_eos``: every answer runs to its ``max_tokens``) and writes loadgen's
``requests.csv`` / ``summary.json`` / ``latency.png`` into ``out_dir``. Returns a
``SegmentRun``: the records keyed by ``(session, turn)``, the summary, and the phase breakdown
(p50 over ok requests of the server's own timings: queue, prefill, first token, decode).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np

from launch.lab.loadgen_lib import drivers, report, runner, workload
from launch.lab.loadgen_lib.arrivals import Arrivals, arrival_times_s
from launch.lab.loadgen_lib.slo import Slo
from launch.lab.intervention_lib.segments import Segment


@dataclasses.dataclass(frozen=True)
class SegmentRun:
  segment: str
  rate_per_s: float
  records: dict[tuple[int, int], runner.RequestRecord]
  summary: dict
  phases_s: dict[str, float | None]


def build_workload(segment: Segment, rate_per_s: float, seed: int, vocab_size: int,
                   max_context: int) -> workload.Workload:
  rng = np.random.default_rng(seed)
  times = arrival_times_s(Arrivals(rate_per_s=rate_per_s), segment.requests, 0.0, rng)
  cfg = workload.WorkloadConfig(profile=segment.profile, length_scale=segment.length_scale,
                                vocab_size=vocab_size, max_context=max_context)
  return workload.build_sessions(cfg, times, rng)


def phases(records) -> dict[str, float | None]:
  ok = [r for r in records if r.status == "ok"]

  def p50(xs):
    return report.percentile([x for x in xs if x is not None], 0.5)

  decode = [r.server_e2e_s - r.server_ttft_s for r in ok
            if r.server_e2e_s is not None and r.server_ttft_s is not None]
  first = [r.server_ttft_s - r.queue_s - r.prefill_s for r in ok
           if None not in (r.server_ttft_s, r.queue_s, r.prefill_s)]
  return {"queue": p50([r.queue_s for r in ok]), "prefill": p50([r.prefill_s for r in ok]),
          "first_token": p50(first), "decode": p50(decode)}


def run_segment(target: str, segment: Segment, rate_per_s: float, seed: int, slo: Slo,
                out_dir: str) -> SegmentRun:
  dcfg = drivers.DriverConfig(api="phaseserve", target=target)
  info = drivers.server_info(dcfg)
  if info is None:
    raise RuntimeError(f"{target}: no ServerInfo (the server is down)")
  wl = build_workload(segment, rate_per_s, seed, info[0], info[1])

  async def go() -> runner.RunResult:
    driver = drivers.make_driver(dcfg)
    try:
      for n in (8, 16):  # warm the path without touching the measured schedule
        await driver.generate(tuple(range(100, 100 + n)), "", 4, "")
      return await runner.run_open_loop(wl, driver, slo, progress=False,
                                        run_tag=f"{segment.name}-{seed}-{time.time_ns()}")
    finally:
      await driver.close()

  result = asyncio.run(go())
  summary = {"segment": segment.name, "rate_per_s": rate_per_s, "seed": seed,
             "planned_requests": wl.requests, "clipped": wl.clipped,
             **report.summarize(result, slo)}
  report.write_run(out_dir, result, summary, slo)
  return SegmentRun(segment.name, rate_per_s, {(r.session, r.turn): r for r in result.records},
                    summary, phases(result.records))
