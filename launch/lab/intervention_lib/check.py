"""The whole intervention check: start every config's server, load them in turn, gate them, judge.

Contract: ``run(cfg)`` starts one ``launch.server`` per config (``--model cfg.model``, the
common flags, the config's flags; its log in ``OUT/<label>/server.log``), the baseline's
first, then the candidates' side by side (those with the baseline's programs load them from
the compile cache it filled), all resident for the run so that each is measured warm and none is restarted between turns, then:
  1. per repeat, segment and rate, each config in turn runs the same seeded schedule
     (``load.run_segment``, seed ``cfg.seed + 1000 * repeat + 100 * rung``: the same requests
     for every config, fresh prompts per repeat and per rung of the ladder, so that no run meets
     its own earlier prompts in the server's prefix cache); the order alternates between repeats
     (A B, then B A) so that a drift of the machine falls on both; runs in
     ``OUT/<label>/load/...``;
  2. each config answers the quality gates' items (``gate_client``), one at a time (the
     configs side by side: greedy answers do not depend on the machine's load);
  3. each candidate is compared with the baseline: per segment ``perf.compare_segment``, per
     gate ``gate_compare.compare_gate``;
  4. ``verdict.write`` puts ``verdict.json``, ``verdict.txt`` and ``verdict.png`` in ``OUT``.
Every server is stopped on the way out, failing or not. Returns the verdict dict. The idle
servers wait on their sockets while another config runs (no polling loop).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import shlex
import time

import numpy as np

from launch import machine
from launch.lab.intervention_lib import gate_compare, gate_sets, load, perf, verdict
from launch.lab.intervention_lib.gate_client import Answer, GateClient
from launch.lab.intervention_lib.segments import Segment
from launch.lab.loadgen_lib.slo import parse_slo
from launch.lab.passages import read_passages
from launch.lab.soak_lib.server_proc import ServerProc, Spawned


@dataclasses.dataclass(frozen=True)
class Config:
  label: str
  flags: tuple[str, ...]

  @classmethod
  def parse(cls, label: str, text: str) -> "Config":
    return cls(label, tuple(shlex.split(text)))


@dataclasses.dataclass(frozen=True)
class CheckConfig:
  model: str
  baseline: Config
  candidates: tuple[Config, ...]
  segments: tuple[Segment, ...]
  out_dir: str
  common_flags: tuple[str, ...] = ()
  rate_multipliers: tuple[float, ...] = (1.0,)
  rate_scale: float = 1.0
  requests: int = 0                  # 0: each segment's own count
  repeats: int = 1
  slo_scale: float = 2.0
  gates: tuple[str, ...] = gate_sets.GATES
  passages: str = ""
  max_passages: int = 5
  gate_max_tokens: int = 48
  long_max_tokens: int = 2048
  sinks_window: int = 0              # > 0: a long_context stream past the context, with sinks
  logprobs: int = 20
  n_boot: int = 1000
  min_effect: float = 0.05
  thresholds: gate_compare.Thresholds = gate_compare.Thresholds()
  seed: int = 0
  ready_timeout_s: float = 900.0
  command: str = ""


def run_seed(seed: int, repeat: int, rung: int) -> int:
  """The schedule's seed: the same for every config, new per repeat and per rung (new prompts,
  so no run meets its own earlier prompts in a server's prefix cache)."""
  return seed + 1000 * repeat + 100 * rung


def _rates(cfg: CheckConfig, seg: Segment) -> tuple[float, ...]:
  return tuple(round(seg.rate_per_s * cfg.rate_scale * m, 4) for m in cfg.rate_multipliers)


def _long_lengths(cfg: CheckConfig, max_context: int) -> tuple[int, ...]:
  usable = min(max_context, cfg.long_max_tokens) - cfg.gate_max_tokens - 32
  return tuple(n for n in (usable // 4, usable // 2, usable) if n >= 32)


def _answers(server: ServerProc, items: list[gate_sets.Item], cfg: CheckConfig) -> list[Answer]:
  client = GateClient(server.target, server.http)
  try:
    return [client.answer(it, cfg.gate_max_tokens, cfg.logprobs) for it in items]
  finally:
    client.close()


def _start(cfg: CheckConfig, configs: tuple[Config, ...], servers: dict[str, ServerProc]) -> None:
  """The baseline's server first, then the candidates' side by side: a candidate whose programs
  are the baseline's loads them from the persistent compile cache the baseline filled, instead
  of every server compiling the same programs at once on the same cores. On a failure the
  servers not yet ready are killed before it propagates."""
  spawned: list[tuple[str, Spawned]] = []

  def spawn(c: Config) -> None:
    d = os.path.join(cfg.out_dir, c.label)
    os.makedirs(d, exist_ok=True)
    spawned.append((c.label, ServerProc.spawn(
        d, ["--model", cfg.model, *cfg.common_flags, *c.flags])))

  try:
    for group in (configs[:1], configs[1:]):
      for c in group:
        spawn(c)
      for label, sp in spawned:
        if label not in servers:
          servers[label] = sp.wait(cfg.ready_timeout_s)
  except BaseException:
    for label, sp in spawned:
      if label not in servers:
        sp.kill()
    raise


def run(cfg: CheckConfig) -> dict:
  configs = (cfg.baseline, *cfg.candidates)
  if len({c.label for c in configs}) != len(configs):
    raise ValueError("config labels must differ")
  os.makedirs(cfg.out_dir, exist_ok=True)
  started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
  t0 = time.monotonic()
  servers: dict[str, ServerProc] = {}
  try:
    _start(cfg, configs, servers)
    runs: dict[str, dict[str, perf.Runs]] = {c.label: {} for c in configs}
    for rep in range(cfg.repeats):
      order = configs if rep % 2 == 0 else configs[::-1]
      for seg in cfg.segments:
        if cfg.requests:
          seg = dataclasses.replace(seg, requests=cfg.requests)
        slo = parse_slo(seg.slo, cfg.slo_scale)
        for rung, rate in enumerate(_rates(cfg, seg)):
          seed = run_seed(cfg.seed, rep, rung)
          for c in order:
            out = os.path.join(cfg.out_dir, c.label, "load", seg.name, f"rate_{rate:g}",
                               f"repeat_{rep}")
            run_ = load.run_segment(servers[c.label].target, seg, rate, seed, slo, out)
            runs[c.label].setdefault(seg.name, {})[(rep, rate)] = run_
    probe = GateClient(servers[configs[0].label].target, servers[configs[0].label].http)
    max_context = probe.max_context
    probe.close()
    passages = read_passages(cfg.passages)[:cfg.max_passages] if cfg.passages else []
    sinks = (cfg.sinks_window, max_context + 64) if cfg.sinks_window else (0, 0)
    items = gate_sets.build(cfg.gates, passages, _long_lengths(cfg, max_context), cfg.seed,
                            sinks)
    # Each server answers its items one at a time; the servers answer side by side.
    with concurrent.futures.ThreadPoolExecutor(len(configs)) as pool:
      futs = {c.label: pool.submit(_answers, servers[c.label], items, cfg) for c in configs}
      answers = {label: f.result() for label, f in futs.items()}
  finally:
    for s in servers.values():
      s.stop()
  rng = np.random.default_rng(cfg.seed)
  cores = os.cpu_count() or 1
  base = cfg.baseline.label
  comparisons = []
  for c in cfg.candidates:
    segs = {seg.name: perf.compare_segment(runs[base][seg.name], runs[c.label][seg.name], rng,
                                           cfg.n_boot, cfg.min_effect, cores)
            for seg in cfg.segments}
    gates = {}
    for g in cfg.gates:
      idx = [i for i, it in enumerate(items) if it.gate == g]
      gates[g] = gate_compare.compare_gate(g, [items[i] for i in idx],
                                           [answers[base][i] for i in idx],
                                           [answers[c.label][i] for i in idx], rng, cfg.n_boot,
                                           cfg.thresholds)
    comparisons.append({"baseline": base, "candidate": c.label, "segments": segs,
                        "gates": gates})
  result = {
      "model": cfg.model, "started": started, "seconds": round(time.monotonic() - t0, 1),
      "machine": machine.describe(), "command": cfg.command,
      "configs": {c.label: list(c.flags) for c in configs},
      "common_flags": list(cfg.common_flags),
      "segments": {seg.name: {**dataclasses.asdict(seg), "rates_per_s": list(_rates(cfg, seg)),
                              "slo": dataclasses.asdict(parse_slo(seg.slo, cfg.slo_scale))}
                   for seg in cfg.segments},
      "repeats": cfg.repeats, "slo_scale": cfg.slo_scale, "min_effect": cfg.min_effect,
      "thresholds": dataclasses.asdict(cfg.thresholds), "comparisons": comparisons,
      "answers": {c.label: [{"item": it.name, "gate": it.gate, "status": a.status,
                             "text": a.text[:400]} for it, a in zip(items, answers[c.label])]
                  for c in configs},
  }
  verdict.write(cfg.out_dir, result)
  return result
