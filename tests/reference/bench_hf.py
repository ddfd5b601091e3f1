"""Hugging Face transformers (PyTorch CPU) on the same shape, for side-by-side comparison with
``launch.lab.bench_model``. Runs in the Python 3.11 reference env (``.venv-ref``), never in the project.

  .venv-ref/bin/python tests/reference/bench_hf.py --dtype bfloat16 --json

  .venv-ref/bin/python tests/reference/bench_hf.py --checkpoint DIR --cache static --json

Prints one JSON object: prefill tokens/s per batch and decode ms/token per batch (greedy,
``generate`` with the KV cache), random weights of the ``small`` Llama shape by default, or the
Hugging Face checkpoint directory ``--checkpoint`` (loaded in ``--dtype``; the shape flags are
then ignored). ``--cache static`` (``launch.lab.bench_peers`` passes it) runs ``generate`` with
transformers' static KV cache (``cache_implementation="static"``); where that raises, the
dynamic cache is used and ``cache`` in the output says so with the error. ``--last_logits``: the
timed prefill forward computes only the last position's logits (``logits_to_keep=1``, as
``generate`` and phaseserve's prefill do; else all of them). Decode ms/token = (generate N -
generate 1) / (N - 1).
"""

import argparse
import json
import statistics
import time

import torch
import transformers


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
  ap.add_argument("--hidden", type=int, default=768)
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--heads", type=int, default=12)
  ap.add_argument("--kv_heads", type=int, default=1)
  ap.add_argument("--ffn", type=int, default=2048)
  ap.add_argument("--vocab", type=int, default=32000)
  ap.add_argument("--prompt", type=int, default=128)
  ap.add_argument("--new_tokens", type=int, default=32, help=">= 2")
  ap.add_argument("--batches", default="1,8")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--checkpoint", default=None, help="a Hugging Face checkpoint directory")
  ap.add_argument("--cache", default="dynamic", choices=["dynamic", "static"])
  ap.add_argument("--last_logits", action="store_true",
                  help="prefill computes the last position's logits only (as generate does)")
  a = ap.parse_args()
  torch.manual_seed(0)
  dtype = getattr(torch, a.dtype)
  if a.checkpoint:
    model = transformers.AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=dtype).eval()
    a.vocab = model.config.vocab_size
  else:
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, intermediate_size=a.ffn,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=2048)
    model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
  gen_kw: dict[str, str] = {}
  cache = "dynamic"
  if a.cache == "static":
    try:  # one short generate proves the static cache works with this model and version
      model.generate(torch.zeros((1, 4), dtype=torch.long), max_new_tokens=2, min_new_tokens=2,
                     do_sample=False, cache_implementation="static")
      gen_kw, cache = {"cache_implementation": "static"}, "static"
    except Exception as e:  # noqa: BLE001 - reported in the output, not hidden
      cache = f"dynamic (static failed: {type(e).__name__}: {str(e)[:200]})"
  out = {"engine": f"transformers {transformers.__version__} / torch {torch.__version__}",
         "dtype": a.dtype, "threads": torch.get_num_threads(), "cache": cache,
         "checkpoint": a.checkpoint, "last_logits": a.last_logits, "prefill": [],
         "decode": []}
  with torch.inference_mode():
    for b in [int(x) for x in a.batches.split(",")]:
      ids = torch.randint(0, a.vocab, (b, a.prompt))
      mask = torch.ones_like(ids)
      pf_kw = {"logits_to_keep": 1} if a.last_logits else {}
      model(ids, **pf_kw)  # warm-up
      times = []
      for _ in range(a.repeats):
        t = time.perf_counter()
        model(ids, use_cache=True, **pf_kw)
        times.append(time.perf_counter() - t)
      pf = statistics.median(times)
      out["prefill"].append({"batch": b, "tokens": a.prompt, "tok_per_s": b * a.prompt / pf})

      def generate(n: int) -> float:
        t = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, **gen_kw)
        return time.perf_counter() - t

      generate(2)  # warm-up
      # Decode time per token: (N tokens - 1 token) / (N - 1), so prefill cancels out. The two
      # lengths run interleaved and each keeps its best time: noise only adds, so a stall in one
      # call can no longer make the difference negative the way a median of separate runs could.
      long_s, short_s = [], []
      for _ in range(a.repeats):
        long_s.append(generate(a.new_tokens))
        short_s.append(generate(1))
      ms = (min(long_s) - min(short_s)) / (a.new_tokens - 1) * 1e3
      out["decode"].append({"batch": b, "ms_per_token": ms, "tok_per_s": b * 1e3 / ms})
  print(json.dumps(out) if a.json else json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
