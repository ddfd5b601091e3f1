"""A cluster of model instances serving a trace: a discrete-event simulation on a simulated clock.

Contract: ``simulate(requests, deployment, slo=None) -> SimResult``.

* ``SimDeployment``: ``interleaved(n, ...)`` is ``n`` mixed instances (every instance prefills and
  decodes, chunked prefill inside the token budget); ``disaggregated(p, d, ...)`` is ``p``
  prefill instances and ``d`` decode instances (Splitwise / DistServe: decoupled pools, each
  running its own steps). A prompt's KV moves from its prefill instance to a decode instance
  over the prefill instance's link (``link_bytes_per_s``, one transfer at a time per link,
  FIFO, plus ``link_latency_s``), then waits there for a slot. Each pool has its own
  ``EngineSpec`` and ``StepTime`` and KV capacity in tokens per instance.
* Dispatch: a request goes to the prefill (or mixed) instance with the fewest queued prefill
  tokens, then the fewest rows (join-the-shortest-queue); a transferred request to the decode
  instance with the fewest rows held. Requests that could never fit an instance's KV are
  ``rejected`` at arrival.
* Early rejection (``early_reject`` and an ``slo``): at arrival, the instance's predicted TTFT
  (``serving.api.admission.predict`` with the instance's online ``StepCostModel``, the backlog,
  the decoding rows and the slot wait, exactly as the live front end computes it) above the
  SLO's TTFT rejects the request (Mooncake).
* Events: arrivals, step ends, transfer ends, in time order (ties: arrivals first, then by
  insertion). An idle instance starts a step once every event of the current time is in (the
  live loop admits its whole inbox before it plans), so simultaneous arrivals share a step.
* ``SimResult``: one ``Record`` per request (TTFT = first token - arrival; TPOT = (end - first
  token) / (output - 1), as the load generator; e2e), the simulated span, and per instance its
  busy fraction, mean decode rows per step and prefill tokens per step.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Sequence

from launch.lab.loadgen_lib.slo import Slo
from launch.lab.simulator.instance import EngineSpec, Instance, Live, Role
from launch.lab.simulator.step_time import StepTime
from serving.api import admission


@dataclasses.dataclass(frozen=True)
class SimRequest:
  arrival_s: float
  prompt_len: int
  output_len: int
  cached_tokens: int = 0  # prompt tokens found in the prefix cache


@dataclasses.dataclass(frozen=True)
class Pool:
  role: Role
  count: int
  spec: EngineSpec
  step_time: StepTime
  kv_tokens: int
  chips: int = 1  # chips per instance (utilisation and cost accounting)


@dataclasses.dataclass(frozen=True)
class SimDeployment:
  pools: tuple[Pool, ...]
  link_bytes_per_s: float = 0.0  # per prefill instance; 0: transfers are free
  link_latency_s: float = 0.0
  kv_bytes_per_token: float = 0.0
  early_reject: bool = False

  @property
  def chips(self) -> int:
    return sum(p.count * p.chips for p in self.pools)

  @staticmethod
  def interleaved(n: int, spec: EngineSpec, step_time: StepTime, kv_tokens: int, chips: int = 1,
                  early_reject: bool = False) -> "SimDeployment":
    if n < 1:
      raise ValueError("an interleaved deployment needs >= 1 instance")
    return SimDeployment((Pool("mixed", n, spec, step_time, kv_tokens, chips),),
                      early_reject=early_reject)

  @staticmethod
  def disaggregated(prefill: Pool, decode: Pool, link_bytes_per_s: float,
                    kv_bytes_per_token: float, link_latency_s: float = 0.0,
                    early_reject: bool = False) -> "SimDeployment":
    if prefill.role != "prefill" or decode.role != "decode" or min(prefill.count,
                                                                   decode.count) < 1:
      raise ValueError("a disaggregated deployment needs >= 1 prefill and >= 1 decode instance")
    return SimDeployment((prefill, decode), link_bytes_per_s, link_latency_s, kv_bytes_per_token,
                      early_reject)


@dataclasses.dataclass(frozen=True)
class Record:
  index: int
  status: str  # ok | rejected
  arrival_s: float
  prompt_len: int
  output_len: int
  cached_tokens: int
  ttft_s: float | None
  tpot_s: float | None
  e2e_s: float | None
  queue_s: float | None  # arrival -> a slot on the first instance
  instance: str
  decode_instance: str


@dataclasses.dataclass(frozen=True)
class InstanceStats:
  name: str
  role: str
  chips: int
  busy_fraction: float
  mean_decode_rows: float
  mean_prefill_tokens: float
  steps: int


@dataclasses.dataclass(frozen=True)
class SimResult:
  records: tuple[Record, ...]
  span_s: float  # first arrival to the last event
  instances: tuple[InstanceStats, ...]

  def pool_utilisation(self) -> dict[str, float]:
    """Mean busy fraction of the instances of each role."""
    out: dict[str, list[float]] = {}
    for s in self.instances:
      out.setdefault(s.role, []).append(s.busy_fraction)
    return {k: sum(v) / len(v) for k, v in out.items()}


_ARRIVAL, _TRANSFER, _STEP = 0, 1, 2


def simulate(requests: Sequence[SimRequest], deployment: SimDeployment, slo: Slo | None = None
             ) -> SimResult:
  order = itertools.count()
  pools = []
  for pool in deployment.pools:
    pools.append([Instance(f"{pool.role}{i}", pool.role, pool.spec, pool.step_time,
                           pool.kv_tokens, track_cost=deployment.early_reject)
                  for i in range(pool.count)])
  front = pools[0]
  back = pools[1] if len(pools) > 1 else []
  chips = {i.name: p.chips for p, insts in zip(deployment.pools, pools) for i in insts}
  events: list[tuple[float, int, int, object]] = []
  lives = [Live(i, r.arrival_s, r.prompt_len, r.output_len, r.cached_tokens)
           for i, r in enumerate(requests)]
  for live in lives:
    heapq.heappush(events, (live.arrival_s, _ARRIVAL, next(order), live))
  link_free: dict[str, float] = {}
  t = last_t = 0.0

  dirty: dict[str, Instance] = {}  # instances to start once every event of this time is in

  def kick(inst: Instance) -> None:
    dirty[inst.name] = inst

  def start_steps(now: float) -> None:
    for inst in dirty.values():
      if not inst.busy and inst.has_work:
        dt = inst.start_step(now)
        if dt is not None:
          heapq.heappush(events, (now + dt, _STEP, next(order), inst))
    dirty.clear()

  while events or dirty:
    if dirty and (not events or events[0][0] > last_t):
      start_steps(last_t)
      continue
    t, kind, _, obj = heapq.heappop(events)
    last_t = t
    if kind == _ARRIVAL:
      live = obj
      assert isinstance(live, Live)
      inst = min(front, key=lambda i: i.load)
      ok = inst.can_ever_fit(live) and (not back or back[0].can_ever_fit(live))
      if ok and deployment.early_reject and slo is not None:
        pred = admission.predict(admission.Load(
            inst.step_ema_s, inst.backlog_tokens, inst.decoding, inst.spec.max_step_tokens,
            live.left, model=inst.cost_model,
            slot_wait_steps=inst.slot_wait_steps(len(inst.waiting))))
        ok = pred.ttft_s <= slo.ttft_s
      if not ok:
        live.status = "rejected"
        continue
      live.instance = inst.name
      inst.enqueue(live)
      kick(inst)
    elif kind == _STEP:
      inst = obj
      assert isinstance(inst, Instance)
      made = inst.end_step(t)
      for live in made.prefilled:
        start = max(t, link_free.get(inst.name, 0.0))
        done = start + deployment.link_latency_s + (
            live.prompt * deployment.kv_bytes_per_token / deployment.link_bytes_per_s
            if deployment.link_bytes_per_s else 0.0)
        link_free[inst.name] = done
        heapq.heappush(events, (done, _TRANSFER, next(order), (inst, live)))
      kick(inst)
    else:
      src, live = obj  # type: ignore[misc]
      src.release_kv(live.prompt)
      dst = min(back, key=lambda i: (i.slots_used + len(i.waiting), i.kv_used))
      live.decode_instance = dst.name
      dst.enqueue(live)
      kick(dst)
      kick(src)
  start = min((r.arrival_s for r in requests), default=0.0)
  span = max(t - start, 1e-12)
  records = tuple(_record(live) for live in lives)
  stats = tuple(InstanceStats(i.name, i.role, chips[i.name], i.busy_s / span,
                              i.rows_sum / max(1, i.steps_run),
                              i.prefill_tokens_sum / max(1, i.steps_run), i.steps_run)
                for insts in pools for i in insts)
  return SimResult(records, span, stats)


def _record(live: Live) -> Record:
  ok = live.status == "ok" and live.first_s is not None and live.end_s is not None
  ttft = live.first_s - live.arrival_s if ok else None  # type: ignore[operator]
  tpot = ((live.end_s - live.first_s) / (live.output - 1)  # type: ignore[operator]
          if ok and live.output > 1 else None)
  return Record(live.index, "ok" if ok else live.status, live.arrival_s, live.prompt,
                live.output, live.cached, ttft, tpot,
                live.end_s - live.arrival_s if ok else None,  # type: ignore[operator]
                None if live.admitted_s is None else live.admitted_s - live.arrival_s,
                live.instance, live.decode_instance)
