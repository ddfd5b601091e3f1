"""OpenAI's error shape and the request body's decoding, for the HTTP front end (no I/O).

Contract: ``ApiError(status, message, type_, param, code, headers)`` is an answer in OpenAI's error
shape (``body()``); ``bad(field, message)`` a 400 naming the field; ``api_error(ServiceError)``
maps a Frontend status to its HTTP status and OpenAI error type (``STATUS``), with Retry-After on
429 / 503. ``decode_body(bytes)``: the JSON body; invalid JSON, a string that is not valid UTF-8
(named by its field), nesting too deep or an integer literal too long to convert is a 400.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from serving.api.stream import ServiceError, Status


class ApiError(Exception):
  """An answer in OpenAI's error shape: ``{"error": {message, type, param, code}}``."""

  def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
               param: str | None = None, code: str | None = None,
               headers: Mapping[str, str] | None = None):
    super().__init__(message)
    self.status = status
    self.message = message
    self.type = type_
    self.param = param
    self.code = code
    self.headers = dict(headers or {})

  def body(self) -> dict[str, Any]:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def bad(field: str, message: str) -> ApiError:
  return ApiError(400, f"{field}: {message}", param=field)


# (HTTP status, OpenAI error type) per Frontend status.
STATUS: dict[Status, tuple[int, str]] = {
    Status.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Status.REJECTED: (429, "rate_limit_error"),
    Status.SLOW_CONSUMER: (408, "timeout_error"),
    Status.CANCELLED: (499, "cancelled"),
    Status.DEADLINE_EXCEEDED: (504, "timeout_error"),
    Status.ERROR: (500, "server_error"),
    Status.UNAVAILABLE: (503, "service_unavailable"),
    Status.NOT_FOUND: (404, "invalid_request_error"),
}
# Retry-After (seconds) of a 429 by refusal reason: a quota's window is 60 s, so the requests it
# holds now have all left it after 60 s; the queue and the SLO predictor change step by step.
RETRY_AFTER = {"quota": 60, "queue_full": 1, "slo": 1}
UNAVAILABLE_RETRY_AFTER = 5


def api_error(e: ServiceError) -> ApiError:
  status, type_ = STATUS[e.status]
  headers = {}
  if e.status is Status.REJECTED:
    headers["Retry-After"] = str(RETRY_AFTER.get(e.reason, 1))
  elif e.status is Status.UNAVAILABLE:
    headers["Retry-After"] = str(UNAVAILABLE_RETRY_AFTER)
  param = None
  if e.status is Status.INVALID_ARGUMENT:
    head = e.message.split(":", 1)[0]
    param = head if head and " " not in head else None
  elif e.status is Status.NOT_FOUND:
    param = "model"
  return ApiError(status, e.message, type_, param, e.reason or e.status.value, headers)


# -- requests -----------------------------------------------------------------------------------


class _LongInt(str):
  """An integer literal too long to be a number any field takes (kept as its digits)."""


_MAX_DIGITS = 1000  # far above any field's range (seeds are 64-bit: 20 digits)


def _parse_int(digits: str) -> int | _LongInt:
  return _LongInt(digits) if len(digits.lstrip("-")) > _MAX_DIGITS else int(digits)


def _bad_value(v: Any, path: str) -> tuple[str, str] | None:
  """(path, problem) of the first value under ``v`` that is not acceptable: a string that is not
  valid Unicode (a surrogate: invalid UTF-8 bytes decoded with surrogateescape, or a lone
  ``\\ud800`` escape), or an integer literal of more than ``_MAX_DIGITS`` digits."""
  if isinstance(v, _LongInt):
    return path, f"an integer of {len(v.lstrip('-'))} digits is out of range"
  if isinstance(v, str):
    return (path, "invalid UTF-8") if any("\ud800" <= ch <= "\udfff" for ch in v) else None
  if isinstance(v, list):
    for i, x in enumerate(v):
      found = _bad_value(x, f"{path}[{i}]")
      if found:
        return found
  if isinstance(v, dict):
    for k, x in v.items():
      if _bad_value(k, "") is not None:
        return "", "the request body is not valid UTF-8 (in a field name)"
      found = _bad_value(x, f"{path}.{k}" if path else k)
      if found:
        return found
  return None


def decode_body(data: bytes) -> Any:
  """The JSON request body; a bad value is a 400 naming its field, as the gRPC service names a
  proto field."""
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError:
    text = data.decode("utf-8", "surrogateescape")  # located below, by field
  try:
    body = json.loads(text, parse_int=_parse_int)
    found = _bad_value(body, "")
  except json.JSONDecodeError as e:
    raise ApiError(400, f"the request body is not valid JSON: {e}") from None
  except RecursionError:
    raise ApiError(400, "the request body is nested too deeply") from None
  if found is None:
    return body
  field, problem = found
  if not field:
    raise ApiError(400, problem)
  raise bad(field, problem)
