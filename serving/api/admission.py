"""SLO classes and prediction-based early rejection (Mooncake): refuse at arrival what would miss.

Contract: ``SloClass(name, ttft_s, tpot_s)``; ``MLPERF_CLASSES`` are MLPerf Inference v5.0's
LLM server-scenario targets (``interactive`` 450 ms / 40 ms as Llama-2-70B interactive,
``server`` 2 s / 200 ms as Llama-2-70B server, ``long`` 6 s / 175 ms as Llama-3.1-405B
server). ``parse_classes("name:ttft_s:tpot_s,...")`` reads a flag. ``predict(load) ->
Prediction`` estimates a new request's TTFT and TPOT from the measured step time and the
prefill backlog, as the scheduler plans steps: after the steps it waits for a decode slot
(decode-only steps of the running rows), the backlog (prompt tokens admitted but not yet
prefilled) drains first, at the prefill tokens a step carries (``max_step_tokens - decoding
rows``, at most ``max_prefill_chunks`` chunks of ``max_chunk``, at most the TPOT budget's
``prefill_limit`` while rows decode), and this request's prompt takes at most one ``max_chunk``
chunk a step beside it; then one step for the sampled id's copy. TPOT is the current step time. ``Prediction.miss(slo, scale)`` names the
target it would miss (targets multiplied by ``scale``, for slower machines), or None;
``judge(load, slo, scale)`` applies it, except to a request that misses even alone (see there). Before any
step has been measured the step time is taken as ``fallback_step_s``. ``BEST_EFFORT`` is the class
of a request that names none (unless the server names a default): predicted, never refused for
a predicted miss (only by the queue bound), as vLLM serves every request it can queue; a client
opts into early rejection by naming a class.
"""

from __future__ import annotations

import dataclasses
from serving.step_cost import StepCostModel


@dataclasses.dataclass(frozen=True)
class SloClass:
  name: str
  ttft_s: float
  tpot_s: float

  def __post_init__(self):
    if not (self.ttft_s > 0 and self.tpot_s > 0):
      raise ValueError(f"SLO class {self.name!r}: targets must be > 0")


MLPERF_CLASSES = (SloClass("interactive", 0.45, 0.040), SloClass("server", 2.0, 0.200),
                  SloClass("long", 6.0, 0.175))
BEST_EFFORT = "best_effort"  # no targets: never refused early (see the module contract)


def parse_classes(spec: str) -> tuple[SloClass, ...]:
  out = []
  for part in spec.split(","):
    bits = part.strip().split(":")
    if len(bits) != 3 or not bits[0]:
      raise ValueError(f"SLO class {part!r}: expected name:ttft_s:tpot_s")
    try:
      out.append(SloClass(bits[0], float(bits[1]), float(bits[2])))
    except ValueError as e:
      raise ValueError(f"SLO class {part!r}: {e}") from None
  if len({c.name for c in out}) != len(out):
    raise ValueError(f"SLO classes {spec!r}: duplicate names")
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Load:
  step_s: float  # measured busy-step time (0: none yet)
  backlog_tokens: int  # prompt tokens admitted, not yet prefilled
  decoding: int  # rows decoding now (each takes one token of the step budget)
  max_step_tokens: int
  new_tokens: int  # this request's prompt tokens to prefill (times n), cached ones excluded
  fallback_step_s: float = 0.01
  model: StepCostModel | None = None
  slot_wait_steps: int = 0  # steps until a decode slot frees for it (Scheduler.slot_wait_steps)
  max_chunk: int = 1 << 30  # the longest chunk of one prompt in a step
  max_prefill_chunks: int = 1 << 30  # prompt chunks per step
  prefill_limit: int | None = None  # prefill tokens a decoding step may carry (the TPOT budget)
  host_s: float = 0.0  # the loop's own time per step around the engine call (step timeline)
  in_flight_s: float = 0.0  # what is left of the step running now (a new request waits it out)

  def prefill_per_step(self) -> tuple[int, int]:
    """(prefill tokens a step carries, of which one prompt's at most)."""
    total = min(max(1, self.max_step_tokens - self.decoding),
                self.max_chunk * self.max_prefill_chunks)
    if self.decoding and self.prefill_limit is not None:
      total = min(total, max(1, self.prefill_limit))
    return total, min(total, self.max_chunk)


@dataclasses.dataclass(frozen=True)
class Prediction:
  ttft_s: float
  tpot_s: float

  def miss(self, slo: SloClass, scale: float = 1.0) -> str | None:
    if self.ttft_s > slo.ttft_s * scale:
      return (f"predicted TTFT {self.ttft_s * 1e3:.1f} ms exceeds the {slo.name!r} target of "
              f"{slo.ttft_s * scale * 1e3:.1f} ms")
    if self.tpot_s > slo.tpot_s * scale:
      return (f"predicted TPOT {self.tpot_s * 1e3:.1f} ms exceeds the {slo.name!r} target of "
              f"{slo.tpot_s * scale * 1e3:.1f} ms")
    return None


def _prefill_steps(load: Load) -> list[tuple[int, int]]:
  """(prefill tokens of a step, how many such steps) until this request's prompt is in: the
  backlog first (FCFS), this prompt's chunks beside it where a step has room and chunks left."""
  total, own = load.prefill_per_step()
  backlog, new = load.backlog_tokens, load.new_tokens
  out = [(total, backlog // total)] if backlog >= total else []  # the backlog's full steps
  backlog -= total * (backlog // total)
  while backlog > 0 or new > 0:
    take_b = min(total, backlog)
    # A step's chunks: the backlog's (at least one per max_chunk), then one of this prompt.
    chunks_left = load.max_prefill_chunks - -(-take_b // load.max_chunk)
    take_n = min(total - take_b, own, new) if chunks_left > 0 else 0
    backlog, new = backlog - take_b, new - take_n
    if take_b == 0 and new >= own:  # the rest of this prompt: whole chunks, then the tail
      out.append((take_n, 1 + new // own))
      new -= own * (new // own)
      if new:
        out.append((new, 1))
      break
    out.append((take_b + take_n, 1))
  return out


def predict(load: Load) -> Prediction:
  steps = _prefill_steps(load)
  n_steps = sum(n for _, n in steps) + 1 + load.slot_wait_steps  # + the first id's copy step
  if load.model is not None and load.model.ready:
    # Waiting for a slot: the running rows' decode steps (a step of the backlog's prefill is
    # counted below, not here: costing every wait step as a full prefill chunk over-predicted
    # long prompts' TTFT 4-10x at low load, BUILD_NOTES "Load generator").
    t = load.slot_wait_steps * load.model.cost(0, load.decoding)
    t += sum(n * load.model.cost(tokens, load.decoding) for tokens, n in steps)
    t += load.model.cost(0, load.decoding + 1)  # the step that copies the first id back
    tpot = load.model.cost(0, load.decoding + 1)
  else:
    t, tpot = n_steps * (load.step_s or load.fallback_step_s), load.step_s
  # The fit times engine calls only: every step also costs the loop's own work around the call,
  # and the request first waits for the step in flight (together ~20% of TTFT at 2 QPS on a
  # 2-core CPU, measured: BUILD_NOTES "Where a step's time goes").
  t += n_steps * load.host_s + load.in_flight_s
  return Prediction(ttft_s=t, tpot_s=tpot + load.host_s if tpot else tpot)


def judge(load: Load, slo: SloClass, scale: float = 1.0) -> tuple[Prediction, str | None]:
  """(the prediction, why to refuse or None). A prompt too long for its TTFT target (it would
  miss even with nothing ahead of it, where a one-token prompt would not) cannot be protected by
  refusing it: it is refused only when what is ahead of it would more than double its own time,
  so it is served whenever the server is not busy, instead of never. On a machine too slow for
  the target whatever the prompt, a miss is refused as any other."""
  pred = predict(load)
  miss = pred.miss(slo, scale)
  if miss is None or not miss.startswith("predicted TTFT"):
    return pred, miss
  target = slo.ttft_s * scale
  clear = dataclasses.replace(load, backlog_tokens=0, slot_wait_steps=0)
  alone = predict(clear)
  if alone.ttft_s <= target or predict(dataclasses.replace(clear, new_tokens=1)).ttft_s > target:
    return pred, miss
  if pred.ttft_s <= 2 * alone.ttft_s:
    return pred, None
  return pred, (f"predicted TTFT {pred.ttft_s * 1e3:.1f} ms is over twice the "
                f"{alone.ttft_s * 1e3:.1f} ms its prompt takes with nothing ahead of it (that "
                f"alone over the {slo.name!r} target of {target * 1e3:.1f} ms)")
