"""A whole load-generator run from one ``LoadgenConfig`` (the CLI's flags, flag-free here).

Contract: ``run(cfg)`` returns the summary dict it wrote. A single run writes ``requests.csv``,
``summary.json`` and ``latency.png`` into ``cfg.out_dir``; ``find_capacity`` writes each rate's
three files into ``out_dir/rates/rate_<r>/`` as soon as that rate ends, then ``capacity.csv``,
``capacity.json`` and ``capacity.png`` into ``out_dir``; a rerun with the same configuration
(the ``fingerprint``: everything but the target, the output directory, the progress bar and the
rate) reuses every finished rate and measures only the rest. An open-loop run at one rate is
not resumable (its arrivals are one schedule). For phaseserve and jetstream targets, a
``vocab_size`` of 0 and a ``max_context`` of -1 are read from phaseserve's ``ServerInfo`` on the
same port (without one, ``vocab_size`` must be given and nothing is clipped).
``warmup_requests`` short requests go one after another before the first measured run and are
not recorded; when every one fails, ``run`` raises ``RuntimeError`` (the target is down or
refuses everything). Raises ``ValueError`` for a bad configuration.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import time
import uuid

import numpy as np

from launch import machine
from launch.lab.loadgen_lib import capacity, drivers, report, runner, workload
from launch.lab.loadgen_lib.arrivals import Arrivals, arrival_times_s
from launch.lab.loadgen_lib.slo import Slo, parse_slo


@dataclasses.dataclass(frozen=True)
class LoadgenConfig:
  driver: drivers.DriverConfig
  out_dir: str
  arrivals: Arrivals = Arrivals()
  workload: workload.WorkloadConfig = workload.WorkloadConfig()
  num_requests: int = 100
  duration_s: float = 0.0
  seed: int = 0
  slo: str = ""                 # "": the profile's default preset
  slo_scale: float = 1.0
  trace_path: str = ""
  find_capacity: bool = False
  search: capacity.Search = capacity.Search()
  warmup_requests: int = 2
  progress: bool = True


def machine_info() -> dict:
  info = {"cpu": machine.cpu_model(), "cpu_count": os.cpu_count()}
  if hasattr(os, "getloadavg"):
    info["load_avg_1m"] = round(os.getloadavg()[0], 2)
  return info


def _resolve(cfg: LoadgenConfig) -> LoadgenConfig:
  w = cfg.workload
  if cfg.driver.api != "openai" and (w.vocab_size == 0 or w.max_context < 0):
    info = drivers.server_info(cfg.driver)
    if info is None and w.vocab_size == 0:
      raise RuntimeError(f"{cfg.driver.target}: no phaseserve ServerInfo (not phaseserve, or "
                         "down); give --vocab_size")
    if info is not None:
      w = dataclasses.replace(w, vocab_size=w.vocab_size or info[0],
                              max_context=info[1] if w.max_context < 0 else w.max_context)
  if w.vocab_size <= 0:
    w = dataclasses.replace(w, vocab_size=32000)  # openai: ids only choose words
  if w.max_context < 0:
    w = dataclasses.replace(w, max_context=0)
  return dataclasses.replace(cfg, workload=w)


def fingerprint(cfg: LoadgenConfig) -> str:
  d = dataclasses.asdict(cfg)
  for k in ("out_dir", "progress"):
    d.pop(k)
  d["driver"].pop("target")
  d["arrivals"].pop("rate_per_s")
  d["search"] = None
  return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _slo(cfg: LoadgenConfig) -> Slo:
  name = cfg.slo or (workload.PROFILES[cfg.workload.profile].slo
                     if cfg.workload.profile in workload.PROFILES else "server")
  return parse_slo(name, cfg.slo_scale)


def _workload(cfg: LoadgenConfig, rate: float,
              trace: tuple[workload.TraceRow, ...]) -> workload.Workload:
  rng = np.random.default_rng(cfg.seed)
  if trace:
    times = np.asarray([r.arrival_s for r in trace])
    times = times - times[0]
    if cfg.find_capacity and len(times) > 1 and times[-1] > 0:
      times = times * ((len(times) - 1) / times[-1]) / rate  # rescaled to the rate
    return workload.build_sessions(cfg.workload, times, rng, trace)
  times = arrival_times_s(dataclasses.replace(cfg.arrivals, rate_per_s=rate), cfg.num_requests,
                          cfg.duration_s, rng)
  return workload.build_sessions(cfg.workload, times, rng)


async def _warmup(driver: drivers.Driver, cfg: LoadgenConfig) -> list[str]:
  rng = np.random.default_rng(cfg.seed + 1)
  statuses = []
  for _ in range(cfg.warmup_requests):
    ids = tuple(int(x) for x in rng.integers(min(100, cfg.workload.vocab_size // 4),
                                             cfg.workload.vocab_size, 8))
    o = await driver.generate(ids, workload.ids_to_text(ids), 4, "")
    statuses.append(o.status)
  if statuses and "ok" not in statuses:
    raise RuntimeError(f"{cfg.driver.target}: every warm-up request failed ({statuses[0]})")
  return statuses


class _Session:
  """One driver on one event loop for every rate of the run."""

  def __init__(self, cfg: LoadgenConfig):
    self.cfg = cfg
    self.loop = asyncio.Runner()
    self.driver: drivers.Driver | None = None
    self.warmup: list[str] = []

  def measure(self, wl: workload.Workload, slo: Slo) -> runner.RunResult:
    async def go():
      if self.driver is None:
        self.driver = drivers.make_driver(self.cfg.driver)
        self.warmup = await _warmup(self.driver, self.cfg)
      return await runner.run_open_loop(wl, self.driver, slo, self.cfg.progress,
                                        uuid.uuid4().hex[:8])
    return self.loop.run(go())

  def close(self) -> None:
    if self.driver is not None:
      self.loop.run(self.driver.close())
    self.loop.close()


def run(cfg: LoadgenConfig) -> dict:
  cfg = _resolve(cfg)
  slo = _slo(cfg)
  trace = workload.load_trace(cfg.trace_path) if cfg.trace_path else ()
  if trace and cfg.workload.profile != "trace":
    cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, profile="trace"))
  fp = fingerprint(cfg)
  base = {"fingerprint": fp, "config": dataclasses.asdict(cfg)}
  os.makedirs(cfg.out_dir, exist_ok=True)
  session = _Session(cfg)
  try:
    def one(rate: float, out_dir: str) -> dict:
      wl = _workload(cfg, rate, trace)
      started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
      before = machine_info()
      result = session.measure(wl, slo)
      after = machine_info()
      machine_load = {**before, "load_avg_1m_after": after.get("load_avg_1m")}
      summary = {**base, "machine": machine_load, "rate_per_s": rate, "started": started,
                 "planned_requests": wl.requests, "clipped": wl.clipped,
                 "warmup_statuses": session.warmup, **report.summarize(result, slo)}
      report.write_run(out_dir, result, summary, slo)
      return summary

    if not cfg.find_capacity:
      return one(cfg.arrivals.rate_per_s, cfg.out_dir)
    store = capacity.RateStore(os.path.join(cfg.out_dir, "rates"), fp)
    result = capacity.find_capacity(cfg.search, store, lambda r: one(r, store.dir(r)))
    return capacity.write_capacity(cfg.out_dir, result, dataclasses.asdict(slo),
                                   {"fingerprint": fp, "search": dataclasses.asdict(cfg.search),
                                    "machine": machine_info()})
  finally:
    session.close()
