"""What the gRPC service costs: the same requests through launch.server and launch.serve_offline.

  python -m launch.lab.bench_service --model smollm2-135m --quantize int8 --requests 32 \
      --prompt_len 128 --max_tokens 64 --json

Starts ``launch.server`` (a child process on 127.0.0.1, always stopped and reaped), waits for
readiness, sends ``--requests`` greedy token-id requests (``--prompt_len`` ids each, distinct
prompts, ``max_tokens`` each, ``ignore_eos``) all at once from as many client threads, and
records per request the client's TTFT / TPOT / e2e and the server's own timings from the final
message. Then the same requests go through ``launch.serve_offline`` (the same engine flags, no
gRPC) as the baseline. Prints one JSON object: both runs' generated tokens/s, p50 / p99 TTFT
and TPOT, the ratio service / offline, whether the greedy ids agreed, the machine.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from absl import flags

from launch import cli
from launch import machine
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "model")
_QUANTIZE = flags.DEFINE_enum("quantize", "none", ["none", "int8"], "weight quantization")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "float param dtype")
_REQUESTS = flags.DEFINE_integer("requests", 32, "concurrent requests", lower_bound=1)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "prompt ids per request", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "tokens per request", lower_bound=1)
_MAX_SLOTS = flags.DEFINE_integer("max_slots", 32, "decode slots", lower_bound=1)
_MAX_CONTEXT = flags.DEFINE_integer("max_context", 512, "context", lower_bound=2)
_ENGINE = flags.DEFINE_multi_string("engine_flag", [], "more flags for both runs (--x=y)")
_READY = flags.DEFINE_float("ready_timeout_s", 900.0, "start-up bound")
_JSON = flags.DEFINE_bool("json", True, "print JSON")


def _pct(xs: list[float], q: float) -> float | None:
  if not xs:
    return None
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _summary(ttft: list[float], tpot: list[float], tokens: int, seconds: float) -> dict:
  ms = lambda v: None if v is None else round(v * 1e3, 2)
  return {"tokens": tokens, "seconds": round(seconds, 3),
          "throughput_tok_s": round(tokens / seconds, 1) if seconds > 0 else None,
          "ttft_p50_ms": ms(_pct(ttft, 0.5)), "ttft_p99_ms": ms(_pct(ttft, 0.99)),
          "tpot_p50_ms": ms(_pct(tpot, 0.5)), "tpot_p99_ms": ms(_pct(tpot, 0.99))}


def _prompts(vocab: int) -> list[list[int]]:
  return [[(7 + 13 * i + 31 * j) % (vocab - 3) for j in range(_PROMPT_LEN.value)]
          for i in range(_REQUESTS.value)]


def _engine_flags() -> list[str]:
  return ["--model", _MODEL.value, "--quantize", _QUANTIZE.value, "--dtype", _DTYPE.value,
          "--max_slots", str(_MAX_SLOTS.value), "--max_context", str(_MAX_CONTEXT.value),
          *_ENGINE.value]


def _service(tmp: str, prompts: list[list[int]]) -> tuple[dict, list[list[int]]]:
  import grpc
  from launch.readiness import wait_ready
  from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
  from serving.api.proto.phaseserve.v1 import generation_pb2_grpc as pb_grpc
  port_file = os.path.join(tmp, "port")
  server = subprocess.Popen([sys.executable, "-m", "launch.server", *_engine_flags(),
                             "--port", "0", "--port_file", port_file, "--early_reject=false",
                             "--max_queue", str(len(prompts) + 8)],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "log"), "w"))
  try:
    deadline = time.monotonic() + _READY.value
    while not os.path.exists(port_file):
      if server.poll() is not None or time.monotonic() > deadline:
        raise CliError(f"the server did not start: {open(os.path.join(tmp, 'log')).read()[-2000:]}")
      time.sleep(0.2)
    target = f"127.0.0.1:{open(port_file).read().strip()}"
    channel = grpc.insecure_channel(target)
    wait_ready(channel, max(1.0, deadline - time.monotonic()))
    stub = pb_grpc.GenerationStub(channel)

    def one(p):
      t0 = time.monotonic()
      first = None
      ids: list[int] = []
      final = None
      for r in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=p),
                                                max_tokens=_MAX_TOKENS.value, ignore_eos=True),
                             timeout=_READY.value):
        if r.token_ids and first is None:
          first = time.monotonic()
        ids.extend(r.token_ids)
        if r.HasField("final"):
          final = r.final
      end = time.monotonic()
      return ids, first - t0, (end - first) / max(1, len(ids) - 1), final

    start = time.monotonic()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
      rows = list(pool.map(one, prompts))
    seconds = time.monotonic() - start
    out = _summary([r[1] for r in rows], [r[2] for r in rows], sum(len(r[0]) for r in rows),
                   seconds)
    out["server_ttft_p99_ms"] = round(_pct([r[3].timings.ttft_s for r in rows], 0.99) * 1e3, 2)
    out["server_tpot_p99_ms"] = round(_pct([r[3].timings.tpot_s for r in rows], 0.99) * 1e3, 2)
    channel.close()
    return out, [r[0] for r in rows]
  finally:
    if server.poll() is None:
      server.send_signal(signal.SIGTERM)
      try:
        server.wait(60)
      except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _offline(tmp: str, prompts: list[list[int]]) -> tuple[dict, list[list[int]]]:
  path = os.path.join(tmp, "reqs.jsonl")
  with open(path, "w") as f:
    for p in prompts:
      f.write(json.dumps({"prompt_ids": p, "max_tokens": _MAX_TOKENS.value, "ignore_eos": True,
                          "seed": 0}) + "\n")
  r = subprocess.run([sys.executable, "-m", "launch.serve_offline", *_engine_flags(),
                      "--requests", path, "--json"], capture_output=True, text=True)
  if r.returncode != 0:
    raise CliError(f"serve_offline failed: {r.stderr[-2000:]}")
  rows = [json.loads(l) for l in r.stdout.splitlines()]
  summary = rows[-1]["summary"]
  rows = rows[:-1]
  out = _summary([x["ttft_ms"] / 1e3 for x in rows],
                 [x["tpot_ms"] / 1e3 for x in rows if x["tpot_ms"] is not None],
                 summary["completion_tokens"], summary["seconds"])
  return out, [x["token_ids"] for x in rows]


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  from models.io.loader import load_config
  vocab = load_config(_MODEL.value).vocab_size
  prompts = _prompts(vocab)
  with tempfile.TemporaryDirectory(prefix="phaseserve-bench-") as tmp:
    service, ids_s = _service(tmp, prompts)
    offline, ids_o = _offline(tmp, prompts)
  ratio = lambda k: (round(service[k] / offline[k], 3)
                     if service.get(k) and offline.get(k) else None)
  out = {"bench": "service_vs_offline", "model": _MODEL.value, "quantize": _QUANTIZE.value,
         "dtype": _DTYPE.value, "requests": len(prompts), "prompt_len": _PROMPT_LEN.value,
         "max_tokens": _MAX_TOKENS.value, "service": service, "offline": offline,
         "service_over_offline": {k: ratio(k) for k in ("throughput_tok_s", "ttft_p99_ms",
                                                         "tpot_p99_ms")},
         "same_greedy_ids": ids_s == ids_o, "engine_flags": _engine_flags(),
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
         "machine": machine.describe()}
  print(json.dumps(out, indent=None if _JSON.value else 2))


if __name__ == "__main__":
  cli.run(main)
