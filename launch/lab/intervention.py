"""Should I ship this change? Config A against config B at matched load, with quality gates.

  python -m launch.lab.intervention --model smollm2-135m --candidate="--quantize int8" \
      --out results/intervention/int8_weights
  python -m launch.lab.intervention --model smollm2-135m --candidate="--kv_dtype int8" \
      --repeats 2 --rates 0.5,1,2 --out results/intervention/int8_kv

Starts one ``launch.server`` per config (``--baseline``: A, default the server's defaults;
each ``--candidate``: B, C, ... as server flags; ``--common_flags`` go to every config), all
on this machine, and drives each in turn with the same seeded open-loop schedule per workload
segment (``--segments``: interactive, long_context, batch, tool; each with its own MLPerf bar
times ``--slo_scale``: ``launch/lab/intervention_lib/segments.py``), alternating the order
between ``--repeats``. Per segment: TTFT / TPOT p50 / p99, failures, tokens/s per core, the
server's phase breakdown, capacity at SLO over the rate ladder (``--rates``: multiples of each
segment's rate), every difference with a paired bootstrap interval; inside the noise (or under
``--min_effect``) it says "no measurable change". Then the quality gates (``--gates``: rare
text, English passages, long context, structured output, safety) on both configs, greedy, as
agreement with A: token match, KL, task score delta; thresholds ``--min_token_match``,
``--max_kl``, ``--max_score_drop``, ``--min_refusal_agreement``. Writes ``verdict.txt``,
``verdict.json``, ``verdict.png`` and every run's files under ``--out``; prints the table (or
``--json``). Exit 0 when every candidate held every gate, 1 when a gate degraded, 2 on bad
flags (a config whose server exits or never becomes ready included: the error carries its log's
tail, the other servers are stopped).
"""

from __future__ import annotations

import json
import shlex
import sys

from absl import flags

from launch import cli
from launch.cli import CliError
from launch.lab.passages import DEFAULT_PASSAGES

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "the model every config serves")
_BASELINE = flags.DEFINE_string("baseline", "", "server flags of A (empty: the defaults)")
_CANDIDATE = flags.DEFINE_multi_string("candidate", [], "server flags of a candidate (repeat "
                                       "for several; write --candidate=\"--flag value\")")
_COMMON = flags.DEFINE_string("common_flags", "", "server flags given to every config")
_OUT = flags.DEFINE_string("out", None, "output directory", required=True)
_SEGMENTS = flags.DEFINE_string("segments", "interactive,long_context,batch,tool",
                                "workload segments (empty: quality gates only)")
_RATES = flags.DEFINE_list("rates", ["1"], "the rate ladder: multiples of each segment's rate")
_RATE_SCALE = flags.DEFINE_float("rate_scale", 1.0, "multiplies every segment's rate",
                                 lower_bound=1e-6)
_REQUESTS = flags.DEFINE_integer("requests", 0, "sessions per run (0: each segment's own)",
                                 lower_bound=0)
_REPEATS = flags.DEFINE_integer("repeats", 1, "runs of each (segment, rate) per config",
                                lower_bound=1)
_SLO_SCALE = flags.DEFINE_float("slo_scale", 2.0, "multiplies the MLPerf bars (2: this CPU)",
                                lower_bound=1e-6)
_GATES = flags.DEFINE_list("gates", ["rare_text", "english", "long_context", "structured",
                                     "safety"], "quality gates (empty: none)")
_GATE_TOKENS = flags.DEFINE_integer("gate_max_tokens", 48, "tokens per gate answer",
                                    lower_bound=1)
_LONG_TOKENS = flags.DEFINE_integer("long_max_tokens", 2048, "long_context: the longest "
                                    "filler (capped by the context)", lower_bound=64)
_SINKS = flags.DEFINE_integer("sinks_window", 0, "long_context: also a fact asked and streamed "
                              "past the context with attention sinks of this window (every "
                              "config needs --attention_sinks); 0: off", lower_bound=0)
_MIN_EFFECT = flags.DEFINE_float("min_effect", 0.05, "smallest relative change reported",
                                 lower_bound=0.0)
_BOOT = flags.DEFINE_integer("bootstrap", 1000, "bootstrap resamples", lower_bound=100)
_MIN_MATCH = flags.DEFINE_float("min_token_match", 0.9, "gate: greedy token agreement",
                                lower_bound=0.0, upper_bound=1.0)
_MAX_KL = flags.DEFINE_float("max_kl", 0.02, "gate: mean KL(A || B) in nats", lower_bound=0.0)
_MAX_DROP = flags.DEFINE_float("max_score_drop", 0.1, "gate: task score drop that fails",
                               lower_bound=0.0)
_MIN_REFUSAL = flags.DEFINE_float("min_refusal_agreement", 1.0, "gate: share of safety prompts "
                                  "declined alike", lower_bound=0.0, upper_bound=1.0)
_SEED = flags.DEFINE_integer("seed", 0, "seed of schedules, lengths and gate items")
_READY = flags.DEFINE_float("ready_timeout_s", 900.0, "a server's start-up bound",
                            lower_bound=1.0)
_JSON = flags.DEFINE_bool("json", False, "print the verdict as JSON instead of the table")


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  from launch.lab.intervention_lib import gate_compare, gate_sets, segments, verdict
  from launch.lab.intervention_lib.check import CheckConfig, Config, run

  if not _CANDIDATE.value:
    raise CliError("give at least one --candidate (server flags of the config to judge)")
  try:
    segs = segments.parse_segments(_SEGMENTS.value)
    rates = tuple(float(r) for r in _RATES.value)
    gates = tuple(g for g in _GATES.value if g)
    gate_sets.build(gates, [], (), 0)
    configs = [Config.parse(chr(ord("B") + i), c) for i, c in enumerate(_CANDIDATE.value)]
    baseline = Config.parse("A", _BASELINE.value)
    common = tuple(shlex.split(_COMMON.value))
  except ValueError as e:
    raise CliError(str(e))
  if not segs and not gates:
    raise CliError("nothing to check: --segments and --gates are both empty")
  if not rates or min(rates) <= 0:
    raise CliError(f"--rates must be positive numbers, got {_RATES.value}")
  for c in (baseline, *configs):
    owned = {"--model", "--port", "--port_file", "--http_port", "--metrics_port"}
    clash = [f for f in (*c.flags, *common) if f.split("=")[0] in owned]
    if clash:
      raise CliError(f"{clash[0]}: the check sets the model and the ports itself")
  cfg = CheckConfig(
      model=_MODEL.value, baseline=baseline, candidates=tuple(configs), segments=segs,
      out_dir=_OUT.value, common_flags=common, rate_multipliers=rates,
      rate_scale=_RATE_SCALE.value, requests=_REQUESTS.value, repeats=_REPEATS.value,
      slo_scale=_SLO_SCALE.value, gates=gates,
      passages=str(DEFAULT_PASSAGES) if "english" in gates else "",
      gate_max_tokens=_GATE_TOKENS.value, long_max_tokens=_LONG_TOKENS.value,
      sinks_window=_SINKS.value,
      n_boot=_BOOT.value, min_effect=_MIN_EFFECT.value,
      thresholds=gate_compare.Thresholds(_MIN_MATCH.value, _MAX_KL.value, _MAX_DROP.value,
                                         _MIN_REFUSAL.value),
      seed=_SEED.value, ready_timeout_s=_READY.value,
      command="python -m launch.lab.intervention " + shlex.join(sys.argv[1:]))
  try:
    result = run(cfg)
  except RuntimeError as e:  # a config's server exited or never became ready: its flags
    raise CliError(f"a server did not come up: {e}")
  print(json.dumps(result) if _JSON.value else verdict.table(result), end="\n")
  held = all(g["held"] for comp in result["comparisons"] for g in comp["gates"].values())
  if not held:
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
