"""Multi-LoRA serving's cost: a batch over several adapters against the base model alone, in one run.

  python -m launch.lab.bench_lora --model smollm2-135m --json
  python -m launch.lab.bench_lora --model smollm2-135m --quantize int8 --json
  python -m launch.lab.bench_lora --model tiny --batch 2 --adapters 2 --max_tokens 8 --rounds 1

The benchmark writes ``--adapters`` random PEFT adapters of rank ``--rank`` on every target
(q, k, v, o, gate, up, down; ``launch.lab.make_adapters``) and serves ``--batch`` requests at
once (``--prompt_tokens`` random ids each, ``--max_tokens`` generated, EOS ignored, greedy)
through the serving stack (``serving.stack.build``: the server's scheduler and engine) in three
configurations, interleaved for ``--rounds`` rounds: ``base`` (no adapters served), ``lora``
(``--max_loras`` device slots, default one per adapter; the rows cycle over the adapters) and
``lora_base_rows`` (the same LoRA engine, every row without an adapter: what serving adapters
costs the base model's traffic). Per configuration, medians over rounds: ``decode_step_ms`` (a
step that decodes every row and prefills nothing), ``prefill_tok_s`` (prompt tokens over the
steps that prefill) and ``tok_s`` (generated tokens over the whole run); then
``decode_overhead`` and ``prefill_overhead`` (``lora`` over ``base``, time ratios; the target
is < 1.3x), ``base_rows_same_ids`` (the base rows' ids on the LoRA engine equal ``base``'s) and
``programs_after_ready``. ``--json`` prints one object. Bad flags exit 2.
"""

from __future__ import annotations

import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

from absl import flags

from launch import cli
from launch import machine
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "model (preset, smollm2-135m, .gguf, ...)")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "activation dtype")
_QUANTIZE = flags.DEFINE_enum("quantize", "none", ["none", "int8"], "base weights")
_ADAPTERS = flags.DEFINE_integer("adapters", 4, "adapters the rows cycle over", lower_bound=1)
_MAX_LORAS = flags.DEFINE_integer("max_loras", 0, "device slots (0: one per adapter)",
                                  lower_bound=0)
_RANK = flags.DEFINE_integer("rank", 16, "the adapters' rank", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", 8, "requests at once", lower_bound=1)
_PROMPT = flags.DEFINE_integer("prompt_tokens", 128, "prompt length", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "tokens per request", lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 3, "interleaved rounds", lower_bound=1)
_JSON = flags.DEFINE_bool("json", False, "print one JSON object")

_CONFIGS = ("base", "lora", "lora_base_rows")


def _serve(loop, reqs, batch: int) -> dict[str, object]:
  """Runs ``reqs`` to the end, timing each step by its plan's composition."""
  from serving.lifecycle import RequestTrace
  sched, engine = loop.scheduler, loop.engine
  for r in reqs:
    assert sched.add(r, RequestTrace(r.request_id)) is None
  decode_s: list[float] = []
  prefill_s, prefill_tokens = 0.0, 0
  outs = []
  t0 = time.perf_counter()
  while not sched.idle:
    plan = sched.schedule()
    t = time.perf_counter()
    res = engine.execute(plan)
    if res is not None:
      outs += sched.update(res)
    dt = time.perf_counter() - t
    if plan.prefill:
      prefill_s += dt
      prefill_tokens += sum(len(c.token_ids) for c in plan.prefill)
    elif len(plan.decode) == batch:
      decode_s.append(dt)
    if plan.empty:
      for res in engine.flush():
        outs += sched.update(res)
  for res in engine.flush():
    outs += sched.update(res)
  seconds = time.perf_counter() - t0
  ids: dict[str, list[int]] = {}
  for o in outs:
    ids.setdefault(o.request_id.split("-", 1)[1], []).extend(o.token_ids)
  return {"ids": ids, "tok_s": sum(map(len, ids.values())) / seconds,
          "decode_step_ms": 1e3 * statistics.median(decode_s) if decode_s else None,
          "prefill_tok_s": prefill_tokens / prefill_s if prefill_s else None}


def run() -> dict[str, object]:
  import dataclasses
  import jax.numpy as jnp
  import numpy as np
  from launch.lab.make_adapters import write_peft_adapter
  from models.cpu import backend as cpu_backend
  from models.io.loader import load_model
  from models.step import UnshardedStep
  from serving import stack
  from serving.lora import LoraConfig
  from serving.request import Request
  from serving.sampling import SamplingParams
  from serving.stop import StopCriteria
  try:
    cfg, params, tok = load_model(_MODEL.value, jnp.dtype(_DTYPE.value),
                                  quantize=_QUANTIZE.value)  # type: ignore[arg-type]  # an enum flag
  except (ValueError, FileNotFoundError) as e:
    raise CliError(str(e))
  b, n_ad = _BATCH.value, _ADAPTERS.value
  context = _PROMPT.value + _MAX_TOKENS.value
  if context > cfg.max_seq_len:
    raise CliError(f"--prompt_tokens + --max_tokens = {context} > the model's context "
                   f"{cfg.max_seq_len}")
  step = UnshardedStep(cfg, backend=cpu_backend.resolve().backend)
  rng = np.random.default_rng(0)
  vocab = min(tok.vocab_size, cfg.vocab_size)
  prompts = [tuple(int(t) for t in rng.integers(0, vocab, _PROMPT.value)) for _ in range(b)]
  with tempfile.TemporaryDirectory() as tmp:
    modules = tuple((f"lora{i}", str(write_peft_adapter(Path(tmp) / f"lora{i}", cfg,
                                                        rank=_RANK.value, seed=i)))
                    for i in range(n_ad))
    base = stack.ServingConfig(max_slots=b, max_context=context, max_waiting=10_000,
                               kv_pages=max(64, b * (-(-context // 64) + 1)))
    with_lora = dataclasses.replace(base, lora=LoraConfig(modules, _MAX_LORAS.value or n_ad))
    loops = {"base": stack.build(step, params, tok, base),
             "lora": stack.build(step, params, tok, with_lora)}
    loops["lora_base_rows"] = loops["lora"]
    sealed = {}
    for name in ("base", "lora"):
      stack.warmup(loops[name])
      loops[name].engine.seal()
      sealed[name] = loops[name].engine.programs
    registry = loops["lora"].loras
    assert registry is not None  # built with adapters
    refs = registry.names()

    def reqs(tag: str, adapters: bool) -> list[Request]:
      return [Request(f"{tag}-{i}", prompts[i], SamplingParams(),
                      StopCriteria(max_tokens=_MAX_TOKENS.value, ignore_eos=True),
                      lora=refs[i % n_ad] if adapters else None) for i in range(b)]
    runs: dict[str, list[dict]] = {c: [] for c in _CONFIGS}
    for r in range(_ROUNDS.value):
      for name in _CONFIGS:
        runs[name].append(_serve(loops[name], reqs(f"{name}{r}", name == "lora"), b))
  med = lambda name, key: statistics.median(x[key] for x in runs[name])  # noqa: E731
  out = {name: {k: round(med(name, k), 2) for k in ("decode_step_ms", "prefill_tok_s", "tok_s")}
         for name in _CONFIGS}
  return {
      "model": _MODEL.value, "dtype": _DTYPE.value, "quantize": _QUANTIZE.value,
      "batch": b, "adapters": n_ad, "max_loras": _MAX_LORAS.value or n_ad, "rank": _RANK.value,
      "prompt_tokens": _PROMPT.value, "max_tokens": _MAX_TOKENS.value, "rounds": _ROUNDS.value,
      "configs": out,
      "decode_overhead": round(med("lora", "decode_step_ms") / med("base", "decode_step_ms"), 3),
      "prefill_overhead": round(med("base", "prefill_tok_s") / med("lora", "prefill_tok_s"), 3),
      "base_rows_overhead": round(med("lora_base_rows", "decode_step_ms")
                                  / med("base", "decode_step_ms"), 3),
      "base_rows_same_ids": runs["lora_base_rows"][-1]["ids"] == runs["base"][-1]["ids"],
      "adapters_change_ids": runs["lora"][-1]["ids"] != runs["base"][-1]["ids"],
      "programs_after_ready": sum(loops[n].engine.programs - sealed[n] for n in sealed),
      "machine": machine.describe(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv: list[str]) -> None:
  cli.start(argv)
  result = run()
  print(json.dumps(result) if _JSON.value else json.dumps(result, indent=1))


if __name__ == "__main__":
  cli.run(main)
