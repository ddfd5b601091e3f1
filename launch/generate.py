"""Generate text from one prompt, streaming tokens to stdout as they come.

  python -m launch.generate --model tiny --prompt "Hello" --max_tokens 32
  python -m launch.generate --model small --prompt_ids 1,2,3 --quantize int8 --json
  python -m launch.generate --model MODEL --chat "What is the capital of France?"

Exactly one of ``--prompt`` (text; the tokenizer's ``bos_id`` is prepended when it has one),
``--prompt_ids`` (ids as given) or ``--chat`` (one user message rendered with the model's chat
template and encoded as is: the template writes the special tokens, nothing is prepended; a model
without a chat template is an error). ``--json`` prints one object: {"token_ids", "text",
"ttft_ms", "tpot_ms", ...}. TTFT and TPOT are measured after compilation (reported separately as
``compile_s``). Bad flags exit with code 2 and a one-line error.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Sequence

from absl import flags, logging

from launch import cli
from launch.cli import CliError

if TYPE_CHECKING:
  from models.text.tokenizer import Tokenizer

_MODEL = flags.DEFINE_string(
    "model", "tiny", "smollm2-135m (trained), a random preset (tiny, small), a .gguf file or a "
    "checkpoint directory")
_PROMPT = flags.DEFINE_string("prompt", None, "prompt text")
_PROMPT_IDS = flags.DEFINE_string("prompt_ids", None, "comma-separated prompt token ids")
_CHAT = flags.DEFINE_string("chat", None, "a user message, rendered with the model's chat template")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "tokens to generate", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy", lower_bound=0.0)
_TOP_K = flags.DEFINE_integer("top_k", 0, "0 = off", lower_bound=0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "nucleus mass in (0, 1]")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed", lower_bound=0)
_PARAM_SEED = flags.DEFINE_integer("param_seed", 0, "init seed for preset (random) weights")
_QUANTIZE = flags.DEFINE_enum("quantize", "none", ["none", "int8"], "weight quantization")
_INT8_MODE = flags.DEFINE_enum("int8_mode", None, ["weight_only", "w8a8"],
                               "int8 compute (default: models.precision's choice, weight_only)")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "float param dtype")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object instead of streaming text")
_STEPS_PER_CALL = flags.DEFINE_integer("steps_per_call", 8, "decode steps per jitted call",
                                       lower_bound=1)
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", False, "do not stop at the end-of-sequence token")



def _given_prompt_ids() -> list[int] | None:
  """Checks the prompt flags before any model loads; returns --prompt_ids if given."""
  given = [f for f in (_PROMPT, _PROMPT_IDS, _CHAT) if f.value is not None]
  if len(given) != 1:
    raise CliError("give exactly one of --prompt, --prompt_ids or --chat")
  if _PROMPT_IDS.value is None:
    return None
  try:
    return [int(t) for t in _PROMPT_IDS.value.split(",") if t.strip()]
  except ValueError:
    raise CliError(f"--prompt_ids must be comma-separated integers, got {_PROMPT_IDS.value!r}")


def build_prompt(tokenizer: Tokenizer, *, prompt: str | None = None,
                 prompt_ids: Sequence[int] | None = None, chat: str | None = None) -> list[int]:
  """The prompt ids from exactly one source (see the module docstring); CliError otherwise, or
  when ``chat`` is given and the tokenizer has no (working) chat template."""
  if sum(x is not None for x in (prompt, prompt_ids, chat)) != 1:
    raise CliError("give exactly one of --prompt, --prompt_ids or --chat")
  if prompt_ids is not None:
    return [int(i) for i in prompt_ids]
  if chat is not None:
    try:
      return tokenizer.encode_chat([{"role": "user", "content": chat}])
    except ValueError as e:
      raise CliError(f"--chat: {e}")
  assert prompt is not None
  ids = tokenizer.encode(prompt)
  return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + ids


def _prompt_ids(tokenizer: Tokenizer) -> list[int]:
  return build_prompt(tokenizer, prompt=_PROMPT.value, prompt_ids=_given_prompt_ids(),
                      chat=_CHAT.value)


def run() -> dict:
  import jax.numpy as jnp
  from models.io.loader import load_model
  from models.text.tokenizer import StreamDecoder
  from models.precision import int8_mode_of
  from models.cpu import backend as cpu_backend
  from serving.generator import Generator
  from serving.sampling import SamplingParams

  try:
    sampling = SamplingParams(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value, _SEED.value)
  except ValueError as e:
    raise CliError(str(e))
  _given_prompt_ids()
  dtype = jnp.float32 if _DTYPE.value == "float32" else jnp.bfloat16
  try:
    cfg, params, tokenizer = load_model(_MODEL.value, dtype, _PARAM_SEED.value,
                                        # enum flags: their values are the Literals' own
                                        quantize=_QUANTIZE.value,  # type: ignore[arg-type]
                                        int8_mode=_INT8_MODE.value)  # type: ignore[arg-type]  # an enum flag
  except (ValueError, FileNotFoundError) as e:
    raise CliError(str(e))
  prompt = _prompt_ids(tokenizer)
  gen = Generator(cfg, params, steps_per_call=_STEPS_PER_CALL.value,
                  valid_vocab=tokenizer.vocab_size, backend=cpu_backend.resolve().backend)
  try:
    gen.check_lengths(len(prompt), _MAX_TOKENS.value)
    if min(prompt) < 0 or max(prompt) >= cfg.vocab_size:
      raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size})")
  except ValueError as e:
    raise CliError(str(e))
  stop = () if _IGNORE_EOS.value else tuple(tokenizer.eos_ids)

  t0 = time.perf_counter()  # warm-up: compile every shape this request will use
  for _ in gen.stream([prompt], _MAX_TOKENS.value, sampling, stop_ids=()):
    pass
  compile_s = time.perf_counter() - t0

  decoder = StreamDecoder(tokenizer)
  ids: list[int] = []
  times: list[float] = []
  start = time.perf_counter()
  for step in gen.stream([prompt], _MAX_TOKENS.value, sampling, stop_ids=stop):
    tok = int(step[0])
    if tok < 0:
      break
    times.append(time.perf_counter())
    ids.append(tok)
    if not _JSON.value:
      sys.stdout.write(decoder.push(tok))
      sys.stdout.flush()
  if not _JSON.value:
    sys.stdout.write(decoder.flush() + "\n")
  ttft_ms = (times[0] - start) * 1e3
  tpot_ms = (times[-1] - times[0]) * 1e3 / (len(times) - 1) if len(times) > 1 else 0.0
  if not _JSON.value:
    rate = f"{1e3 / tpot_ms:.1f} tok/s" if tpot_ms > 0 else "n/a"
    print(f"[{len(ids)} tokens: TTFT {ttft_ms:.0f} ms, decode {rate} "
          f"({cfg.name}, {_DTYPE.value}, {int8_mode_of(params) or 'float'} weights; compiled "
          f"in {compile_s:.1f} s)]")
  return {"token_ids": ids, "text": tokenizer.decode(ids), "ttft_ms": ttft_ms,
          "tpot_ms": tpot_ms, "prompt_tokens": len(prompt), "compile_s": compile_s,
          "model": cfg.name, "quantize": _QUANTIZE.value, "int8_mode": int8_mode_of(params),
          "dtype": _DTYPE.value}


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)  # keep stderr for errors (JAX logs backend probing)
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  result = run()
  if _JSON.value:
    print(json.dumps(result))


if __name__ == "__main__":
  cli.run(main)
