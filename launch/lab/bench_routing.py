"""Routing policies of the gateway in front of replicas, on one prefix-heavy open-loop trace.

  python -m launch.lab.bench_routing --model smollm2-135m --json
  python -m launch.lab.bench_routing --model tiny --sessions 6 --rate 4 --repeats 1 --json

For each repeat, and each of ``--policies`` in turn (order reversed every other repeat), the
benchmark starts ``--replicas`` fresh servers behind the gateway with that policy
(``launch.replica_set``: each replica pinned to its share of the CPUs, so no run inherits another's
prefix cache) and drives them with the load generator's ``--profile`` (default ``multi_turn``:
sessions of 2-4 turns, each turn's prompt the previous turn's prompt and answer plus new words,
a tool pause between turns; streamed ``/v1/completions``, open-loop Poisson arrivals at
``--rate`` sessions/s, the same ``--seed`` in every run), then stops them. Per run: TTFT and
TPOT p50 / p90 / p99 (seconds), requests ok / failed, and per replica the requests it ended and
the prompt tokens its prefix cache served. Per policy: the means over repeats of TTFT p50 and p99
and of the prefix-cache tokens; and each policy's TTFT p50 / p99 over the first policy's, paired
repeat by repeat. ``--json`` prints one object; the load generator's own files go under
``--out``. Bad flags exit 2.
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

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "each replica's --model")
_REPLICAS = flags.DEFINE_integer("replicas", 2, "server processes", lower_bound=1)
_POLICIES = flags.DEFINE_list("policies", ["cache_aware", "round_robin"], "gateway policies")
_REPEATS = flags.DEFINE_integer("repeats", 2, "runs per policy", lower_bound=1)
_PROFILE = flags.DEFINE_string("profile", "multi_turn", "the load generator's profile")
_RATE = flags.DEFINE_float("rate", 0.5, "sessions per second", lower_bound=1e-3)
_SESSIONS = flags.DEFINE_integer("sessions", 40, "sessions per run", lower_bound=1)
_LENGTH = flags.DEFINE_float("length_scale", 1.0, "the profile's lengths x this", lower_bound=0.01)
_MAX_CONTEXT = flags.DEFINE_integer("max_context", 2048, "prompts and turns clipped to this "
                                    "(the replicas' context)", lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "arrivals, lengths and words")
_SERVER_FLAGS = flags.DEFINE_multi_string("server_flag", [], "an extra launch.server flag")
_OUT = flags.DEFINE_string("out", "", "the runs' files (default: a temp directory)")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object")


def _replica_stats(url: str) -> dict:
  text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
  def total(pattern: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))
  return {"ok": total(r'^phaseserve_requests_total\{[^}]*status="ok"[^}]*\} (\S+)$'),
          "prefix_hit_tokens": total(r"^phaseserve_prefix_cache_hit_tokens_total (\S+)$")}


def _one_run(policy: str, repeat: int, out: str) -> dict:
  from launch.lab.loadgen_lib import app, drivers, workload
  from launch.lab.loadgen_lib.arrivals import Arrivals
  from launch.replica_set import ReplicaSet, Spec
  run_dir = os.path.join(out, f"{policy}_{repeat}")
  server_args = ("--model", _MODEL.value, *_SERVER_FLAGS.value)
  rs = ReplicaSet(Spec(_REPLICAS.value, server_args, os.path.join(run_dir, "servers"),
                       policy=policy, health_interval_s=2))
  rs.start()
  try:
    cfg = app.LoadgenConfig(
        driver=drivers.DriverConfig(api="openai", target=rs.url, model=rs.model_id()),
        out_dir=run_dir, arrivals=Arrivals(rate_per_s=_RATE.value),
        workload=workload.WorkloadConfig(profile=_PROFILE.value, length_scale=_LENGTH.value,
                                         max_context=_MAX_CONTEXT.value),
        num_requests=_SESSIONS.value, seed=_SEED.value, progress=False)
    summary = app.run(cfg)
    replicas = [_replica_stats(r.url) for r in rs.replicas]
  finally:
    rs.stop()
  pick = lambda m: {q: summary[m].get(q) for q in ("p50", "p90", "p99")}
  return {"policy": policy, "repeat": repeat, "sent": summary["sent"], "ok": summary["ok"],
          "failed": summary["errors"] + summary["rejected"] + summary["turns_not_sent"],
          "ttft_s": pick("ttft_s"), "tpot_s": pick("tpot_s"), "replicas": replicas,
          "prefix_hit_tokens": sum(r["prefix_hit_tokens"] for r in replicas)}


def _summary(runs: list[dict], policies: list[str]) -> dict:
  by = {p: [r for r in runs if r["policy"] == p] for p in policies}
  mean = lambda xs: statistics.fmean(xs) if xs else None
  out: dict = {p: {"ttft_p50_s": mean([r["ttft_s"]["p50"] for r in rs]),
                   "ttft_p99_s": mean([r["ttft_s"]["p99"] for r in rs]),
                   "tpot_p50_s": mean([r["tpot_s"]["p50"] for r in rs]),
                   "prefix_hit_tokens": mean([r["prefix_hit_tokens"] for r in rs]),
                   "failed": sum(r["failed"] for r in rs)} for p, rs in by.items()}
  base = policies[0]
  for p in policies[1:]:
    pairs = list(zip(by[base], by[p]))
    for q in ("p50", "p99"):
      out[p][f"ttft_{q}_over_{base}"] = [round(b["ttft_s"][q] / a["ttft_s"][q], 3)
                                         for a, b in pairs]
  return out


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  from launch.lab.loadgen_lib import workload
  from launch.replica_set import POLICIES
  policies = _POLICIES.value
  bad = [p for p in policies if p not in POLICIES]
  if bad or not policies:
    raise CliError(f"--policies: unknown {bad}; choose from {list(POLICIES)}")
  if _PROFILE.value not in workload.PROFILES:
    raise CliError(f"--profile: unknown {_PROFILE.value!r}; one of {sorted(workload.PROFILES)}")
  out = _OUT.value or tempfile.mkdtemp(prefix="phaseserve-routing-")
  runs = []
  started = datetime.datetime.now(datetime.timezone.utc)
  for repeat in range(_REPEATS.value):
    for policy in (policies if repeat % 2 == 0 else policies[::-1]):
      try:
        runs.append(_one_run(policy, repeat, out))
      except (RuntimeError, TimeoutError) as e:
        raise CliError(f"{policy} run {repeat}: {e}") from None
  result: dict = {"command": "python -m launch.lab.bench_routing " + " ".join(sys.argv[1:]),
            "started_utc": started.isoformat(timespec="seconds"), "cpu": machine.cpu_model(),
            "cpu_count": os.cpu_count(), "out": out, "policies": _summary(runs, policies),
            "runs": runs}
  if _JSON.value:
    print(json.dumps(result))
  else:
    for p, s in result["policies"].items():
      print(p, json.dumps(s))


if __name__ == "__main__":
  cli.run(main)
