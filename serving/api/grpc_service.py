"""The ``phaseserve.v1.Generation`` servicer: proto messages in and out, nothing else.

Contract: ``GenerationServicer(frontend, keys, info)``; ``handlers()`` returns the gRPC generic
handler (registered by ``serving.api.grpc_server``). Every method authenticates first
(``authorization: Bearer <key>`` metadata; UNAUTHENTICATED), then translates: a
``GenerateRequest`` becomes ``serving.api.validation.GenerateArgs`` (proto3 ``optional`` fields
absent -> ``None``), ``Frontend.generate`` admits it, and each output becomes a
``GenerateResponse`` (the sample's last one with ``final``). A final's ``usage`` is its
sample's: ``prompt_tokens`` the request's prompt (the same in every sample, billed once per
request), its own ``cached_tokens`` and ``completion_tokens``; the request's usage (the usage
record's, ``Frontend``'s one rule) is sample 0's prompt and cached tokens plus the completion
tokens summed over the samples. ``ServiceError`` statuses map to
gRPC codes (``STATUS_CODES``). A client cancel or an expired deadline cancels the request in the
loop (its pages are free before the next step). A request protobuf refuses to parse because a
string field is not UTF-8 is answered INVALID_ARGUMENT naming the field (``serving.api.wire_utf8``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Mapping

import grpc

from serving.api.auth import ApiKeys, KeyInfo, Unauthenticated
from serving.api.frontend import Frontend
from serving.api.stream import ServiceError, Status, Stream
from serving.api.proto.phaseserve.v1 import generation_pb2 as pb
from serving.request import RequestOutput
from serving.stop import FinishReason
from models.text.chat_encode import ChatOptions
from serving.api.validation import GenerateArgs, InvalidArgument, chat_messages
from serving.api.wire_utf8 import bad_utf8_field

SERVICE = "phaseserve.v1.Generation"

STATUS_CODES = {
    Status.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Status.REJECTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Status.CANCELLED: grpc.StatusCode.CANCELLED,
    Status.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Status.SLOW_CONSUMER: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Status.ERROR: grpc.StatusCode.INTERNAL,
    Status.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Status.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
}
_FINISH = {FinishReason.STOP: pb.STOP, FinishReason.LENGTH: pb.LENGTH,
           FinishReason.CANCELLED: pb.CANCELLED}


@dataclasses.dataclass(frozen=True)
class Undecodable:
  """A request that did not parse; ``message`` says why (the field, when it is known)."""
  message: str


def lenient(cls) -> Callable[[bytes], object]:
  def parse(data: bytes):
    try:
      return cls.FromString(data)
    except Exception:  # protobuf's DecodeError; the message does not name the field
      field = bad_utf8_field(data, cls.DESCRIPTOR)
      return Undecodable(f"{field}: invalid UTF-8" if field else "the request does not parse")
  return parse


def generic_handler(service: str, methods: Mapping[str, tuple[Callable, type, bool]]
                    ) -> grpc.GenericRpcHandler:
  """The generic handler of ``service``: name -> (behaviour, request class, server-streaming),
  each request parsed leniently (``Undecodable`` instead of an exception)."""
  ser = lambda m: m.SerializeToString()
  make = {True: grpc.unary_stream_rpc_method_handler, False: grpc.unary_unary_rpc_method_handler}
  return grpc.method_handlers_generic_handler(service, {
      name: make[stream](fn, lenient(cls), ser) for name, (fn, cls, stream) in methods.items()})


def authenticate(keys: ApiKeys, context: grpc.ServicerContext) -> KeyInfo:
  meta = dict(context.invocation_metadata())
  auth = meta.get("authorization", "")
  key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
  try:
    return keys.authenticate(key)
  except Unauthenticated as e:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
    raise  # not reached: abort raises


def parsed(request: object, context: grpc.ServicerContext):
  if isinstance(request, Undecodable):
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
  return request


_DEADLINE_SLACK_S = 0.25


def watch(stream: Stream, context: grpc.ServicerContext) -> None:
  """Cancels ``stream`` when the RPC ends before it (client cancel, disconnect, deadline)."""
  def done():
    if not stream.ended:
      remaining = context.time_remaining()
      # The client's deadline timer fires first and cancels the call, while the server's copy of
      # the deadline began when the call arrived, later: on a loaded machine the server still
      # reads some time remaining (seen once in a fresh-clone suite: counted as cancelled).
      # Within _DEADLINE_SLACK_S of it, the deadline ended the RPC.
      if remaining is not None and remaining <= _DEADLINE_SLACK_S:
        stream.cancel(Status.DEADLINE_EXCEEDED, "the deadline expired")
      else:
        stream.cancel(Status.CANCELLED, "cancelled by the client")
  if not context.add_callback(done):
    done()


def _args(r: pb.GenerateRequest) -> GenerateArgs:
  kind = r.WhichOneof("prompt")
  s = r.sampling
  opt = lambda msg, name: getattr(msg, name) if msg.HasField(name) else None
  return GenerateArgs(
      text=r.text if kind == "text" else None,
      token_ids=list(r.token_ids.ids) if kind == "token_ids" else None,
      messages=[(m.role, m.content) for m in r.messages.messages] if kind == "messages" else None,
      max_tokens=opt(r, "max_tokens"), temperature=opt(s, "temperature"), top_k=opt(s, "top_k"),
      top_p=opt(s, "top_p"), seed=opt(s, "seed"), presence_penalty=opt(s, "presence_penalty"),
      frequency_penalty=opt(s, "frequency_penalty"),
      repetition_penalty=opt(s, "repetition_penalty"), logit_bias=dict(s.logit_bias) or None,
      stop=list(r.stop),
      stop_token_ids=list(r.stop_token_ids), min_tokens=opt(r, "min_tokens"),
      ignore_eos=r.ignore_eos, logprobs=opt(r, "logprobs"), n=opt(r, "n"), priority=r.priority,
      slo_class=r.slo_class or None, session_id=r.session_id,
      sinks_window=r.attention_sinks.window if r.HasField("attention_sinks") else None,
      sinks=opt(r.attention_sinks, "sinks") if r.HasField("attention_sinks") else None,
      lora=r.lora_adapter)


def _timings(t: Mapping[str, float | None]) -> pb.Timings:
  return pb.Timings(**{k: v for k, v in t.items() if v is not None})


def _response(stream: Stream, index: int, out: RequestOutput) -> pb.GenerateResponse:
  resp = pb.GenerateResponse(request_id=stream.request_id, index=index,
                             token_ids=list(out.token_ids), text=out.text)
  for lp in out.logprobs:
    resp.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                      top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top])
  if out.finished and out.finish_reason in _FINISH:
    resp.final.CopyFrom(pb.Final(
        finish_reason=_FINISH[out.finish_reason], message=out.message,
        usage=pb.Usage(prompt_tokens=len(stream.validated.prompt_ids),
                       cached_tokens=out.usage.cached_tokens if out.usage else 0,
                       completion_tokens=stream.completion[index]),
        timings=_timings(stream.traces[index].timings())))
  return resp


class GenerationServicer:
  def __init__(self, frontend: Frontend, keys: ApiKeys, info: pb.ServerInfoResponse):
    self.frontend = frontend
    self.keys = keys
    self.info = info

  def Generate(self, request, context) -> Iterator[pb.GenerateResponse]:
    key = authenticate(self.keys, context)
    request = parsed(request, context)
    try:
      stream = self.frontend.generate(_args(request), key, request.client_request_id)
    except ServiceError as e:
      context.abort(STATUS_CODES[e.status], e.message)
    watch(stream, context)
    try:
      for index, out in stream.events():
        if out.token_ids or out.text or out.finish_reason in _FINISH:
          yield _response(stream, index, out)
    except ServiceError as e:
      context.abort(STATUS_CODES[e.status], e.message)

  def Tokenize(self, request, context) -> pb.TokenizeResponse:
    authenticate(self.keys, context)
    request = parsed(request, context)
    tok = self.frontend.tokenizer
    kind = request.WhichOneof("input")
    if kind == "messages":
      try:
        ids = tok.encode_chat(
            chat_messages([(m.role, m.content) for m in request.messages.messages]),
            ChatOptions(special_in_content=self.frontend.config.limits.special_in_messages))
      except InvalidArgument as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
      except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"messages: {e}")
    else:
      ids = tok.encode(request.text)
      if request.add_bos and tok.bos_id is not None:
        ids = [tok.bos_id] + ids
    return pb.TokenizeResponse(token_ids=ids)

  def Detokenize(self, request, context) -> pb.DetokenizeResponse:
    authenticate(self.keys, context)
    request = parsed(request, context)
    vocab = self.frontend.tokenizer.vocab_size
    wrong = next((t for t in request.token_ids if not 0 <= t < vocab), None)
    if wrong is not None:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                    f"token_ids: token id {wrong} is outside the vocabulary [0, {vocab})")
    return pb.DetokenizeResponse(text=self.frontend.tokenizer.decode(list(request.token_ids)))

  def ServerInfo(self, request, context) -> pb.ServerInfoResponse:
    authenticate(self.keys, context)
    return self.info

  def handlers(self) -> grpc.GenericRpcHandler:
    return generic_handler(SERVICE, {
        "Generate": (self.Generate, pb.GenerateRequest, True),
        "Tokenize": (self.Tokenize, pb.TokenizeRequest, False),
        "Detokenize": (self.Detokenize, pb.DetokenizeRequest, False),
        "ServerInfo": (self.ServerInfo, pb.ServerInfoRequest, False)})
