"""Other engines side by side: phaseserve, transformers, llama.cpp and vLLM on one model's weights.

  python -m launch.lab.bench_peers --model smollm2-135m --out build/peers
  python -m launch.lab.bench_peers --model tiny --prompt 16 --new_tokens 4 --offline=false --out DIR

Writes the model once under ``--out/model`` (a bf16 Hugging Face checkpoint and GGUF files,
``--gguf_float`` and Q8_0), runs every engine on those files (``launch.lab.peers.core`` has the
contract: what each engine measures, the row statuses, the ratios), prints a table and writes
``--out/peers.csv`` and ``--out/peers.json``. The peers are built by make targets, never project
dependencies: ``make .venv-ref/.stamp`` (transformers), ``make peers-llamacpp`` (llama.cpp,
about 10 minutes), ``make peers-vllm`` (vLLM's CPU build); a peer that is absent is a row
``not installed`` naming its target. ``--offline`` runs the offline trace (vLLM's start-up takes
2-3 minutes; phaseserve's serve_offline warms its programs first). A whole run takes about 25
minutes: a tqdm bar counts the engines, and a rerun into the same ``--out`` with the same flags
reads back every engine whose rows were all ``ok`` (``--noresume`` reruns them). Bad flags exit 2
with one line.
"""

from __future__ import annotations

import sys

from absl import flags, logging

from launch import cli
from launch.cli import CliError
from launch.lab.peers import core

_D = core.PeersConfig()
_MODEL = flags.DEFINE_string("model", _D.model, "smollm2-135m or a random-weight preset")
_OUT = flags.DEFINE_string("out", _D.out, "output directory (model files, peers.csv, peers.json)")
_PROMPT = flags.DEFINE_integer("prompt", _D.prompt, "prompt tokens per row", lower_bound=1)
_NEW = flags.DEFINE_integer("new_tokens", _D.new_tokens, "decode steps timed", lower_bound=2)
_BATCHES = flags.DEFINE_list("batches", [str(b) for b in _D.batches], "batch sizes")
_REPEATS = flags.DEFINE_integer("repeats", _D.repeats, "timed runs per figure", lower_bound=1)
_LREPEATS = flags.DEFINE_integer("llamacpp_repeats", _D.llamacpp_repeats,
                                 "llama-batched-bench runs per GGUF file", lower_bound=1)
_SEED = flags.DEFINE_integer("param_seed", _D.param_seed, "weights seed of random presets")
_GGUF_FLOAT = flags.DEFINE_enum("gguf_float", _D.gguf_float, ["BF16", "F16"],
                                "float GGUF type for llama.cpp against phaseserve bf16")
_OFFLINE = flags.DEFINE_bool("offline", _D.offline, "offline trace: vLLM and serve_offline")
_TRACE_N = flags.DEFINE_integer("trace_requests", _D.trace_requests, "requests in the trace",
                                lower_bound=1)
_TRACE_P = flags.DEFINE_integer("trace_prompt", _D.trace_prompt, "prompt ids per request",
                                lower_bound=1)
_TRACE_T = flags.DEFINE_integer("trace_tokens", _D.trace_tokens, "tokens generated per request",
                                lower_bound=1)
_LOADGEN = flags.DEFINE_bool("loadgen", _D.loadgen, "capacity at SLO (needs launch.lab.loadgen)")
_LOADGEN_ARGS = flags.DEFINE_string("loadgen_args", _D.loadgen_args,
                                    "more launch.lab.loadgen flags for the capacity step")
_CAP_CTX = flags.DEFINE_integer("capacity_context", _D.capacity_context,
                                "context limit of both servers in the capacity step",
                                lower_bound=16)
_REF_PY = flags.DEFINE_string("ref_python", _D.ref_python, "transformers' Python 3.11")
_LLAMA = flags.DEFINE_string("llamacpp_bin", _D.llamacpp_bin, "llama.cpp's bin directory")
_VLLM_PY = flags.DEFINE_string("vllm_python", _D.vllm_python, "vLLM's Python 3.11")
_THREADS = flags.DEFINE_integer("threads", _D.threads, "CPU threads for the peers",
                                lower_bound=1)
_PEAK = flags.DEFINE_integer("peak_size", _D.peak_size, "bench_model's matmul peak size",
                             lower_bound=16)
_BW = flags.DEFINE_integer("bandwidth_mb", _D.bandwidth_mb, "bench_model's bandwidth buffer",
                           lower_bound=1)
_TIMEOUT = flags.DEFINE_float("timeout_s", _D.timeout_s, "limit per engine command",
                              lower_bound=1.0)
_RESUME = flags.DEFINE_bool("resume", True, "read back the engines an earlier run in --out "
                            "measured with the same flags, all rows ok (--noresume: rerun all)")
_PROGRESS = flags.DEFINE_bool("progress", True, "a progress bar over the engines (stderr)")


def _config() -> core.PeersConfig:
  from models.config import PRESET_NAMES
  from models.io.loader import TRAINED_MODELS
  ok = [n for n in (*TRAINED_MODELS, *PRESET_NAMES) if not n.startswith("palm")]
  if _MODEL.value not in ok:
    raise CliError(f"--model must be one of {', '.join(dict.fromkeys(ok))}, got {_MODEL.value!r}")
  try:
    batches = tuple(int(b) for b in _BATCHES.value if b.strip())
  except ValueError:
    raise CliError(f"--batches must be integers, got {','.join(_BATCHES.value)!r}") from None
  if not batches or min(batches) < 1:
    raise CliError("--batches must list positive integers")
  return core.PeersConfig(
      model=_MODEL.value, out=_OUT.value, prompt=_PROMPT.value, new_tokens=_NEW.value,
      batches=batches, repeats=_REPEATS.value, llamacpp_repeats=_LREPEATS.value,
      param_seed=_SEED.value,
      gguf_float=_GGUF_FLOAT.value, offline=_OFFLINE.value, trace_requests=_TRACE_N.value,
      trace_prompt=_TRACE_P.value, trace_tokens=_TRACE_T.value, loadgen=_LOADGEN.value,
      loadgen_args=_LOADGEN_ARGS.value, capacity_context=_CAP_CTX.value,
      ref_python=_REF_PY.value, llamacpp_bin=_LLAMA.value, vllm_python=_VLLM_PY.value,
      project_python=sys.executable, threads=_THREADS.value, peak_size=_PEAK.value,
      bandwidth_mb=_BW.value, timeout_s=_TIMEOUT.value)


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  cfg = _config()
  from tqdm import tqdm
  bar = tqdm(total=len(core.STAGES), desc="engines", unit="engine", disable=not _PROGRESS.value)

  def stages(names):
    for name in names:
      bar.set_postfix_str(name)
      yield name
      bar.update()

  try:
    result = core.run(cfg, log=lambda m: bar.write(m, file=sys.stderr), resume=_RESUME.value,
                      progress=stages)
  finally:
    bar.close()
  csv_path, json_path = core.write(result, cfg.out)
  print(core.table(result))
  print(f"wrote {csv_path} and {json_path}")


if __name__ == "__main__":
  cli.run(main)
