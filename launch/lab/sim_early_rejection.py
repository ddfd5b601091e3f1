"""Early rejection (Mooncake), simulated: goodput and p99 TTFT at 1x-2x load, with and without.

  python -m launch.lab.sim_early_rejection --loads 1,1.5,2 --requests 400 --json

The real scheduler, front end and admission predictor over a FakeEngine whose steps cost
``--step_s + --token_s * prefill tokens + --row_s * decode rows`` simulated seconds (the host
waits for the previous step, as under lagged results); Poisson arrivals at each multiple of the
engine's capacity; ``--prompt`` ids in, ``--out`` ids out, one SLO class (``--ttft_s``,
``--tpot_s``). Per load and policy: admitted / rejected, p99 TTFT of admitted requests, goodput
(requests meeting both SLOs per simulated second) and the predictor's error (actual / predicted
TTFT). Simulated seconds, so the figures are the policy's, not a machine's.
"""

from __future__ import annotations

import json

from absl import flags

from launch import cli
from launch.cli import CliError
from launch.lab.early_rejection_sim import capacity, simulate

_LOADS = flags.DEFINE_string("loads", "1,1.5,2", "multiples of the capacity")
_REQUESTS = flags.DEFINE_integer("requests", 400, "arrivals per run", lower_bound=1)
_STEP = flags.DEFINE_float("step_s", 0.004, "simulated seconds per step")
_TOKEN = flags.DEFINE_float("token_s", 0.0002, "simulated seconds per prefill token")
_ROW = flags.DEFINE_float("row_s", 0.0005, "simulated seconds per decode row")
_PROMPT = flags.DEFINE_integer("prompt", 96, "prompt ids per request", lower_bound=1)
_OUT = flags.DEFINE_integer("out", 12, "generated ids per request", lower_bound=1)
_TTFT = flags.DEFINE_float("ttft_s", 0.25, "TTFT target")
_TPOT = flags.DEFINE_float("tpot_s", 1.0, "TPOT target")
_SEED = flags.DEFINE_integer("seed", 0, "arrival and prompt seed")
_JSON = flags.DEFINE_bool("json", True, "one JSON line")

def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    loads = [float(x) for x in _LOADS.value.split(",")]
  except ValueError:
    raise CliError(f"--loads {_LOADS.value!r}: comma-separated numbers")
  costs = (_STEP.value, _TOKEN.value, _ROW.value)
  cap = capacity(costs, _PROMPT.value, _OUT.value)
  rows = []
  for x in loads:
    for on in (False, True):
      r = simulate(on, x * cap, _REQUESTS.value, costs, _PROMPT.value, _OUT.value, _TTFT.value,
                   _TPOT.value, _SEED.value)
      rows.append({"load": x, "early_reject": on, **r})
  print(json.dumps({"bench": "early_rejection_sim", "capacity_rps": round(cap, 2),
                    "slo": {"ttft_s": _TTFT.value, "tpot_s": _TPOT.value},
                    "costs": dict(zip(("step_s", "token_s", "row_s"), costs)), "runs": rows},
                   indent=None if _JSON.value else 2))


if __name__ == "__main__":
  cli.run(main)
