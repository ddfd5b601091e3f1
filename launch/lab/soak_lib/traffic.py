"""The soak's traffic and timeline (``launch.lab.soak``): when each request is sent, and the record
of every one.

Contract:
  * ``plan(duration_s, idle_s, idle_every_s) -> (gaps, active_s)``: the idle gaps and the active
    seconds of each stretch (``CliError`` where the gaps leave under 1 s of traffic);
    ``bursts_in(a0, a1, every, length)``: the bursts (offsets from its start) of the stretch
    spanning active time ``[a0, a1)``, one at every ``every * (k + 1/2)``, clipped to it.
  * ``Traffic(server, model_name, vocab, max_context, t_ready, rng, cfg)``: the requests
    (``send``: ``launch.lab.soak_lib.senders.Senders``, whose ``variants`` it cycles through) and
    their scheduling: ``tracked`` sends one and appends its ``launch.lab.soak_lib.report.Rec`` to
    ``records`` (``in_burst``: a non-probe sent in a burst or its grace; a request the soak
    itself cancels is ``abandoned``; an exception of a sender is a ``client_<class>`` error);
    ``launch(role)`` sends the next variant; ``probe``, ``long_generation``, ``steady_lane``
    (``lane_tokens`` / ``lane_generations``); ``wait_drained``, ``cancel_all``, ``close``;
    ``phase`` / ``sampler_phase()`` name the timeline's part for the sampler; ``drains`` and
    ``bursting`` record the run.
  * ``await run_traffic(server, sampler, cfg, info, t_ready, gaps) -> (traffic, why)``: the whole
    timeline (``drive``: ``launch.lab.soak``'s docstring), ``gaps`` receiving one row per idle gap;
    ``why`` says why it stopped early (the server exited), ``""`` if it did not. Every request
    has ended and the clients are closed when it returns.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Awaitable, Callable

from launch.cli import CliError
from launch.lab.soak_lib.report import Rec, category
from launch.lab.soak_lib.senders import Res, Senders


def plan(duration_s: float, idle_s: float, idle_every_s: float) -> tuple[int, float]:
  """(idle gaps, active seconds per stretch)."""
  gaps = max(1, round(duration_s / idle_every_s))
  active = (duration_s - gaps * idle_s) / gaps
  if active < 1.0:
    raise CliError(f"--duration_s {duration_s:g} leaves no traffic around {gaps} idle gap(s) of "
                   f"--idle_s {idle_s:g}")
  return gaps, active


def bursts_in(a0: float, a1: float, every: float, length: float) -> list[tuple[float, float]]:
  """Bursts (offsets from the stretch's start) of a stretch spanning active time [a0, a1): one
  at every ``every * (k + 1/2)``, clipped to the stretch."""
  out = []
  if length <= 0:
    return out
  k = 0
  while True:
    b = every * (k + 0.5)
    if b >= a1:
      return out
    if b >= a0:
      out.append((b - a0, min(b + length, a1) - a0))
    k += 1


class Traffic:
  """Every sender of one soak; ``records`` collects one ``Rec`` per request."""

  def __init__(self, server, model_name: str, vocab: int, max_context: int, t_ready: float,
               rng, cfg: dict):
    self.send = Senders(server, model_name, vocab, max_context, rng, cfg)
    self.variants = self.send.variants
    self.t_ready, self.rng, self.cfg = t_ready, rng, cfg
    self.records: list[Rec] = []
    self.inflight = 0
    self.changed = asyncio.Condition()
    self.accepting = asyncio.Event()
    self.finished = False
    self.burst_windows: list[tuple[float, float]] = []  # monotonic [start, end + grace)
    self.bursting: list[tuple[float, float]] = []       # monotonic [start, end) (sampler phase)
    self.phase = "ready"
    self.counter = itertools.count()
    self.lane_tokens = [0] * cfg["steady_rows"]
    self.lane_generations = [0] * cfg["steady_rows"]
    self.drains: list[dict] = []
    self.tasks: set[asyncio.Task] = set()  # every request task, lane and the long generation

  # ---- bookkeeping

  def rel(self, t: float) -> float:
    return round(t - self.t_ready, 3)

  def in_burst(self, t: float) -> bool:
    return any(a <= t < b for a, b in self.burst_windows)

  def sampler_phase(self) -> str:
    now = time.monotonic()
    if self.phase == "active" and any(a <= now < b for a, b in self.bursting):
      return "burst"
    return self.phase

  async def tracked(self, api: str, kind: str, role: str,
                    call: Callable[[], Awaitable[Res]], *, stream: bool = True, n: int = 1,
                    lane: int | None = None) -> Rec:
    async with self.changed:
      self.inflight += 1
    t = time.monotonic()
    try:
      r = await call()
    except asyncio.CancelledError:  # the soak gave up on it (drain timeout, dead server)
      self.records.append(Rec(api, kind, role, self.rel(t), "soak_cancelled", "abandoned",
                              "cancelled by the soak", stream=stream, n=n, lane=lane,
                              e2e_s=round(time.monotonic() - t, 4)))
      raise
    except Exception as e:  # a bug in a sender is an error of the soak, recorded as such
      r = Res(f"client_{type(e).__name__}", str(e)[:300], t, end=time.monotonic())
    finally:
      async with self.changed:
        self.inflight -= 1
        self.changed.notify_all()
    sent = r.sent or t
    ttft = (r.first - sent) if r.first is not None and r.status == "ok" else None
    tpot = ((r.end - r.first) / (r.tokens - 1)
            if ttft is not None and n == 1 and r.tokens > 1 and stream else None)
    rec = Rec(api, kind, role, self.rel(sent), r.status, category(r.status, r.tokens),
              r.error[:300], not role.startswith("probe") and self.in_burst(sent), stream, n,
              r.tokens,
              r.cached, r.finish, ttft if stream else None, tpot,
              round(max(0.0, r.end - sent), 4), lane)
    self.records.append(rec)
    return rec

  async def wait_drained(self, timeout_s: float) -> bool:
    async def empty():
      async with self.changed:
        await self.changed.wait_for(lambda: self.inflight == 0)
    try:
      await asyncio.wait_for(empty(), timeout_s)
      return True
    except TimeoutError:
      return False

  def launch(self, role: str) -> None:
    i = next(self.counter)
    api, kind, stream, n, make = self.variants[i % len(self.variants)]
    self.spawn(self.tracked(api, kind, role, lambda: make(i), stream=stream, n=n))

  def spawn(self, coro) -> asyncio.Task:
    task = asyncio.create_task(coro)
    self.tasks.add(task)
    task.add_done_callback(self.tasks.discard)
    return task

  async def cancel_all(self) -> None:
    tasks = [t for t in self.tasks if not t.done()]
    for t in tasks:
      t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

  # ---- probes, the long generation, the steady lanes

  async def probe(self, role: str) -> None:
    i, send = next(self.counter), self.send
    await self.tracked("openai_chat", "probe", role, lambda: send.http(
        "/v1/chat/completions", send.body(True, i, max_tokens=8)), stream=False)
    await self.tracked("phaseserve_grpc", "probe", role,
                       lambda: send.via(send.ps, send.ids(16), "", 8))

  async def long_generation(self) -> None:
    w = self.cfg["sink_window"]
    body = {"model": self.send.model, "prompt": "Once upon a time", "max_tokens":
            self.cfg["long_tokens"], "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if w:
      body["attention_sinks"] = {"window": w}
    timeout = self.cfg["duration_s"] + self.cfg["drain_timeout_s"] + self.cfg["request_timeout_s"]
    for _ in range(20):  # a refusal at the start is retried (and counted)
      rec = await self.tracked("openai_completions", "long_sinks", "long",
                               lambda: self.send.http("/v1/completions", body, timeout_s=timeout))
      if rec.category != "refused":
        return
      await asyncio.sleep(1.0)

  async def steady_lane(self, lane: int) -> None:
    prompt_len, send = 8, self.send
    max_tokens = min(1024, send.max_context - prompt_len)
    while True:
      await self.accepting.wait()
      if self.finished:
        return
      rec = await self.tracked(
          "phaseserve_grpc", "steady_ignore_eos", "steady",
          lambda: send.via(send.ps_eos, send.ids(prompt_len), "", max_tokens), lane=lane)
      self.lane_generations[lane] += 1
      if rec.category == "ok":
        self.lane_tokens[lane] += rec.output_tokens
      elif rec.category == "refused":
        await asyncio.sleep(0.5)
      else:
        await asyncio.sleep(1.0)

  async def close(self) -> None:
    await self.send.close()


# -- the run ------------------------------------------------------------------------------------


async def _sleep_until(t: float) -> None:
  await asyncio.sleep(max(0.0, t - time.monotonic()))


async def drive(tr: Traffic, sampler, cfg: dict, gaps: list[dict]) -> None:
  from launch.lab.loadgen_lib.arrivals import Arrivals, arrival_times_s
  n_gaps, active_s = plan(cfg["duration_s"], cfg["idle_s"], cfg["idle_every_s"])
  qps = cfg["qps"]
  lanes = [tr.spawn(tr.steady_lane(k)) for k in range(cfg["steady_rows"])]
  long_task = None
  try:
    for cycle in range(n_gaps):
      if cycle:
        tr.phase = "probe"
        await tr.probe("probe_idle")
      start = time.monotonic()
      tr.phase = "active"
      tr.accepting.set()
      if long_task is None:
        long_task = tr.spawn(tr.long_generation())
      sends = [(float(t), "ordinary") for t in
               arrival_times_s(Arrivals("poisson", qps), 0, active_s, tr.rng)]
      for b0, b1 in bursts_in(cycle * active_s, (cycle + 1) * active_s, cfg["burst_every_s"],
                              cfg["burst_s"]):
        tr.bursting.append((start + b0, start + b1))
        tr.burst_windows.append((start + b0, start + b1 + cfg["burst_grace_s"]))
        extra = qps * (cfg["burst_factor"] - 1.0)
        if extra > 0 and b1 > b0:
          sends += [(b0 + float(t), "ordinary") for t in
                    arrival_times_s(Arrivals("poisson", extra), 0, b1 - b0, tr.rng)]
      for t, role in sorted(sends):
        await _sleep_until(start + t)
        tr.launch(role)
      await _sleep_until(start + active_s)
      tr.accepting.clear()
      tr.phase = "drain"
      t_drain = time.monotonic()
      drained = await tr.wait_drained(cfg["drain_timeout_s"])
      tr.drains.append({"cycle": cycle, "drain_s": round(time.monotonic() - t_drain, 2),
                        "completed": drained})
      if not drained:
        await tr.cancel_all()
        return
      tr.phase = "probe"
      await tr.probe("probe_quiet")
      tr.phase = "idle"
      t_gap = time.monotonic()
      await asyncio.sleep(cfg["idle_s"])
      row = await asyncio.to_thread(sampler.sample, "idle_end")
      gaps.append({"cycle": cycle, "t_s": tr.rel(t_gap), "idle_s": cfg["idle_s"],
                   **{k: row.get(k) for k in ("kv_pages_used", "kv_pages_cached", "running",
                                              "queue", "live_streams", "rss_bytes", "fds",
                                              "maps", "compiled_programs",
                                              "programs_after_ready")}})
    tr.phase = "probe"
    await tr.probe("probe_idle")
    tr.phase = "end"
  finally:
    tr.finished = True
    tr.accepting.set()
    await tr.cancel_all()


async def run_traffic(server, sampler, cfg: dict, info: tuple[str, int, int], t_ready: float,
                      gaps: list[dict]) -> tuple[Traffic | None, str]:
  """Runs the timeline; returns the traffic and why it stopped early ("" if it did not)."""
  import numpy as np
  model_name, vocab, max_context = info
  tr = Traffic(server, model_name, vocab, max_context, t_ready,
               np.random.default_rng(cfg["seed"]), cfg)
  sampler.phase_fn = tr.sampler_phase
  main = asyncio.create_task(drive(tr, sampler, cfg, gaps))
  why = ""
  try:
    while not main.done():
      await asyncio.wait({main}, timeout=0.5)
      if server.proc.poll() is not None and not main.done():
        why = f"the server exited with code {server.proc.returncode} during the soak"
        main.cancel()
        await asyncio.gather(main, return_exceptions=True)
    if main.done() and not main.cancelled() and main.exception() is not None:
      raise main.exception()
  finally:
    if not main.done():
      main.cancel()
      await asyncio.gather(main, return_exceptions=True)
    await tr.cancel_all()  # a cancelled run: every request ends before the clients close
    await tr.close()
  return tr, why
