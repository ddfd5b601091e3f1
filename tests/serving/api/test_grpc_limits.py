"""serving.api.grpc_server's call bound over the FakeEngine, in process: the bound covers the two
APIs, never health, and a call's permit comes back when it ends (finished or cancelled)."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.api import grpc_server
from serving.api.auth import ApiKeys
from serving.api.frontend import FrontendConfig
from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
from serving.api.proto.phaseserve.v1 import generation_pb2_grpc as pb_grpc
from tests.serving.api.test_frontend import LIMITS, _frontend, _slow


@pytest.fixture
def server():
  fe = _frontend(config=FrontendConfig(LIMITS, early_reject=False))
  fe.loop.engine.execute = _slow(fe.loop.engine.execute, 0.01)
  running = grpc_server.serve(fe, ApiKeys.none(), pb.ServerInfoResponse(),
                              grpc_server.ServerOptions(max_concurrent_rpcs=2))
  channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
  try:
    yield fe, channel
  finally:
    channel.close()
    running.server.stop(None)
    fe.loop.stop(timeout=5)


def _generate(stub, max_tokens=40):
  return stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]),
                                          max_tokens=max_tokens, ignore_eos=True), timeout=30)


def test_busy_server_still_answers_health_and_refuses_past_the_bound(server):
  fe, channel = server
  stub, health = pb_grpc.GenerationStub(channel), health_pb2_grpc.HealthStub(channel)
  live = [_generate(stub) for _ in range(2)]
  for call in live:
    next(call)  # both are streaming: two of the two permits held
  with pytest.raises(grpc.RpcError) as e:
    next(_generate(stub))
  assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
  assert "too many concurrent calls" in e.value.details()
  for service in ("", "phaseserve.v1.Generation"):  # liveness and readiness, while busy
    assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING
  for call in live:
    call.cancel()
  deadline = time.monotonic() + 10
  while fe.live and time.monotonic() < deadline:
    time.sleep(0.02)
  # The permits are back: a new call runs to its end.
  outs = list(_generate(stub, max_tokens=3))
  assert sum(len(o.token_ids) for o in outs) == 3
