"""A canary behind the gateway: a candidate configuration takes a share of live traffic, and a
breach of the thresholds takes it out of rotation.

  python -m launch.canary --candidate="--quantize int8" --port 8000 -- --model smollm2-135m

starts ``--baseline_replicas`` servers with the flags after ``--`` and ``--candidate_replicas``
with those flags plus ``--candidate``, behind the gateway (``launch.replica_set``; ``--policy
round_robin`` by default, so the candidate's share of requests is its share of the replicas: 1
of 2 here, 1 of 10 for a 10% canary). Clients use ``http://HOST:PORT/v1`` as with
``launch.replicas``. Every ``--window_s`` the canary reads the requests each replica ended
(each replica's ``--usage_log``, one JSON line a request) and compares the candidate's with the
baseline's over the last ``--horizon_s`` (``launch.canary_judge``): TTFT and TPOT at
``--quantile`` (0.9), error and refusal rates, once both have the requests the quantile needs
(``--min_requests``, by default 5 / (1 - quantile): 50 for p90). After ``--breach_windows``
windows in a row in breach it removes the candidate from the gateway (no new request goes to
it; what it runs finishes) and stops it; the baseline serves on. One JSON line per event on
stdout: ``ready``, ``window`` (both groups' figures and the verdict), ``removed`` (the reasons),
``summary`` (the whole run). Runs until SIGINT / SIGTERM or ``--duration_s``; exit 0 when the
candidate held, 1 when it was removed, 2 on bad flags or a replica that does not come up.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shlex
import signal
import tempfile
import threading
import time

from absl import flags

from launch import cli
from launch.canary_judge import GroupStats, Thresholds, group_stats, judge
from launch.cli import CliError
from launch.replica_set import POLICIES, ReplicaSet, Spec

_BASE_N = flags.DEFINE_integer("baseline_replicas", 1, "servers with the baseline flags",
                               lower_bound=1)
_CAND_N = flags.DEFINE_integer("candidate_replicas", 1, "servers with the candidate flags",
                               lower_bound=1)
_CANDIDATE = flags.DEFINE_string("candidate", "", "the candidate's flags, added to the baseline's")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "the gateway's address")
_PORT = flags.DEFINE_integer("port", 8000, "the gateway's port (0: a free one)", lower_bound=0)
_POLICY = flags.DEFINE_enum("policy", "round_robin", list(POLICIES), "the gateway's policy")
_WINDOW = flags.DEFINE_float("window_s", 30.0, "how often the groups are compared",
                             lower_bound=0.1)
_BREACHES = flags.DEFINE_integer("breach_windows", 1, "windows in breach in a row before the "
                                 "candidate is removed", lower_bound=1)
_DURATION = flags.DEFINE_float("duration_s", 0.0, "stop after this long (0: at a signal)",
                               lower_bound=0.0)
_HEALTH = flags.DEFINE_integer("health_interval_s", 5, "the gateway's health-check period",
                               lower_bound=1)
_GRACE = flags.DEFINE_integer("gateway_grace_s", 30, "at the end, how long the gateway lets "
                              "requests in flight finish", lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", "", "logs, usage logs (default: a temp directory)")
_READY = flags.DEFINE_float("ready_timeout_s", 900.0, "how long start-up may take")
_T = Thresholds()
_QUANTILE = flags.DEFINE_float("quantile", _T.quantile, "the latency quantile compared",
                               lower_bound=0.5, upper_bound=0.999)
_RATIO = flags.DEFINE_float("max_latency_ratio", _T.max_latency_ratio,
                            "candidate / baseline TTFT or TPOT at --quantile above this breaches",
                            lower_bound=1.0)
_DELTA = flags.DEFINE_float("min_latency_delta_s", _T.min_latency_delta_s,
                            "... and only when the candidate's is this much slower",
                            lower_bound=0.0)
_ERR = flags.DEFINE_float("max_error_rate", _T.max_error_rate,
                          "error rate above the baseline's by more than this breaches",
                          lower_bound=0.0)
_REF = flags.DEFINE_float("max_refusal_rate", _T.max_refusal_rate,
                          "refusal rate above the baseline's by more than this breaches",
                          lower_bound=0.0)
_MIN = flags.DEFINE_integer("min_requests", _T.min_requests, "requests each group needs in the "
                            "horizon before it is judged (0: 5 / (1 - quantile))", lower_bound=0)
_HORIZON = flags.DEFINE_float("horizon_s", 300.0, "each judgement covers the requests that ended "
                              "this long before it", lower_bound=0.1)


class UsageTail:
  """The records appended to a usage log since the last ``read``."""

  def __init__(self, path: str):
    self.path, self.offset = path, 0

  def read(self) -> list[dict]:
    try:
      with open(self.path, "rb") as f:
        f.seek(self.offset)
        data = f.read()
    except FileNotFoundError:
      return []
    end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
    self.offset += end
    return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


def _stats(s: GroupStats) -> dict:
  return dataclasses.asdict(s) | {"error_rate": s.error_rate, "refusal_rate": s.refusal_rate}


def main(argv: list[str]) -> None:
  base_args = tuple(argv[1:])
  if not base_args:
    raise CliError("give the servers' flags after --, e.g. -- --model smollm2-135m")
  cand_args = tuple(shlex.split(_CANDIDATE.value))
  if any(a.split("=", 1)[0] == "--usage_log" for a in base_args + cand_args):
    raise CliError("the canary sets each replica's --usage_log: leave it out")
  th = Thresholds(_QUANTILE.value, _RATIO.value, _DELTA.value, _ERR.value, _REF.value, _MIN.value)
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="phaseserve-canary-")
  n_base, n = _BASE_N.value, _BASE_N.value + _CAND_N.value
  usage = [os.path.join(workdir, f"replica{i}.usage.jsonl") for i in range(n)]
  extra = tuple(("--usage_log", usage[i], *(cand_args if i >= n_base else ())) for i in range(n))
  try:
    rs = ReplicaSet(Spec(n, base_args, workdir, host=_HOST.value, port=_PORT.value,
                         policy=_POLICY.value, health_interval_s=_HEALTH.value,
                         gateway_grace_s=_GRACE.value, extra_args=extra))
    rs.start(_READY.value)
  except (ValueError, RuntimeError, TimeoutError) as e:
    raise CliError(str(e)) from None
  stop = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: stop.set())
  emit = lambda event: print(json.dumps(event), flush=True)
  groups = {"baseline": range(n_base), "candidate": range(n_base, n)}
  tails = [UsageTail(p) for p in usage]
  seen: dict[str, list[dict]] = {g: [] for g in groups}
  recent: dict[str, collections.deque[tuple[float, dict]]] = {g: collections.deque()
                                                              for g in groups}
  emit({"event": "ready", "url": rs.url + "/v1", "policy": _POLICY.value,
        "candidate": list(cand_args), "workdir": workdir,
        "replicas": [{"url": r.url, "role": "candidate" if r.index >= n_base else "baseline"}
                     for r in rs.replicas]})
  removed, in_breach, end = None, 0, time.monotonic() + (_DURATION.value or float("inf"))
  try:
    while not stop.wait(min(_WINDOW.value, max(0.0, end - time.monotonic()))):
      now = time.monotonic()
      for g, idx in groups.items():
        new = [rec for i in idx for rec in tails[i].read()]
        seen[g] += new
        recent[g].extend((now, rec) for rec in new)
        while recent[g] and recent[g][0][0] < now - _HORIZON.value:
          recent[g].popleft()
      base, cand = (group_stats([rec for _, rec in recent[g]], th.quantile) for g in groups)
      verdict = judge(base, cand, th) if removed is None else None
      emit({"event": "window", "baseline": _stats(base), "candidate": _stats(cand),
            "verdict": verdict.state if verdict else "removed",
            "reasons": list(verdict.reasons) if verdict else []})
      if verdict is not None:
        in_breach = in_breach + 1 if verdict.state == "breach" else 0
        if in_breach >= _BREACHES.value:
          for i in groups["candidate"]:
            rs.take_out(i)
          removed = list(verdict.reasons)
          emit({"event": "removed", "reasons": removed})
          for i in groups["candidate"]:
            rs.stop_replica(i)
      if time.monotonic() >= end:
        break
  finally:
    rs.stop()  # the replicas drain: their last requests reach the usage logs
    for g, idx in groups.items():
      seen[g] += [rec for i in idx for rec in tails[i].read()]
    emit({"event": "summary", "outcome": "removed" if removed else "held",
          "reasons": removed or [],
          **{g: _stats(group_stats(seen[g], th.quantile)) for g in groups}})
  raise SystemExit(1 if removed else 0)


if __name__ == "__main__":
  cli.run(main)
