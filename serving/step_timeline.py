"""Where a serving step's time goes, measured on the loop's own thread.

Contract: ``StepTimeline(keep=4096, clock=time.perf_counter, cpu_clock=time.thread_time)``;
the serving loop calls ``begin()`` at the top of a step, ``mark(phase)`` after each part,
``end(prefill_tokens, decode_rows, wait_s, compiled)`` after a busy step and ``idle()`` when the
step found nothing to do. Phases (``PHASES``):
  * ``between``: from the last busy step's end to this one's start (the loop's own overhead and
    the time it waits to get the GIL back);
  * ``admit``: submissions moved into the scheduler; ``plan``: ``scheduler.schedule()``;
  * ``dispatch``: the engine call less ``wait`` (host-side preparation, transfers, the
    asynchronous launch); ``wait``: the part of the engine call spent waiting for a previous
    step's sampled ids (``StepResult.wait_s``: device time the host did not hide);
  * ``update``: ``scheduler.update`` (stop checks, detokenization of stop strings, bookkeeping);
  * ``deliver``: the output callbacks (stream queues of the gRPC / HTTP front ends).
Each phase has its wall time and the loop thread's CPU time; wall minus CPU is time the thread
was runnable-but-not-running or blocked: on the GIL, on another thread, on the device.
``host_s`` is a moving average of a step's ``HOST_PHASES`` (all but dispatch and wait: what
admission adds to the engine-call cost per step). ``records`` keeps the last ``keep`` busy steps (``StepRecord``); ``totals`` sums every step since
start (what Prometheus exports: ``Metrics.watch_timeline``). ``summarize(records)`` is the
breakdown as JSON: per phase the mean wall / CPU ms and share of the step, and the decode-only
steps' wall p50 / p90 per decode batch (the engine's own decode step at the batch running).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Iterable

import numpy as np

PHASES = ("between", "admit", "plan", "dispatch", "wait", "update", "deliver")
HOST_PHASES = ("between", "admit", "plan", "update", "deliver")  # the loop's, not the engine's


@dataclasses.dataclass(frozen=True)
class StepRecord:
  t: float  # the step's start on ``clock``
  wall: dict[str, float]  # phase -> seconds
  cpu: dict[str, float]  # phase -> loop-thread CPU seconds
  prefill_tokens: int
  decode_rows: int
  compiled: bool  # the engine call grew the program count (it timed a compiler)

  @property
  def step_s(self) -> float:
    """The step itself, without the gap before it."""
    return sum(v for k, v in self.wall.items() if k != "between")


class StepTimeline:
  def __init__(self, keep: int = 4096, clock: Callable[[], float] = time.perf_counter,
               cpu_clock: Callable[[], float] = time.thread_time):
    self.records: collections.deque[StepRecord] = collections.deque(maxlen=keep)
    self.totals_wall = dict.fromkeys(PHASES, 0.0)
    self.totals_cpu = dict.fromkeys(PHASES, 0.0)
    self.steps = 0
    self.decode_only_steps = 0
    self.decode_only_s = 0.0
    self.decode_rows = 0  # summed over steps (mean batch = decode_rows / steps)
    self.prefill_tokens = 0
    self.host_s = 0.0  # moving average of a step's HOST_PHASES (admission adds it per step)
    self._clock, self._cpu = clock, cpu_clock
    self._last_end: tuple[float, float] | None = None  # (wall, cpu) at the last busy step's end
    self._mark: tuple[float, float] = (0.0, 0.0)
    self._start = 0.0
    self._wall: dict[str, float] = {}
    self._cpu_s: dict[str, float] = {}

  def begin(self) -> None:
    now = (self._clock(), self._cpu())
    self._wall, self._cpu_s = {}, {}
    if self._last_end is not None:
      self._wall["between"] = now[0] - self._last_end[0]
      self._cpu_s["between"] = now[1] - self._last_end[1]
    self._start = now[0]
    self._mark = now

  def mark(self, phase: str) -> None:
    """Charges the time since the last mark (or ``begin``) to ``phase`` (adding up repeats)."""
    now = (self._clock(), self._cpu())
    self._wall[phase] = self._wall.get(phase, 0.0) + now[0] - self._mark[0]
    self._cpu_s[phase] = self._cpu_s.get(phase, 0.0) + now[1] - self._mark[1]
    self._mark = now

  def idle(self) -> None:
    """The step found nothing to do: the next busy step has no ``between``."""
    self._last_end = None

  def end(self, prefill_tokens: int, decode_rows: int, wait_s: float = 0.0,
          compiled: bool = False) -> StepRecord:
    """Closes a busy step; ``wait_s`` is carved out of the ``execute`` mark."""
    execute = self._wall.pop("execute", 0.0)
    wait = min(max(wait_s, 0.0), execute)
    self._wall["dispatch"], self._wall["wait"] = execute - wait, wait
    self._cpu_s["dispatch"] = self._cpu_s.pop("execute", 0.0)
    self._cpu_s["wait"] = 0.0
    wall = {p: self._wall.get(p, 0.0) for p in PHASES}
    cpu = {p: self._cpu_s.get(p, 0.0) for p in PHASES}
    rec = StepRecord(self._start, wall, cpu, prefill_tokens, decode_rows, compiled)
    self.records.append(rec)
    self.steps += 1
    self.decode_rows += decode_rows
    self.prefill_tokens += prefill_tokens
    for p in PHASES:
      self.totals_wall[p] += wall[p]
      self.totals_cpu[p] += cpu[p]
    if prefill_tokens == 0 and decode_rows and not compiled:
      self.decode_only_steps += 1
      self.decode_only_s += rec.step_s
    host = sum(wall[p] for p in HOST_PHASES)
    self.host_s = 0.9 * self.host_s + 0.1 * host if self.steps > 1 else host
    self._last_end = self._mark
    return rec


def summarize(records: Iterable[StepRecord]) -> dict[str, object]:
  """The breakdown of ``records`` (JSON-able); steps that compiled a program are left out."""
  recs = [r for r in records if not r.compiled]
  out: dict[str, object] = {"steps": len(recs)}
  if not recs:
    return out
  total = sum(r.step_s + r.wall["between"] for r in recs)
  out["phases_ms"] = {
      p: {"wall": 1e3 * sum(r.wall[p] for r in recs) / len(recs),
          "cpu": 1e3 * sum(r.cpu[p] for r in recs) / len(recs),
          "share": sum(r.wall[p] for r in recs) / total if total else 0.0} for p in PHASES}
  out["step_ms"] = {"p50": 1e3 * float(np.median([r.step_s for r in recs])),
                    "p90": 1e3 * float(np.percentile([r.step_s for r in recs], 90))}
  by_rows: dict[int, list[float]] = collections.defaultdict(list)
  for r in recs:
    if r.prefill_tokens == 0 and r.decode_rows:
      by_rows[r.decode_rows].append(r.step_s)
  out["decode_only_ms"] = {
      str(rows): {"steps": len(v), "p50": 1e3 * float(np.median(v)),
                  "p90": 1e3 * float(np.percentile(v, 90))}
      for rows, v in sorted(by_rows.items())}
  with_prefill = [r.step_s for r in recs if r.prefill_tokens]
  if with_prefill:
    out["with_prefill_ms"] = {"steps": len(with_prefill),
                              "p50": 1e3 * float(np.median(with_prefill)),
                              "p90": 1e3 * float(np.percentile(with_prefill, 90))}
  return out
