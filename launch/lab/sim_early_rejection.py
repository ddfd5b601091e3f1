"""Early rejection (Mooncake), simulated: goodput and p99 TTFT at 1x-2x load, with and without.

  python -m launch.lab.sim_early_rejection --loads 1,1.5,2 --requests 400 --json

Contract: ``simulate(early_reject, rate, n, costs, prompt, out, ttft_s, tpot_s, seed) -> dict``
runs the real scheduler, front end and admission predictor over a FakeEngine on a simulated
clock (``costs`` = seconds per step, per prefill token, per decode row; the host waits for the
previous step, as under lagged results) with ``n`` Poisson arrivals at ``rate``, and returns
admitted / rejected counts, the admitted requests' p99 TTFT, goodput (requests meeting both SLOs
per simulated second), the predictor's error and the fitted step costs; ``capacity(costs,
prompt, out)`` is the engine's sustainable request rate. The CLI runs every ``--loads`` multiple
of it with and without early rejection and prints one JSON object (simulated seconds: the
figures are the policy's, not a machine's). Its flags exist only when run as a program
(``_Flags``): importing the library defines none.
"""

from __future__ import annotations

import functools
import json
import random

from absl import flags

from launch import cli
from launch.cli import CliError

SLOTS, STEP_TOKENS, CHUNK = 16, 256, 128


class SimClock:
  def __init__(self):
    self.t = 0.0

  def __call__(self) -> float:
    return self.t


def timed_engine(clock: SimClock, costs: tuple[float, float, float], pages: int, page_size: int,
                 vocab: int, slots: int):
  from serving.fake_engine import FakeEngine

  class TimedEngine(FakeEngine):
    """``execute`` waits (advances the clock) for the previous step's device time."""

    def __init__(self):
      super().__init__(pages, page_size, vocab, slots, lag=1)
      self._pending = 0.0

    def execute(self, plan):
      clock.t += self._pending
      a, b, c = costs
      self._pending = 0.0 if plan.empty else (
          a + b * sum(len(ch.token_ids) for ch in plan.prefill) + c * len(plan.decode))
      return super().execute(plan)

  return TimedEngine()


def capacity(costs: tuple[float, float, float], prompt: int, out: int) -> float:
  """Requests/s the engine sustains with a full decode batch while prefilling the next ones."""
  a, b, c = costs
  return 1 / (b * prompt + (a + c * SLOTS) * out / SLOTS + a * prompt / STEP_TOKENS)


def simulate(early_reject: bool, rate: float, n: int, costs=(0.004, 0.0002, 0.0005),
             prompt: int = 96, out: int = 12, ttft_s: float = 0.25, tpot_s: float = 1.0,
             seed: int = 0) -> dict:
  import prometheus_client as prom
  from models.text.tokenizer import ByteTokenizer
  from serving.api.admission import SloClass
  from serving.api.auth import KeyInfo
  from serving.api.frontend import Frontend, FrontendConfig
  from serving.api.stream import ServiceError, Status
  from serving.kv_pages import PageBudget, PagePool
  from serving.lifecycle import Metrics
  from serving.loop import ServingLoop
  from serving.scheduler import Scheduler
  from serving.api.validation import GenerateArgs, Limits

  clock = SimClock()
  ctx = prompt + out + 16
  pool = PagePool(PageBudget(16, 2048), max_seq_tokens=ctx)
  sched = Scheduler(pool, ByteTokenizer(), max_slots=SLOTS, max_step_tokens=STEP_TOKENS,
                    max_chunk=CHUNK, max_waiting=n + 1)
  reg = prom.CollectorRegistry()
  loop = ServingLoop(sched, timed_engine(clock, costs, 2048, 16, ByteTokenizer.VOCAB_SIZE,
                                         SLOTS), Metrics(reg), clock=clock)
  slo = SloClass("chat", ttft_s, tpot_s)
  fe = Frontend(loop, ByteTokenizer(), FrontendConfig(
      Limits(max_context=ctx, slo_classes=("chat",), default_slo_class="chat"), (slo,),
      early_reject=early_reject, max_queue=n + 1), reg)
  fe.set_state("serving")
  rng = random.Random(seed)
  t, arrivals = 0.0, []
  for _ in range(n):
    t += rng.expovariate(rate)
    arrivals.append(t)
  streams, rejected = [], []
  i = 0
  while i < len(arrivals) or not loop.idle:
    if i < len(arrivals) and arrivals[i] <= clock.t:
      try:
        streams.append(fe.generate(GenerateArgs(
            token_ids=[rng.randrange(256) for _ in range(prompt)], max_tokens=out,
            ignore_eos=True), KeyInfo("sim")))
      except ServiceError as e:
        if e.status is not Status.REJECTED:
          raise
        rejected.append(e.message)
      i += 1
    elif not loop.step() and i < len(arrivals):
      clock.t = max(clock.t, arrivals[i])  # idle until the next arrival
  timings = [s.traces[0].timings() for s in streams]
  ttft = sorted(x["ttft_s"] for x in timings)
  good = sum(x["ttft_s"] <= ttft_s and (x["tpot_s"] or 0) <= tpot_s for x in timings)
  return {"admitted": len(streams), "rejected": len(rejected),
          "p99_ttft_ms": round(ttft[min(len(ttft) - 1, int(0.99 * (len(ttft) - 1)))] * 1e3, 1),
          "goodput_rps": round(good / clock.t, 2), "sim_seconds": round(clock.t, 3),
          "prediction": fe.prediction_error(), "fitted_costs": loop.cost_model.coef,
          "example_rejection": rejected[0] if rejected else None}


class _Flags:
  """The CLI's flags, defined when the module runs as a program (never on import)."""

  def __init__(self) -> None:
    self.loads = flags.DEFINE_string("loads", "1,1.5,2", "multiples of the capacity")
    self.requests = flags.DEFINE_integer("requests", 400, "arrivals per run", lower_bound=1)
    self.step_s = flags.DEFINE_float("step_s", 0.004, "simulated seconds per step")
    self.token_s = flags.DEFINE_float("token_s", 0.0002, "simulated seconds per prefill token")
    self.row_s = flags.DEFINE_float("row_s", 0.0005, "simulated seconds per decode row")
    self.prompt = flags.DEFINE_integer("prompt", 96, "prompt ids per request", lower_bound=1)
    self.out = flags.DEFINE_integer("out", 12, "generated ids per request", lower_bound=1)
    self.ttft_s = flags.DEFINE_float("ttft_s", 0.25, "TTFT target")
    self.tpot_s = flags.DEFINE_float("tpot_s", 1.0, "TPOT target")
    self.seed = flags.DEFINE_integer("seed", 0, "arrival and prompt seed")
    self.json = flags.DEFINE_bool("json", True, "one JSON line")


def main(f: _Flags, argv: list[str]) -> None:
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    loads = [float(x) for x in f.loads.value.split(",")]
  except ValueError:
    raise CliError(f"--loads {f.loads.value!r}: comma-separated numbers")
  costs = (f.step_s.value, f.token_s.value, f.row_s.value)
  cap = capacity(costs, f.prompt.value, f.out.value)
  rows = []
  for x in loads:
    for on in (False, True):
      r = simulate(on, x * cap, f.requests.value, costs, f.prompt.value, f.out.value,
                   f.ttft_s.value, f.tpot_s.value, f.seed.value)
      rows.append({"load": x, "early_reject": on, **r})
  print(json.dumps({"bench": "early_rejection_sim", "capacity_rps": round(cap, 2),
                    "slo": {"ttft_s": f.ttft_s.value, "tpot_s": f.tpot_s.value},
                    "costs": dict(zip(("step_s", "token_s", "row_s"), costs)), "runs": rows},
                   indent=None if f.json.value else 2))


if __name__ == "__main__":
  cli.run(functools.partial(main, _Flags()))
