"""Finds the string field holding invalid UTF-8 in a serialized protobuf message.

Contract: ``bad_utf8_field(data, descriptor) -> str | None`` walks the wire format of ``data``
against the message ``descriptor`` (recursing into message fields) and returns the dotted name
of the first ``string`` field whose bytes are not valid UTF-8 (``None`` when there is none or the
bytes are not a parsable message). protobuf itself refuses such a message without naming the
field; the servicers use this to answer INVALID_ARGUMENT naming it.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor


def _varint(data: bytes, i: int) -> tuple[int, int]:
  shift = result = 0
  while True:
    if i >= len(data):
      raise ValueError("truncated varint")
    b = data[i]
    result |= (b & 0x7F) << shift
    i += 1
    if not b & 0x80:
      return result, i
    shift += 7


def bad_utf8_field(data: bytes, descriptor: Descriptor, prefix: str = "") -> str | None:
  try:
    i = 0
    while i < len(data):
      tag, i = _varint(data, i)
      number, wire = tag >> 3, tag & 7
      if wire == 0:
        _, i = _varint(data, i)
      elif wire == 1:
        i += 8
      elif wire == 5:
        i += 4
      elif wire == 2:
        size, i = _varint(data, i)
        chunk, i = data[i:i + size], i + size
        field = descriptor.fields_by_number.get(number)
        if field is None:
          continue
        name = prefix + field.name
        if field.type == FieldDescriptor.TYPE_STRING:
          try:
            chunk.decode("utf-8")
          except UnicodeDecodeError:
            return name
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
          inner = bad_utf8_field(chunk, field.message_type, name + ".")
          if inner is not None:
            return inner
      else:
        return None
  except ValueError:
    return None
  return None
