"""JetStream's ``jetstream_proto.Orchestrator`` (``Decode``, ``HealthCheck``) on our engine.

Contract: wire-compatible with JetStream's published ``jetstream/core/proto/jetstream.proto``
(``serving/api/proto/jetstream/jetstream.proto`` is that file, unchanged), so its clients work as they
are. Behaviour kept from JetStream: every message is ``stream_content`` with one ``Sample`` per
sample (``num_samples``; 0 means 1), token-id requests get ``token_ids`` only, text requests
``text`` and ``token_ids``; the id that ends a sample is in its last ``token_ids``; a BOS is
prepended (text and token requests alike) unless ``has_bos``, when the tokenizer has one.
Better than JetStream: an over-long prompt (or prompt + max_tokens over the context) is
INVALID_ARGUMENT, never truncated; ``max_tokens`` 0 is INVALID_ARGUMENT; an unknown
``lora_adapter_id`` (a LoRA adapter's name: the request runs under it) is NOT_FOUND, not
ignored; a
cancelled stream frees its sequence; the queue is bounded (RESOURCE_EXHAUSTED).
``metadata.start_time`` is the client's own clock and is not read. ``HealthCheck`` answers
``is_live`` = the service is serving.
"""

from __future__ import annotations

from typing import Iterator

import grpc

from serving.api.auth import ApiKeys
from serving.api.frontend import Frontend
from serving.api.stream import ServiceError
from serving.api.grpc_service import STATUS_CODES, authenticate, generic_handler, parsed, watch
from serving.api.proto.jetstream import jetstream_pb2 as js
from serving.api.validation import GenerateArgs

SERVICE = "jetstream_proto.Orchestrator"
_FIELDS = {"text": "text_content", "token_ids": "token_content", "n": "num_samples",
           "prompt": "content"}


class OrchestratorServicer:
  def __init__(self, frontend: Frontend, keys: ApiKeys):
    self.frontend = frontend
    self.keys = keys

  def Decode(self, request, context) -> Iterator[js.DecodeResponse]:
    key = authenticate(self.keys, context)
    request = parsed(request, context)
    tok = self.frontend.tokenizer
    kind = request.WhichOneof("content")
    bos = [tok.bos_id] if not request.has_bos and tok.bos_id is not None else []
    if kind == "token_content":
      ids = list(request.token_content.token_ids)
      args = GenerateArgs(token_ids=bos + ids if ids else ids, max_tokens=request.max_tokens,
                          n=request.num_samples, lora=request.lora_adapter_id)
    else:
      args = GenerateArgs(text=request.text_content.text if kind else None,
                          add_bos=not request.has_bos, max_tokens=request.max_tokens,
                          n=request.num_samples, lora=request.lora_adapter_id)
    with_text = kind == "text_content"
    try:
      stream = self.frontend.generate(args, key, api="jetstream", field_names=_FIELDS)
    except ServiceError as e:
      context.abort(STATUS_CODES[e.status], e.message)
    watch(stream, context)
    n = stream.validated.n
    try:
      for index, out in stream.events():
        if not out.token_ids and not out.text:
          continue
        samples = [js.DecodeResponse.StreamContent.Sample() for _ in range(n)]
        samples[index].token_ids.extend(out.token_ids)
        if with_text:
          samples[index].text = out.text
        yield js.DecodeResponse(stream_content=js.DecodeResponse.StreamContent(samples=samples))
    except ServiceError as e:
      context.abort(STATUS_CODES[e.status], e.message)

  def HealthCheck(self, request, context) -> js.HealthCheckResponse:
    return js.HealthCheckResponse(is_live=self.frontend.state == "serving")

  def handlers(self) -> grpc.GenericRpcHandler:
    return generic_handler(SERVICE, {"Decode": (self.Decode, js.DecodeRequest, True),
                                     "HealthCheck": (self.HealthCheck, js.HealthCheckRequest,
                                                     False)})
