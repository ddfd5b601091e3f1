"""Deployments behind the gateway on one open-loop trace: routing policies, one server against
prefill and decode in separate processes.

  python -m launch.lab.bench_routing --model smollm2-135m --json
  python -m launch.lab.bench_routing --setups single,pd --profile interactive --rates 1,2,3 --json
  python -m launch.lab.bench_routing --model tiny --sessions 6 --rate 4 --repeats 1 --json

A setup is a gateway policy (``cache_aware``, ``round_robin``, ...: ``--replicas`` servers,
each pinned to its share of the CPUs), ``single`` (one server on every CPU behind the gateway)
or ``pd`` (a prefill server and a decode server, ``launch.server --kv_role``, pinned to one
share each, behind the gateway's prefill / decode mode). For each repeat, each rate of
``--rates`` and each of ``--setups`` in turn (order reversed every other repeat) the benchmark
starts fresh servers (``launch.replica_set``: no run inherits another's prefix cache), drives
them with the load generator's ``--profile`` (default ``multi_turn``: sessions of 2-4 turns,
each turn's prompt the previous turn's prompt and answer plus new words, a tool pause between
turns; streamed ``/v1/completions``, open-loop Poisson arrivals, the same ``--seed`` in every
run), then stops them. Per run: TTFT and TPOT p50 / p90 / p99 (seconds), requests ok / failed,
whether the p99s meet the profile's SLO x ``--slo_scale``, and per server the requests it ended
and the prompt tokens its prefix cache served. Per setup: the means over repeats of TTFT p50 /
p99, TPOT p99 and prefix-cache tokens at each rate, the capacity (the highest rate whose every
repeat met the SLO), and each setup's TTFT p50 / p99 over the first setup's, paired run by run.
``--json`` prints one object; the load generator's files go under ``--out``. Bad flags exit 2.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import urllib.request

from absl import flags

from launch import cli, machine
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "each server's --model")
_REPLICAS = flags.DEFINE_integer("replicas", 2, "servers of a policy setup", lower_bound=1)
_SETUPS = flags.DEFINE_list("setups", ["cache_aware", "round_robin"],
                            "gateway policies, single or pd")
_REPEATS = flags.DEFINE_integer("repeats", 2, "runs per setup and rate", lower_bound=1)
_PROFILE = flags.DEFINE_string("profile", "multi_turn", "the load generator's profile")
_RATES = flags.DEFINE_list("rates", ["0.5"], "sessions per second, one run each")
_SESSIONS = flags.DEFINE_integer("sessions", 40, "sessions per run", lower_bound=1)
_LENGTH = flags.DEFINE_float("length_scale", 1.0, "the profile's lengths x this", lower_bound=0.01)
_MAX_CONTEXT = flags.DEFINE_integer("max_context", 2048, "prompts and turns clipped to this "
                                    "(the servers' context)", lower_bound=0)
_SLO_SCALE = flags.DEFINE_float("slo_scale", 2.0, "the profile's SLO x this (a CPU's factor)",
                                lower_bound=0.01)
_SEED = flags.DEFINE_integer("seed", 0, "arrivals, lengths and words")
_SERVER_FLAGS = flags.DEFINE_multi_string("server_flag", [], "an extra launch.server flag")
_OUT = flags.DEFINE_string("out", "", "the runs' files (default: a temp directory)")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object")


def _server_stats(url: str) -> dict:
  text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
  def total(pattern: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))
  return {"ok": total(r'^phaseserve_requests_total\{[^}]*status="ok"[^}]*\} (\S+)$'),
          "prefix_hit_tokens": total(r"^phaseserve_prefix_cache_hit_tokens_total (\S+)$")}


def _spec(setup: str, workdir: str):
  from launch.replica_set import Spec
  args = ("--model", _MODEL.value, *_SERVER_FLAGS.value)
  if setup == "single":
    return Spec(1, args, workdir, policy="round_robin", pin=False, health_interval_s=2,
                gateway_grace_s=1)
  if setup == "pd":
    return Spec(2, args, workdir, policy="round_robin", health_interval_s=2, gateway_grace_s=1,
                roles=("prefill", "decode"))
  return Spec(_REPLICAS.value, args, workdir, policy=setup, health_interval_s=2,
              gateway_grace_s=1)


def _one_run(setup: str, rate: float, repeat: int, out: str) -> dict:
  from launch.lab.loadgen_lib import app, drivers, workload
  from launch.lab.loadgen_lib.arrivals import Arrivals
  from launch.replica_set import ReplicaSet
  run_dir = os.path.join(out, f"{setup}_r{rate:g}_{repeat}")
  rs = ReplicaSet(_spec(setup, os.path.join(run_dir, "servers")))
  rs.start()
  try:
    cfg = app.LoadgenConfig(
        driver=drivers.DriverConfig(api="openai", target=rs.url, model=rs.model_id()),
        out_dir=run_dir, arrivals=Arrivals(rate_per_s=rate),
        workload=workload.WorkloadConfig(profile=_PROFILE.value, length_scale=_LENGTH.value,
                                         max_context=_MAX_CONTEXT.value),
        num_requests=_SESSIONS.value, seed=_SEED.value, slo_scale=_SLO_SCALE.value,
        progress=False)
    summary = app.run(cfg)
    servers = [_server_stats(r.url) for r in rs.replicas]
  finally:
    rs.stop()
  pick = lambda m: {q: summary[m].get(q) for q in ("p50", "p90", "p99")}
  return {"setup": setup, "rate": rate, "repeat": repeat, "sent": summary["sent"],
          "ok": summary["ok"],
          "failed": summary["errors"] + summary["rejected"] + summary["turns_not_sent"],
          "meets_slo_p99": summary["meets_slo_p99"], "slo": summary["slo"],
          "ttft_s": pick("ttft_s"), "tpot_s": pick("tpot_s"), "servers": servers,
          "prefix_hit_tokens": sum(r["prefix_hit_tokens"] for r in servers)}


def _summary(runs: list[dict], setups: list[str], rates: list[float]) -> dict:
  mean = lambda xs: statistics.fmean(xs) if xs else None
  out: dict = {}
  for s in setups:
    mine = [r for r in runs if r["setup"] == s]
    at = {}
    for rate in rates:
      rs = [r for r in mine if r["rate"] == rate]
      at[f"{rate:g}"] = {"ttft_p50_s": mean([r["ttft_s"]["p50"] for r in rs]),
                         "ttft_p99_s": mean([r["ttft_s"]["p99"] for r in rs]),
                         "tpot_p99_s": mean([r["tpot_s"]["p99"] for r in rs]),
                         "prefix_hit_tokens": mean([r["prefix_hit_tokens"] for r in rs]),
                         "meets_slo_p99": all(r["meets_slo_p99"] for r in rs)}
    good = [rate for rate in rates if at[f"{rate:g}"]["meets_slo_p99"]]
    out[s] = {"by_rate": at, "capacity_per_s": max(good) if good else None,
              "failed": sum(r["failed"] for r in mine)}
  base = setups[0]
  for s in setups[1:]:
    pairs = [(a, b) for a in runs if a["setup"] == base for b in runs
             if b["setup"] == s and (b["rate"], b["repeat"]) == (a["rate"], a["repeat"])]
    for q in ("p50", "p99"):
      out[s][f"ttft_{q}_over_{base}"] = [round(b["ttft_s"][q] / a["ttft_s"][q], 3)
                                         for a, b in pairs]
  return out


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  from launch.lab.loadgen_lib import workload
  from launch.replica_set import POLICIES
  setups = _SETUPS.value
  bad = [s for s in setups if s not in (*POLICIES, "single", "pd")]
  if bad or not setups:
    raise CliError(f"--setups: unknown {bad}; choose from {[*POLICIES, 'single', 'pd']}")
  try:
    rates = [float(r) for r in _RATES.value]
  except ValueError:
    raise CliError(f"--rates: numbers, got {_RATES.value}") from None
  if not rates or min(rates) <= 0:
    raise CliError("--rates: at least one rate, each > 0")
  if _PROFILE.value not in workload.PROFILES:
    raise CliError(f"--profile: unknown {_PROFILE.value!r}; one of {sorted(workload.PROFILES)}")
  out = _OUT.value or tempfile.mkdtemp(prefix="phaseserve-routing-")
  runs = []
  started = datetime.datetime.now(datetime.timezone.utc)
  for repeat in range(_REPEATS.value):
    for rate in rates:
      for setup in (setups if repeat % 2 == 0 else setups[::-1]):
        try:
          runs.append(_one_run(setup, rate, repeat, out))
        except (RuntimeError, TimeoutError) as e:
          raise CliError(f"{setup} at {rate:g}/s, run {repeat}: {e}") from None
  result: dict = {"command": "python -m launch.lab.bench_routing " + " ".join(sys.argv[1:]),
                  "started_utc": started.isoformat(timespec="seconds"),
                  "cpu": machine.cpu_model(), "cpu_count": os.cpu_count(), "out": out,
                  "setups": _summary(runs, setups, rates), "runs": runs}
  if _JSON.value:
    print(json.dumps(result))
  else:
    for s, summary in result["setups"].items():
      print(s, json.dumps(summary))


if __name__ == "__main__":
  cli.run(main)
