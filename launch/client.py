"""A command-line client: streams one answer and prints its TTFT, TPOT, tokens/s and finish reason.

  python -m launch.client --target 127.0.0.1:9000 --chat "What is prefill?"
  python -m launch.client --target 127.0.0.1:9000 --jetstream "Once upon a time"

phaseserve's API by default (``--chat`` sends the prompt as one user message, rendered by the
model's chat template); ``--jetstream`` uses JetStream's ``Orchestrator.Decode`` instead. The
figures at the end are measured here, on the client's clock (the server's own, queue included,
come in the final message's ``timings``). ``--wait_ready S`` first waits up to S seconds for the
server's readiness. Exit 1 with the gRPC status on an error.
"""

from __future__ import annotations

import sys
import time

from absl import flags

from launch import cli
from launch.cli import CliError
from launch.readiness import wait_ready

_TARGET = flags.DEFINE_string("target", "127.0.0.1:9000", "host:port")
_CHAT = flags.DEFINE_bool("chat", False, "send the prompt as a user chat message")
_JETSTREAM = flags.DEFINE_bool("jetstream", False, "use JetStream's Orchestrator.Decode")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "tokens to generate", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", None, "sampling temperature (default greedy)")
_API_KEY = flags.DEFINE_string("api_key", None, "API key (authorization: Bearer)")
_TLS_CA = flags.DEFINE_string("tls_ca", None, "PEM root certificate: connect with TLS")
_WAIT_READY = flags.DEFINE_float("wait_ready", 0.0, "wait this long for readiness first",
                                 lower_bound=0.0)
_TIMEOUT = flags.DEFINE_float("timeout", 600.0, "deadline of the call (s)", lower_bound=0.1)


def _channel(grpc):
  if _TLS_CA.value:
    with open(_TLS_CA.value, "rb") as f:
      creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    return grpc.secure_channel(_TARGET.value, creds)
  return grpc.insecure_channel(_TARGET.value)


def main(argv: list[str]) -> None:
  import grpc
  from serving.api.proto.jetstream import jetstream_pb2 as js
  from serving.api.proto.jetstream import jetstream_pb2_grpc as js_grpc
  from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
  from serving.api.proto.phaseserve.v1 import generation_pb2_grpc as pb_grpc
  if len(argv) != 2:
    raise CliError("give the prompt as the one argument")
  prompt = argv[1]
  channel = _channel(grpc)
  if _WAIT_READY.value:
    wait_ready(channel, _WAIT_READY.value)
  meta = [("authorization", f"Bearer {_API_KEY.value}")] if _API_KEY.value else []
  if _JETSTREAM.value:
    req = js.DecodeRequest(text_content=js.DecodeRequest.TextContent(text=prompt),
                           max_tokens=_MAX_TOKENS.value)
    calls = js_grpc.OrchestratorStub(channel).Decode(req, metadata=meta, timeout=_TIMEOUT.value)
    pieces = ((r.stream_content.samples[0].text, len(r.stream_content.samples[0].token_ids), None)
              for r in calls)
  else:
    req = pb.GenerateRequest(max_tokens=_MAX_TOKENS.value)
    if _CHAT.value:
      req.messages.messages.add(role="user", content=prompt)
    else:
      req.text = prompt
    if _TEMPERATURE.value is not None:
      req.sampling.temperature = _TEMPERATURE.value
    calls = pb_grpc.GenerationStub(channel).Generate(req, metadata=meta, timeout=_TIMEOUT.value)
    pieces = ((r.text, len(r.token_ids), r.final if r.HasField("final") else None) for r in calls)
  t0 = time.monotonic()
  first = None
  tokens = 0
  final = None
  try:
    for text, n, fin in pieces:
      if n and first is None:
        first = time.monotonic()
      tokens += n
      final = fin or final
      sys.stdout.write(text)
      sys.stdout.flush()
  except grpc.RpcError as e:
    print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
    sys.exit(1)
  end = time.monotonic()
  print()
  ttft = (first - t0) if first is not None else float("nan")
  tpot = (end - first) / (tokens - 1) if first is not None and tokens > 1 else float("nan")
  reason = pb.FinishReason.Name(final.finish_reason).lower() if final is not None else "end"
  print(f"--- {tokens} tokens, TTFT {ttft * 1e3:.1f} ms, TPOT {tpot * 1e3:.1f} ms, "
        f"{tokens / (end - t0):.1f} tokens/s, finish reason: {reason}", file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)
