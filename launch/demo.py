"""`make run`: start the gRPC server, wait for readiness, stream one chat answer, stop the server.

  python -m launch.demo --model smollm2-135m --prompt "What is prefill?"

The server is a child process on 127.0.0.1 and a free port; it is always stopped (SIGTERM, then
SIGKILL after ``--stop_timeout_s``) and reaped, also when the client fails. Exit status: the
client's, or 2 with one ``error:`` line when the server never became ready. ``--server_flag`` passes extra flags on.

One answer uses a handful of the server's shape buckets, so by default the server starts without
compiling them all (``launch.server --nowarmup``): the request compiles what it uses, and its TTFT
includes that (BUILD_NOTES "Build and test": ``make run`` cold, 2 min 47 s with the full warm-up of
37 programs, 57 s without). ``--warmup`` compiles every bucket first, as a serving deployment
does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

from absl import flags

from launch import cli
from launch.cli import CliError

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "model for the server")
_QUANTIZE = flags.DEFINE_enum("quantize", "none", ["none", "int8"],
                               "weight quantization (the server's default: none; the float dtype "
                               "is the server's --dtype auto)")
_PROMPT = flags.DEFINE_string("prompt", "What are the two phases of LLM inference?",
                              "the chat prompt")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "tokens to generate", lower_bound=1)
_READY = flags.DEFINE_float("ready_timeout_s", 600.0, "how long start-up may take")
_STOP = flags.DEFINE_float("stop_timeout_s", 30.0, "how long the server may take to drain")
_EXTRA = flags.DEFINE_multi_string("server_flag", [], "extra launch.server flags")
_WARMUP = flags.DEFINE_bool("warmup", False, "compile every shape bucket before the answer (slow "
                            "on a cold cache; without, the answer compiles what it uses)")


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  with tempfile.TemporaryDirectory(prefix="phaseserve-demo-") as tmp:
    port_file = os.path.join(tmp, "port")
    server = subprocess.Popen(
        [sys.executable, "-m", "launch.server", "--model", _MODEL.value, "--quantize",
         _QUANTIZE.value, "--port", "0", "--port_file", port_file, "--max_context", "1024",
         # A small shape grid: start-up compiles every bucket, and this is a one-answer demo.
         "--max_slots", "4", "--max_prefill_chunks", "1", "--max_chunk", "256",
         "--warmup" if _WARMUP.value else "--nowarmup", *_EXTRA.value])
    if not _WARMUP.value:
      print("demo: the server compiles each program on first use (--warmup: all before serving), "
            "so this answer's TTFT includes compiling", file=sys.stderr, flush=True)
    rc = 1
    try:
      deadline = time.monotonic() + _READY.value
      while not os.path.exists(port_file):
        if server.poll() is not None:
          raise CliError(f"the server exited with {server.returncode} during start-up")
        if time.monotonic() > deadline:
          raise CliError("the server did not bind in time")
        time.sleep(0.2)
      port = open(port_file).read().strip()
      client = subprocess.run(
          [sys.executable, "-m", "launch.client", "--target", f"127.0.0.1:{port}", "--chat",
           "--max_tokens", str(_MAX_TOKENS.value), "--wait_ready",
           str(max(1.0, deadline - time.monotonic())), _PROMPT.value])
      rc = client.returncode
    finally:
      if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
          server.wait(_STOP.value)
        except subprocess.TimeoutExpired:
          server.kill()
          server.wait()
  sys.exit(rc)


if __name__ == "__main__":
  cli.run(main)
