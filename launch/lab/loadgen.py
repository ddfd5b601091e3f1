"""Open-loop load generator for phaseserve, JetStream and any OpenAI-compatible server.

  python -m launch.lab.loadgen --target 127.0.0.1:9000 --api phaseserve --profile interactive \
      --rate 2 --num_requests 200 --out results/loadgen/interactive
  python -m launch.lab.loadgen --target 127.0.0.1:9000 --api phaseserve --find_capacity \
      --rate 0.5 --max_rate 16 --search_steps 3 --out results/loadgen/capacity
  python -m launch.lab.loadgen --target http://127.0.0.1:8000 --api openai --model m --trace t.jsonl

Arrivals follow their schedule whatever is in flight (``--arrivals poisson|gamma|onoff``, mean
``--rate`` requests/s, ``--burstiness`` = the Gamma gaps' coefficient of variation,
``--on_s/--off_s`` for on/off bursts), seeded by ``--seed``; lengths come from ``--profile``
(interactive, long_context, batch, shared_prefix, multi_turn: see
``launch/lab/loadgen_lib/workload.py``) or ``--trace`` (JSONL or CSV: arrival_s, prompt_len,
output_len). Per request: TTFT, TPOT (first token excluded), e2e on this client's clock, and the
server's queue / prefill / TTFT / TPOT from phaseserve's final message. ``--out`` receives
``requests.csv``, ``summary.json`` (p50 / p90 / p99, throughput, goodput = requests meeting both
SLO targets per second, rejections and errors by status) and ``latency.png``; with
``--find_capacity``, one such directory per rate under ``rates/`` (a rerun reuses the finished
ones) and ``capacity.csv``, ``capacity.json``, ``capacity.png``. SLO: ``--slo`` preset
(MLPerf Inference v5.0: interactive 450 ms / 40 ms, server 2 s / 200 ms, long 6 s / 175 ms) or
``TTFT_S:TPOT_S``, times ``--slo_scale``. Prints the summary as one JSON line; exit 2 on bad
flags or an unreachable target, 130 on Ctrl-C (finished rates kept).
"""

from __future__ import annotations

import json
import sys

from absl import flags

from launch import cli
from launch.cli import CliError

_TARGET = flags.DEFINE_string("target", "127.0.0.1:9000", "host:port (openai: or a base URL)")
_API = flags.DEFINE_enum("api", "phaseserve", ["phaseserve", "jetstream", "openai"], "client API")
_MODEL = flags.DEFINE_string("model", "", "openai: the request's model name")
_API_KEY = flags.DEFINE_string("api_key", "", "API key (authorization: Bearer)")
_OUT = flags.DEFINE_string("out", None, "output directory", required=True)
_PROFILE = flags.DEFINE_enum("profile", "interactive", ["interactive", "long_context", "batch",
                                                        "shared_prefix", "multi_turn"],
                             "request-length profile (ignored with --trace)")
_TRACE = flags.DEFINE_string("trace", "", "JSONL or CSV trace: arrival_s, prompt_len, output_len")
_LENGTH_SCALE = flags.DEFINE_float("length_scale", 1.0, "multiplies the profile's lengths",
                                   lower_bound=1e-4)
_TOOL_PAUSE = flags.DEFINE_float("tool_pause_s", None, "multi_turn: mean tool pause between "
                                 "turns (default: the profile's 1 s)", lower_bound=0.0)
_ARRIVALS = flags.DEFINE_enum("arrivals", "poisson", ["poisson", "gamma", "onoff"],
                              "arrival process")
_RATE = flags.DEFINE_float("rate", 1.0, "mean arrivals per second (--find_capacity: the first)",
                           lower_bound=1e-6)
_BURSTINESS = flags.DEFINE_float("burstiness", 2.0, "gamma: coefficient of variation of the "
                                 "gaps (1 = Poisson, > 1 burstier)", lower_bound=1e-3)
_ON_S = flags.DEFINE_float("on_s", 2.0, "onoff: mean ON period (s)", lower_bound=1e-3)
_OFF_S = flags.DEFINE_float("off_s", 2.0, "onoff: mean OFF period (s)", lower_bound=0.0)
_NUM = flags.DEFINE_integer("num_requests", 100, "arrivals per run (0: bounded by --duration_s)",
                            lower_bound=0)
_DURATION = flags.DEFINE_float("duration_s", 0.0, "last arrival at most this late (0: no bound)",
                               lower_bound=0.0)
_SEED = flags.DEFINE_integer("seed", 0, "seed of arrivals, lengths and prompt ids")
_SLO = flags.DEFINE_string("slo", "", "interactive | server | long | TTFT_S:TPOT_S "
                           "(default: the profile's)")
_SLO_SCALE = flags.DEFINE_float("slo_scale", 1.0, "multiplies both SLO targets", lower_bound=1e-6)
_SLO_CLASS = flags.DEFINE_string("request_slo_class", "", "phaseserve: slo_class sent with each "
                                 "request (default: the server's default class)")
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", True, "phaseserve / openai (vLLM extension): "
                                "generate exactly max_tokens")
_VOCAB = flags.DEFINE_integer("vocab_size", 0, "prompt ids below this (0: phaseserve's "
                              "ServerInfo)", lower_bound=0)
_MAX_CONTEXT = flags.DEFINE_integer("max_context", -1, "clip prompt + output to this (0: never; "
                                    "-1: phaseserve's ServerInfo, else never)", lower_bound=-1)
_TIMEOUT = flags.DEFINE_float("timeout_s", 600.0, "deadline of one request", lower_bound=0.01)
_WARMUP = flags.DEFINE_integer("warmup_requests", 2, "unrecorded requests sent first",
                               lower_bound=0)
_FIND = flags.DEFINE_bool("find_capacity", False, "search the highest rate meeting the SLO at "
                          "p99 (resumable: finished rates are reused)")
_MAX_RATE = flags.DEFINE_float("max_rate", 64.0, "--find_capacity: highest rate tried",
                               lower_bound=1e-6)
_STEPS = flags.DEFINE_integer("search_steps", 3, "--find_capacity: bisection steps",
                              lower_bound=0)
_RATES = flags.DEFINE_list("rates", [], "--find_capacity: these rates instead of a search")
_PROGRESS = flags.DEFINE_bool("progress", True, "progress bar on stderr")


def config():
  from launch.lab.loadgen_lib import app, capacity, drivers, workload
  from launch.lab.loadgen_lib.arrivals import Arrivals
  try:
    rates = tuple(float(r) for r in _RATES.value)
  except ValueError:
    raise CliError(f"--rates: numbers, got {_RATES.value}") from None
  if any(r <= 0 for r in rates):
    raise CliError("--rates: every rate must be > 0")
  if not _TRACE.value and not _NUM.value and not _DURATION.value:
    raise CliError("bound the run: --num_requests or --duration_s")
  if _FIND.value and not rates and _RATE.value > _MAX_RATE.value:
    raise CliError(f"--rate {_RATE.value:g} is above --max_rate {_MAX_RATE.value:g}: the capacity "
                   "search starts at --rate and never goes past --max_rate")
  return app.LoadgenConfig(
      driver=drivers.DriverConfig(_API.value, _TARGET.value, _MODEL.value, _API_KEY.value,
                                  _TIMEOUT.value, _IGNORE_EOS.value, _SLO_CLASS.value),
      out_dir=_OUT.value,
      arrivals=Arrivals(_ARRIVALS.value, _RATE.value,
                        _BURSTINESS.value if _ARRIVALS.value == "gamma" else 1.0,
                        _ON_S.value, _OFF_S.value),
      workload=workload.WorkloadConfig(_PROFILE.value, _LENGTH_SCALE.value, _VOCAB.value,
                                       _MAX_CONTEXT.value, _TOOL_PAUSE.value),
      num_requests=_NUM.value, duration_s=_DURATION.value, seed=_SEED.value, slo=_SLO.value,
      slo_scale=_SLO_SCALE.value, trace_path=_TRACE.value, find_capacity=_FIND.value,
      search=capacity.Search(_RATE.value, _MAX_RATE.value, _STEPS.value, rates),
      warmup_requests=_WARMUP.value, progress=_PROGRESS.value)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  from launch.lab.loadgen_lib import app
  cfg = config()
  try:
    out = app.run(cfg)
  except (ValueError, RuntimeError, OSError) as e:
    raise CliError(str(e)) from None
  except KeyboardInterrupt:
    print("interrupted: every finished rate is kept in --out; rerun the command to resume",
          file=sys.stderr)
    sys.exit(130)
  keep = ("best_rate_per_s", "measured_rates", "reused_rates", "sent", "ok", "rejected",
          "errors", "throughput_rps", "goodput_rps", "meets_slo_p99", "ttft_s", "tpot_s")
  print(json.dumps({k: out[k] for k in keep if k in out} | {"out": _OUT.value}))
  sys.stdout.flush()


if __name__ == "__main__":
  cli.run(main)
