"""One gRPC server: phaseserve's API, JetStream's, health and reflection on one port.

Contract: ``serve(frontend, keys, info, ServerOptions) -> Running`` binds ``host:port`` (port 0:
any free one; ``Running.port`` is the bound one) and starts serving at once, so health can be
polled while the model warms up. Health (``grpc.health.v1.Health``): the empty service name is
liveness (SERVING unless the engine failed), ``phaseserve.v1.Generation`` and
``jetstream_proto.Orchestrator`` are readiness (SERVING only in the front end's ``serving``
state: NOT_SERVING while loading and warming up, draining or failed). Server reflection lists
every service. Messages over ``max_message_bytes`` are refused by gRPC with RESOURCE_EXHAUSTED.
At most ``max_concurrent_rpcs`` calls of the two APIs run at once (the rest get
RESOURCE_EXHAUSTED at once); health and reflection are outside that bound, on threads of their
own, so a server busy with that many streams still answers its probes.
TLS when ``tls_cert`` and ``tls_key`` (PEM files) are given.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.api import grpc_service, jetstream_service
from serving.api.auth import ApiKeys
from serving.api.frontend import Frontend
from serving.api.proto.jetstream import jetstream_pb2
from serving.api.proto.phaseserve.v1 import generation_pb2
from serving.api.thread_pool import ElasticThreadPool


@dataclasses.dataclass(frozen=True)
class ServerOptions:
  host: str = "127.0.0.1"
  port: int = 0
  max_message_bytes: int = 4 << 20
  max_concurrent_rpcs: int = 512
  tls_cert: str | None = None
  tls_key: str | None = None


@dataclasses.dataclass
class Running:
  server: grpc.Server
  port: int
  health: health.HealthServicer


_READINESS = (grpc_service.SERVICE, jetstream_service.SERVICE)
_SPARE_THREADS = 8  # for health, reflection and the calls turned away at the bound


class _ApiCallLimit(grpc.ServerInterceptor):
  """At most ``limit`` calls of the bounded services at once, each refused past it with
  RESOURCE_EXHAUSTED; other services (health, reflection) pass untouched. (gRPC's own
  ``maximum_concurrent_rpcs`` counts every call, health checks included.)"""

  def __init__(self, limit: int, services: tuple[str, ...]):
    self._slots = threading.BoundedSemaphore(limit)
    self._limit = limit
    self._prefixes = tuple(f"/{s}/" for s in services)

  def intercept_service(self, continuation, details):
    handler = continuation(details)
    if handler is None or not details.method.startswith(self._prefixes):
      return handler
    for kind, make in (("unary_unary", grpc.unary_unary_rpc_method_handler),
                       ("unary_stream", grpc.unary_stream_rpc_method_handler),
                       ("stream_unary", grpc.stream_unary_rpc_method_handler),
                       ("stream_stream", grpc.stream_stream_rpc_method_handler)):
      behaviour = getattr(handler, kind)
      if behaviour is not None:
        guarded = (self._streaming(behaviour) if handler.response_streaming
                   else self._unary(behaviour))
        return make(guarded, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
    return handler

  def _enter(self, context: grpc.ServicerContext) -> None:
    if not self._slots.acquire(blocking=False):
      context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"too many concurrent calls (at most {self._limit})")

  def _unary(self, fn: Callable) -> Callable:
    def run(request, context):
      self._enter(context)
      try:
        return fn(request, context)
      finally:
        self._slots.release()
    return run

  def _streaming(self, fn: Callable) -> Callable:
    def run(request, context):
      self._enter(context)
      try:
        yield from fn(request, context)
      finally:
        self._slots.release()
    return run


def serve(frontend: Frontend, keys: ApiKeys, info: generation_pb2.ServerInfoResponse,
          options: ServerOptions) -> Running:
  limit = _ApiCallLimit(options.max_concurrent_rpcs,
                        (grpc_service.SERVICE, jetstream_service.SERVICE))
  server = grpc.server(
      # Grows with the calls in flight and lets idle threads go (ThreadPoolExecutor keeps the
      # highest count it ever reached: a soak saw 29 -> 295 threads, 3 mappings each).
      ElasticThreadPool(options.max_concurrent_rpcs + _SPARE_THREADS, name="grpc"),
      interceptors=(limit,),
      options=[("grpc.max_receive_message_length", options.max_message_bytes),
               ("grpc.max_send_message_length", options.max_message_bytes),
               ("grpc.so_reuseport", 0)])
  server.add_generic_rpc_handlers((
      grpc_service.GenerationServicer(frontend, keys, info).handlers(),
      jetstream_service.OrchestratorServicer(frontend, keys).handlers()))
  hs = health.HealthServicer(experimental_non_blocking=True)
  health_pb2_grpc.add_HealthServicer_to_server(hs, server)
  names = (generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
           jetstream_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name,
           health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
  reflection.enable_server_reflection(names, server)

  def on_state(state: str) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    hs.set("", not_serving if state == "failed" else serving)
    for name in _READINESS:
      hs.set(name, serving if state == "serving" else not_serving)

  frontend.on_state(on_state)
  address = f"{options.host}:{options.port}"
  if options.tls_cert or options.tls_key:
    if not (options.tls_cert and options.tls_key):
      raise ValueError("TLS needs both a certificate and a key")
    with open(options.tls_key, "rb") as f:
      key = f.read()
    with open(options.tls_cert, "rb") as f:
      cert = f.read()
    port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
  else:
    port = server.add_insecure_port(address)
  if port == 0:
    raise OSError(f"cannot bind {address}")
  server.start()
  return Running(server, port, hs)
