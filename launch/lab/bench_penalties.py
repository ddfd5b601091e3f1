"""What penalties and logit bias cost per step: the engine's sampling program, on and off.

  python -m launch.lab.bench_penalties --model smollm2-135m --rows 16,64 --slots 64

Times ``serving.engine_calls.sample_call`` (one jitted program per row count, as the engine
runs it: penalty state donated, ids counted) on random logits over the model's vocabulary, for
each ``--rows``: greedy and sampled (temperature 1, top-k 50) batches without penalties, with
every row penalised (presence, frequency, repetition and ``--bias_entries`` logit-bias ids) and
with one row penalised (the switch is per batch: the rest pay for it too). Each slot's counts
hold ``--generated`` ids and its prompt mask ``--prompt`` ids. Prints one JSON object: best and
median milliseconds of ``--repeats`` calls per case, the cost of penalties over the same case
without, the date and the machine.
"""

from __future__ import annotations

import json
import time

from absl import flags

from launch import cli
from launch import machine

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "model preset (its vocabulary)")
_ROWS = flags.DEFINE_list("rows", ["16", "64"], "rows per sampling call")
_SLOTS = flags.DEFINE_integer("slots", 64, "engine slots (the state's X)", lower_bound=1)
_GENERATED = flags.DEFINE_integer("generated", 256, "ids counted per slot", lower_bound=0)
_PROMPT = flags.DEFINE_integer("prompt", 512, "prompt ids per slot", lower_bound=0)
_BIAS = flags.DEFINE_integer("bias_entries", 16, "logit-bias ids per penalised row",
                             lower_bound=0)
_REPEATS = flags.DEFINE_integer("repeats", 20, "timed calls per case", lower_bound=1)


def _case(rows: int, slots: int, vocab: int, temperature: float, penalised: int
          ) -> dict[str, float]:
  import jax
  import numpy as np
  from serving import penalties
  from serving.engine_calls import sample_call
  from serving.sampling import SamplingArrays, SamplingParams
  from serving.token_mask import words

  rng = np.random.default_rng(0)
  plain = SamplingParams(temperature=temperature, top_k=50 if temperature else 0, seed=1)
  pen = SamplingParams(temperature=temperature, top_k=plain.top_k, seed=1, presence_penalty=0.5,
                       frequency_penalty=0.5, repetition_penalty=1.2,
                       logit_bias=tuple((int(t), 1.0) for t in range(_BIAS.value)))
  samp = SamplingArrays.from_params([pen] * penalised + [plain] * (slots - penalised))
  state = penalties.PenaltyState.create(slots, vocab,
                                        jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  for x in range(slots):
    state = penalties.fill_slot(state, x, rng.integers(0, vocab, _PROMPT.value).tolist(),
                                rng.integers(0, vocab, _GENERATED.value).tolist())
  logits = jax.device_put(rng.standard_normal((rows, vocab)).astype(np.float32) * 4)
  last = jax.device_put(np.zeros((slots,), np.int32))
  slots_R = np.arange(rows, dtype=np.int32) % slots
  pos = np.full((rows,), 100, np.int32)
  take = np.ones((rows,), bool)
  mask_RW = np.zeros((rows, words(vocab)), np.int32)  # no structured output: masks off
  masked_R = np.zeros((rows,), bool)
  times = []
  for i in range(_REPEATS.value + 2):  # two untimed: the compile and a warm run
    t0 = time.perf_counter()
    last, state, tok, _ = sample_call(logits, last, state, samp, slots_R, pos, take,
                                      np.bool_(False), mask_RW, masked_R, valid_vocab=vocab)
    jax.block_until_ready(tok)
    if i >= 2:
      times.append(time.perf_counter() - t0)
  return {"best_ms": round(1e3 * min(times), 3),
          "median_ms": round(1e3 * float(np.median(times)), 3)}


def main(argv: list[str]) -> None:
  from models.config import get_preset
  vocab = get_preset(_MODEL.value).vocab_size
  out: dict[str, object] = {}
  for r in (int(x) for x in _ROWS.value):
    for name, temperature in (("greedy", 0.0), ("top_k50", 1.0)):
      x = max(_SLOTS.value, r)
      cases = {k: _case(r, x, vocab, temperature, n)
               for k, n in (("off", 0), ("all_rows", x), ("one_row", 1))}
      out[f"rows{r}_{name}"] = dict(cases, all_rows_minus_off_ms=round(
          cases["all_rows"]["best_ms"] - cases["off"]["best_ms"], 3))
  print(json.dumps({"model": _MODEL.value, "vocab": vocab, "slots": _SLOTS.value,
                    "generated": _GENERATED.value, "prompt": _PROMPT.value,
                    "bias_entries": _BIAS.value, "cases": out,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "machine": machine.describe()}, indent=2))


if __name__ == "__main__":
  cli.run(main)
