"""Waiting for a server's readiness through ``grpc.health.v1`` (shared by the launch clients).

Contract: ``wait_ready(channel, timeout_s, service)`` returns once ``service``'s health is
SERVING, polling every 0.2 s; raises ``CliError`` after ``timeout_s``. No flags here.
"""

from __future__ import annotations

import time

import grpc

from launch.cli import CliError


def wait_ready(channel: grpc.Channel, timeout_s: float,
               service: str = "phaseserve.v1.Generation") -> None:
  from grpc_health.v1 import health_pb2, health_pb2_grpc
  stub = health_pb2_grpc.HealthStub(channel)
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      if stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status == \
          health_pb2.HealthCheckResponse.SERVING:
        return
    except grpc.RpcError:
      pass
    if time.monotonic() > deadline:
      raise CliError(f"not ready after {timeout_s:g} s")
    time.sleep(0.2)
