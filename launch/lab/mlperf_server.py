"""MLPerf LoadGen's Server scenario against a serving endpoint, and side-by-side tables of runs.

  python -m launch.lab.mlperf_server --target http://127.0.0.1:8000 --api openai --model M \
      --qps 1.0 --queries 460 --out results/mlperf/phaseserve-1.0
  python -m launch.lab.mlperf_server --table results/mlperf/phaseserve-1.0,results/mlperf/vllm-1.0

MLPerf Inference's own load generator (``mlcommons-loadgen``, module ``mlperf_loadgen``) issues
``--queries`` queries (at least; LoadGen also holds ``--min_duration_s``) at Poisson arrivals of
mean ``--qps``, with token latencies on (``use_token_latencies``): each query streams one greedy
request through ``launch.lab.loadgen_lib.drivers`` (``--api openai``: streaming
``/v1/completions`` with ``ignore_eos``; ``phaseserve`` / ``jetstream``: gRPC), its first token
is reported with ``FirstTokenComplete`` as it arrives and its end with ``QuerySamplesComplete``
and the token count. LoadGen judges the run against ``--ttft_ms`` / ``--tpot_ms`` at p99 (default
900 / 80 ms: MLPerf's interactive Llama-2-70B targets, 450 / 40 ms, scaled x2 for a 2-core CPU)
and writes its logs to ``--out``. The samples: ``--samples`` prompts of ``--prompt_lo..hi``
tokens (uniform; one common English word per token, so a BPE tokenizer sees about as many) with
``max_tokens`` uniform in ``--output_lo..hi`` (default the issue's trace: prompts 56-176,
64-128 generated), from ``--seed``. A refused request (HTTP 429 / RESOURCE_EXHAUSTED) or a
failed one completes its query with no tokens and is counted.

``--out/summary.json`` (also printed as one line): LoadGen's result (``VALID`` / ``INVALID``) and
why, completed QPS, TTFT and TPOT p50 / p90 / p99 in ms (LoadGen's own figures), refused and
failed requests by status, and from a phaseserve server's ``--metrics_url`` its step breakdown
over the run (``launch.lab.server_steps``: where each busy step's time went, the mean decode-only
step, p50 TPOT over it, programs compiled). ``--table DIR,DIR,...`` writes (and prints) ``side_by_side.md`` from
their ``summary.json`` files (``--names`` labels them). Exit 2 on bad flags, 1 on a run with
failed requests.
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags

from launch import cli
from launch.cli import CliError
from launch.lab.mlperf_lib import run_server_scenario, side_by_side

_TARGET = flags.DEFINE_string("target", "127.0.0.1:9000", "host:port (openai: or a base URL)")
_API = flags.DEFINE_enum("api", "openai", ["phaseserve", "jetstream", "openai"], "client API")
_MODEL = flags.DEFINE_string("model", "", "openai: the request's model name")
_OUT = flags.DEFINE_string("out", None, "output directory (LoadGen's logs, summary.json)")
_QPS = flags.DEFINE_float("qps", 1.0, "mean Poisson arrival rate (queries/s)", lower_bound=1e-3)
_QUERIES = flags.DEFINE_integer("queries", 460, "minimum queries (LoadGen's min_query_count)",
                                lower_bound=1)
_MIN_S = flags.DEFINE_float("min_duration_s", 0.0, "minimum duration of the run", lower_bound=0)
_TTFT = flags.DEFINE_float("ttft_ms", 900.0, "p99 TTFT target", lower_bound=0.001)
_TPOT = flags.DEFINE_float("tpot_ms", 80.0, "p99 TPOT target", lower_bound=0.001)
_SAMPLES = flags.DEFINE_integer("samples", 256, "distinct prompts", lower_bound=1)
_PROMPT_LO = flags.DEFINE_integer("prompt_lo", 56, "shortest prompt (tokens)", lower_bound=1)
_PROMPT_HI = flags.DEFINE_integer("prompt_hi", 176, "longest prompt (tokens)", lower_bound=1)
_OUTPUT_LO = flags.DEFINE_integer("output_lo", 64, "fewest tokens generated", lower_bound=1)
_OUTPUT_HI = flags.DEFINE_integer("output_hi", 128, "most tokens generated", lower_bound=1)
_VOCAB = flags.DEFINE_integer("vocab_size", 49152, "phaseserve / jetstream: prompt ids below this",
                              lower_bound=2)
_SEED = flags.DEFINE_integer("seed", 0, "samples and LoadGen's schedule")
_TIMEOUT = flags.DEFINE_float("request_timeout_s", 600.0, "per request", lower_bound=1.0)
_READY = flags.DEFINE_float("ready_timeout_s", 600.0, "wait this long for the target to answer",
                            lower_bound=0.0)
_METRICS = flags.DEFINE_string(
    "metrics_url", None, "the server's Prometheus endpoint, scraped before and after the run for "
    "its step breakdown (default: openai: TARGET/metrics; gRPC APIs: none; '' for none)")
_TABLE = flags.DEFINE_list("table", None, "summary directories to put side by side (no run)")
_NAMES = flags.DEFINE_list("names", None, "--table: a label per directory (default its name)")


def _metrics_url() -> str:
  if _METRICS.value is not None:
    return _METRICS.value
  if _API.value != "openai":
    return ""
  base = _TARGET.value if "://" in _TARGET.value else f"http://{_TARGET.value}"
  return base.rstrip("/") + "/metrics"


def main(argv: list[str]) -> None:
  del argv
  if _TABLE.value:
    names = _NAMES.value or [os.path.basename(os.path.normpath(d)) for d in _TABLE.value]
    if len(names) != len(_TABLE.value):
      raise CliError(f"--names gives {len(names)} labels for {len(_TABLE.value)} directories")
    text = side_by_side(_TABLE.value, names)
    if _OUT.value:
      os.makedirs(_OUT.value, exist_ok=True)
      with open(os.path.join(_OUT.value, "side_by_side.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text, end="")
    return
  if not _OUT.value:
    raise CliError("--out is required for a run")
  if _PROMPT_LO.value > _PROMPT_HI.value or _OUTPUT_LO.value > _OUTPUT_HI.value:
    raise CliError("--prompt_lo / --output_lo must not exceed their --*_hi")
  try:
    summary = run_server_scenario(
        api=_API.value, target=_TARGET.value, model=_MODEL.value, out_dir=_OUT.value,
        qps=_QPS.value, queries=_QUERIES.value, min_duration_s=_MIN_S.value,
        ttft_s=_TTFT.value / 1e3, tpot_s=_TPOT.value / 1e3, samples=_SAMPLES.value,
        prompt=(_PROMPT_LO.value, _PROMPT_HI.value), output=(_OUTPUT_LO.value, _OUTPUT_HI.value),
        vocab_size=_VOCAB.value, seed=_SEED.value, timeout_s=_TIMEOUT.value,
        ready_timeout_s=_READY.value, metrics_url=_metrics_url())
  except TimeoutError as e:
    raise CliError(str(e))
  print(json.dumps(summary))
  if summary["failed"]:
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
