"""Soak: one phaseserve server under long, mixed traffic, and whether it stayed healthy.

  python -m launch.lab.soak --model smollm2-135m --out results/soak -- --quantize int8
  python -m launch.lab.soak --model tiny --duration_s 100 --idle_s 8 --idle_every_s 50 \
      --long_tokens 3000 --steady_steps 2000 --out /tmp/soak -- --max_context 128

Starts ``python -m launch.server --model MODEL [--attention_sinks] ARGS --port 0 --port_file F
--http_port 0 --metrics_port 0`` (ARGS: whatever follows ``--``; see
``launch.lab.soak_lib.server_proc``), waits for readiness, drives it for ``--duration_s`` of traffic
(plus the drains below), stops it with SIGTERM, prints one JSON report and exits 1 if an assertion
failed (2: bad flags or a server that never became ready). ``--out DIR`` receives ``report.json``,
``samples.csv`` (one row per sample), ``requests.csv`` (one row per request) and ``server.log``
(without ``--out``, a fresh temporary directory, named in the report).

Timeline: ``round(duration_s / idle_every_s)`` (at least 1) cycles of [active stretch, drain,
quiet probe, idle gap of ``--idle_s``, post-idle probe]. In an active stretch, all at once:

* Poisson arrivals at ``--qps`` (default: ``QPS_DEFAULTS`` for the model, else 1) cycling
  through every request variant (``launch.lab.soak_lib.senders``): OpenAI ``/v1/completions`` and
  ``/v1/chat/completions`` (streaming and not; n=3 at temperature 1 with a seed; logprobs 0 and
  5 / ``logprobs: true, top_logprobs: 3``; stop strings; greedy and top_k/top_p; a long prefix
  shared by every such request, for prefix-cache hits; a client that closes the stream after 3
  chunks; a slow reader sleeping ``--slow_read_s`` between reads; ``response_format:
  json_object``; penalties, ``logit_bias`` and ``min_p``), phaseserve gRPC ``Generate``
  (the same kinds) and JetStream ``Decode``. The plain greedy requests go through the load
  generator's drivers (``launch.lab.loadgen_lib.drivers``), the others through the same drivers'
  HTTP session and gRPC stub.
* One long generation, started with the first stretch: a streaming completion of
  ``--long_tokens`` with ``ignore_eos`` and ``"attention_sinks": {"window": --sink_window}`` (the
  server gets ``--attention_sinks``; its KV is a ring, so the length is not bounded by the
  context). The first drain waits for it, so it ends alone.
* A steady batch: ``--steady_rows`` lanes, each a greedy ``ignore_eos`` gRPC generation of
  ``max_context - 8`` tokens, restarted as it finishes; its decode steps are the fewest tokens
  any lane generated over the run (each token is one step of a batch holding every lane).
* Bursts: every ``--burst_every_s`` of active time (the first at half that), ``--burst_factor``
  times the qps for ``--burst_s``. Refusals (HTTP 429 / RESOURCE_EXHAUSTED before any token)
  of requests sent in a burst or the ``--burst_grace_s`` after it are expected.

A drain stops every sender and waits (up to ``--drain_timeout_s``) until nothing is in flight;
the quiet probe is then one HTTP chat and one gRPC request, alone; then nothing is sent for
``--idle_s``; at the gap's end the KV gauges are read and the post-idle probe (the same two
requests) goes first. Every ``--sample_s`` from outside: the server's RSS, open fds and
mappings (``/proc/PID``), the Prometheus series of ``launch.lab.soak_lib.server_proc.SERIES``
and the health of ``GET /health``, ``GET /ready`` and gRPC health (liveness and readiness).

Assertions (``report["assertions"][name]["pass"]``, with the numbers behind each):

* ``no_request_errors``: no request ended in anything but ok, a refusal, or its own client's
  cancellation (no 5xx, INTERNAL, UNAVAILABLE, stream error, truncated stream, a 4xx other than
  429, RESOURCE_EXHAUSTED after tokens (a slow consumer), or a malformed answer: n choices each
  with a stop/length finish, logprobs where asked).
* ``health_serving``: the server lived to the end, every poll of ``/health`` and ``/ready`` was
  200 and both gRPC health services SERVING, and ``phaseserve_loop_failures_total`` stayed 0.
* ``no_engine_faults``: ``phaseserve_engine_faults`` and ``phaseserve_internal_errors_total``
  did not grow after readiness.
* ``no_refusal_while_idle``: no probe (sent alone into an idle server) was refused.
* ``few_refusals_outside_bursts``: outside bursts at most ``--max_refused_frac`` (default 5%)
  of the requests were refused: at a qps below capacity the early-rejection predictor should
  refuse almost nothing; a predictor that locks up refuses nearly everything.
* ``programs_constant``: the server's program count (``phaseserve_programs_loaded``, or
  ``phaseserve_compiled_programs``) at the end equals its value at readiness, and
  ``phaseserve_programs_after_ready`` (where exported) is 0 (skipped without a count).
* ``rss_flat``, ``fds_flat``, ``maps_flat``, ``threads_flat``: the least-squares slope over the
  second half of the samples (readiness to the last sample) is below ``--max_rss_pct_per_10min``
  (default 1% of the mean RSS per 10 minutes: a leak that would add 144% a day; allocator noise
  averages out over a 15-minute half of the default run), ``--max_fds_per_min`` (1),
  ``--max_maps_per_min`` (1) and ``--max_threads_per_min`` (1): a handle leaked per request, or
  an XLA program compiled after readiness (each adds mappings), grows faster than that at any
  qps worth soaking; connections open during a burst close within the client's 15 s
  keep-alive. Mappings are counted net of the threads' own (3 a thread: stack, guard page,
  malloc arena), so a thread pool that grows to a new peak in a burst (bounded, and idle
  threads end after 60 s) is judged by ``threads_flat``, and a mapping leak by ``maps_flat``;
  the raw mapping count is reported. Short runs need looser bounds (the test's flags).
* ``kv_pages_released``: at the end of every idle gap no KV page is used by a sequence, none
  runs and none waits. ``phaseserve_kv_pages_used`` counts pages a sequence holds; pages only
  the prefix cache holds are ``phaseserve_kv_pages_cached`` (reported, not asserted).
* ``drains_completed``: every drain emptied within ``--drain_timeout_s``.
* ``long_generation_complete``: the long stream ended ok with >= ``--long_tokens`` tokens.
* ``steady_steps_reached``: the steady batch ran >= ``--steady_steps`` decode steps.
* ``every_kind_ran``: each variant, the long generation, the steady lanes and the probes ran
  (at least one ok or client-cancelled request each).
* ``server_exit_clean``: SIGTERM at the end stopped the server with exit code 0.

The report: duration, requests by API / kind / status, errors (by status, the first examples),
refusals (in bursts / outside / while idle), programs at ready / end, the RSS / fd / mapping
slopes (and the thread count's, not asserted: each thread stack is two mappings), KV gauges
per idle gap, TTFT / TPOT p50 / p99 of the ordinary streaming requests (client clock; TPOT for
n = 1), the long generation, the steady batch, prefix-cache hits, and the server log's ERROR
lines.

Modules: ``launch.lab.soak_lib.traffic`` (the timeline and the scheduling of every request),
``launch.lab.soak_lib.senders`` (the clients, the prompts, the variants, the check of each answer),
``launch.lab.soak_lib.report`` (one record per request, the analysis and its assertions),
``launch.lab.soak_lib.server_proc`` (the server process, the sampler, slopes and files).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time

from absl import flags

from launch import cli
from launch.cli import CliError
from launch.lab.soak_lib.report import REC_COLUMNS, analyze
from launch.lab.soak_lib.traffic import plan, run_traffic

# Near capacity beside the steady batch and the long stream, on the 2-core development CPU
# (smollm2-135m int8: 0.6 ordinary requests/s served at --qps 2, half refused; tiny: none refused
# at 4, bursts of 12 included). Elsewhere measure it: launch.lab.loadgen --find_capacity.
QPS_DEFAULTS = {"tiny": 4.0, "smollm2-135m": 0.5}

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "launch.server's --model")
_DURATION = flags.DEFINE_float("duration_s", 1800.0, "active traffic + idle gaps (drains extend "
                               "it)", lower_bound=1.0)
_QPS = flags.DEFINE_float("qps", None, "ordinary Poisson arrivals per second (default: near "
                          "capacity for the model, QPS_DEFAULTS, else 1)", lower_bound=1e-3)
_IDLE = flags.DEFINE_float("idle_s", 30.0, "length of each idle gap", lower_bound=0.0)
_IDLE_EVERY = flags.DEFINE_float("idle_every_s", 300.0, "one idle gap per this much of "
                                 "--duration_s", lower_bound=1.0)
_LONG_TOKENS = flags.DEFINE_integer("long_tokens", 10000, "the long generation's tokens",
                                    lower_bound=1)
_SINK_WINDOW = flags.DEFINE_integer("sink_window", 64, "the long generation's attention-sink "
                                    "window (0: no sinks; then it must fit the context)",
                                    lower_bound=0)
_STEADY_STEPS = flags.DEFINE_integer("steady_steps", 10000, "decode steps of the steady batch",
                                     lower_bound=0)
_STEADY_ROWS = flags.DEFINE_integer("steady_rows", 8, "generations in the steady batch",
                                    lower_bound=0)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "max_tokens of an ordinary request",
                                   lower_bound=4)
_PREFIX_TOKENS = flags.DEFINE_integer("prefix_tokens", 512, "the shared prefix (at most half of "
                                      "what the context leaves)", lower_bound=1)
_BURST_EVERY = flags.DEFINE_float("burst_every_s", 240.0, "a burst per this much active time",
                                  lower_bound=1.0)
_BURST_S = flags.DEFINE_float("burst_s", 10.0, "length of a burst", lower_bound=0.0)
_BURST_FACTOR = flags.DEFINE_float("burst_factor", 3.0, "qps multiplier in a burst",
                                   lower_bound=1.0)
_BURST_GRACE = flags.DEFINE_float("burst_grace_s", 20.0, "refusals this long after a burst "
                                  "still count as the burst's", lower_bound=0.0)
_SLOW_READ = flags.DEFINE_float("slow_read_s", 0.1, "the slow reader's sleep between reads",
                                lower_bound=0.0)
_SAMPLE = flags.DEFINE_float("sample_s", 2.0, "sampling period", lower_bound=0.1)
_SEED = flags.DEFINE_integer("seed", 0, "arrivals, prompts and sampling seeds")
_OUT = flags.DEFINE_string("out", None, "report.json, samples.csv, requests.csv, server.log "
                           "(default: a new temporary directory)")
_READY = flags.DEFINE_float("ready_timeout_s", 1800.0, "start-up bound", lower_bound=1.0)
_REQ_TIMEOUT = flags.DEFINE_float("request_timeout_s", 600.0, "deadline of one ordinary request",
                                  lower_bound=1.0)
_DRAIN_TIMEOUT = flags.DEFINE_float("drain_timeout_s", 1800.0, "a drain's bound",
                                    lower_bound=1.0)
_GRACE = flags.DEFINE_float("stop_grace_s", 30.0, "SIGTERM at the end: how long to wait "
                            "before SIGKILL", lower_bound=0.0)
_RSS_PCT = flags.DEFINE_float("max_rss_pct_per_10min", 1.0, "rss_flat's bound", lower_bound=0.0)
_FDS = flags.DEFINE_float("max_fds_per_min", 1.0, "fds_flat's bound", lower_bound=0.0)
_MAPS = flags.DEFINE_float("max_maps_per_min", 1.0, "maps_flat's bound", lower_bound=0.0)
_THREADS = flags.DEFINE_float("max_threads_per_min", 1.0, "threads_flat's bound",
                              lower_bound=0.0)
_REFUSED_FRAC = flags.DEFINE_float("max_refused_frac", 0.05, "few_refusals_outside_bursts' "
                                   "bound", lower_bound=0.0)


def _config() -> dict:
  qps = _QPS.value if _QPS.value is not None else QPS_DEFAULTS.get(_MODEL.value, 1.0)
  return {"model": _MODEL.value, "duration_s": _DURATION.value, "qps": qps,
          "idle_s": _IDLE.value, "idle_every_s": _IDLE_EVERY.value,
          "long_tokens": _LONG_TOKENS.value, "sink_window": _SINK_WINDOW.value,
          "steady_steps": _STEADY_STEPS.value, "steady_rows": _STEADY_ROWS.value,
          "max_tokens": _MAX_TOKENS.value, "prefix_tokens": _PREFIX_TOKENS.value,
          "burst_every_s": _BURST_EVERY.value, "burst_s": _BURST_S.value,
          "burst_factor": _BURST_FACTOR.value, "burst_grace_s": _BURST_GRACE.value,
          "slow_read_s": _SLOW_READ.value, "sample_s": _SAMPLE.value, "seed": _SEED.value,
          "request_timeout_s": _REQ_TIMEOUT.value, "drain_timeout_s": _DRAIN_TIMEOUT.value,
          "max_rss_pct_per_10min": _RSS_PCT.value, "max_fds_per_min": _FDS.value,
          "max_maps_per_min": _MAPS.value,
          "max_threads_per_min": _THREADS.value, "max_refused_frac": _REFUSED_FRAC.value}


def _server_info(server) -> tuple[str, int, int]:
  import urllib.request
  from launch.lab.loadgen_lib import drivers
  info = drivers.server_info(drivers.DriverConfig("phaseserve", server.target))
  if info is None:
    raise CliError("the server answers no ServerInfo")
  with urllib.request.urlopen(server.http + "/v1/models", timeout=30) as r:
    model = json.loads(r.read())["data"][0]["id"]
  return model, info[0], info[1]


def main(argv: list[str]) -> None:
  from launch.lab.soak_lib import server_proc
  server_args = list(argv[1:])  # everything after "--"
  cfg = _config()
  plan(cfg["duration_s"], cfg["idle_s"], cfg["idle_every_s"])  # bad timing: exit 2 now
  out = _OUT.value or tempfile.mkdtemp(prefix="phaseserve-soak-")
  os.makedirs(out, exist_ok=True)
  argv_server = ["--model", _MODEL.value] + (["--attention_sinks"] if _SINK_WINDOW.value else []) \
      + server_args

  def on_term(signum, frame):  # SIGTERM: unwind like Ctrl-C, so the server is reaped
    raise KeyboardInterrupt
  signal.signal(signal.SIGTERM, on_term)
  t_start = time.monotonic()
  try:
    server = server_proc.ServerProc.start(out, argv_server, _READY.value)
  except RuntimeError as e:
    raise CliError(f"{e} (log: {os.path.join(out, 'server.log')})") from None
  t_ready = time.monotonic()
  tr, why, exit_code, end_row = None, "", None, None
  gaps: list[dict] = []
  sampler = server_proc.Sampler(server, lambda: "ready", cfg["sample_s"], t0=t_ready)
  try:
    info = _server_info(server)
    if not cfg["sink_window"] and cfg["long_tokens"] + 16 > info[2]:
      raise CliError(f"--long_tokens {cfg['long_tokens']} does not fit the context ({info[2]}) "
                     "without attention sinks (--sink_window)")
    ready_row = sampler.sample("ready")
    sampler.start()
    tr, why = asyncio.run(run_traffic(server, sampler, cfg, info, t_ready, gaps))
    sampler.stop()
    if server.proc.poll() is None:
      end_row = sampler.sample("end")
  finally:
    sampler.stop()
    sampler.phase_fn = lambda: "stopping"
    exit_code = server.stop(_GRACE.value)
  wall = time.monotonic() - t_start
  samples = sampler.snapshot()
  recs = tr.records if tr is not None else []
  kinds = [(api, kind) for api, kind, *_ in tr.variants] if tr is not None else []
  report = analyze(cfg, recs, samples, gaps, tr.drains if tr else [],
                   tr.lane_tokens if tr else [], tr.lane_generations if tr else [], ready_row,
                   end_row, why, exit_code, kinds,
                   server_proc.log_problems(os.path.join(out, "server.log")),
                   len(tr.bursting) if tr else 0)
  report = {"ok": report.pop("ok"), "failed": report.pop("failed"),
            "wall_s": round(wall, 1), "startup_s": round(t_ready - t_start, 1),
            "traffic_s": round(samples[-1]["t_s"], 1) if samples else None,
            "config": cfg, "server": {"argv": server.argv[1:], "pid": server.pid,
                                      "exit_code": exit_code},
            "out": out, **report}
  server_proc.write_csv(os.path.join(out, "samples.csv"), server_proc.SAMPLE_COLUMNS, samples)
  server_proc.write_csv(os.path.join(out, "requests.csv"), REC_COLUMNS,
                     [dataclasses.asdict(r) for r in recs])
  with open(os.path.join(out, "report.json.tmp"), "w") as f:
    json.dump(report, f, indent=2, default=str)
  os.replace(os.path.join(out, "report.json.tmp"), os.path.join(out, "report.json"))
  print(json.dumps(report, default=str))
  sys.stdout.flush()
  if not report["ok"]:
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
