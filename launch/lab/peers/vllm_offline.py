"""vLLM (CPU build) offline throughput on one trace; run by ``.venv-vllm``'s Python 3.11.

  VLLM_CPU_KVCACHE_SPACE=4 .venv-vllm/bin/python launch/lab/peers/vllm_offline.py \
      --checkpoint DIR --trace trace.jsonl --out vllm.json

Contract: imports nothing from phaseserve. ``--trace`` is JSONL, one request per line:
{"prompt_ids": [...], "max_tokens": N} (greedy, EOS ignored). Loads the Hugging Face checkpoint
dir with ``vllm.LLM`` (``skip_tokenizer_init``: prompts are ids), generates once as a warm-up
(the first 2 requests), then times every request submitted at once, and batch 1 (the first
request alone). Writes one JSON object to ``--out``: {"engine", "startup_s", "requests",
"completion_tokens", "seconds", "throughput_tok_s", "batch1_tok_s", "batch1_seconds"}.
"""

import argparse
import json
import time


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--checkpoint", required=True)
  ap.add_argument("--trace", required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--max_model_len", type=int, default=512)
  ap.add_argument("--max_num_seqs", type=int, default=64)
  a = ap.parse_args()
  t0 = time.perf_counter()
  import vllm
  from vllm import LLM, SamplingParams
  reqs = [json.loads(line) for line in open(a.trace, encoding="utf-8") if line.strip()]
  llm = LLM(model=a.checkpoint, skip_tokenizer_init=True, dtype=a.dtype,
            max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs, seed=0)
  startup = time.perf_counter() - t0

  def params(r: dict) -> "SamplingParams":
    return SamplingParams(max_tokens=r["max_tokens"], min_tokens=r["max_tokens"],
                          temperature=0.0, ignore_eos=True, detokenize=False)

  def run(rs: list[dict]) -> tuple[int, float]:
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r["prompt_ids"]} for r in rs],
                        [params(r) for r in rs], use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t

  run(reqs[:2])  # warm-up
  n, secs = run(reqs)
  n1, secs1 = run(reqs[:1])
  out = {"engine": f"vllm {vllm.__version__}", "startup_s": startup, "requests": len(reqs),
         "completion_tokens": n, "seconds": secs, "throughput_tok_s": n / secs,
         "batch1_tok_s": n1 / secs1, "batch1_seconds": secs1}
  with open(a.out, "w", encoding="utf-8") as f:
    json.dump(out, f)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
