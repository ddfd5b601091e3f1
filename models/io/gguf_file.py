"""A GGUF file's header parsed in one pass with ``struct``; tensor data memory-mapped.

Contract: ``GGUFFile(path)`` reads a little-endian GGUF v2 / v3 file and offers the part of
``gguf.GGUFReader``'s interface phaseserve reads: ``fields`` (key -> ``Field``: ``types``, the value
type then, for a non-empty array, its element type; ``contents()``: the Python value, a list for
arrays), ``get_field(key)``, ``tensors`` (``Tensor``: ``name``, ``tensor_type``, ``shape`` as
ggml's ``ne`` (uint64), ``n_elements``, ``data``: a view of the memory map shaped as
``GGUFReader`` shapes it, which ``gguf.quants.dequantize`` takes), ``data`` (the
``np.memmap``) and ``path``. Bad input (wrong magic, unsupported version, a big-endian file, a truncated
header, an unknown value type, duplicate keys or tensors) is a ``ValueError``.

Why not ``GGUFReader``: it makes two memory-mapped views per array element, so SmolLM2's header
(49,152 tokens, 48,900 merges, 49,152 token types) took 3.8 s to parse; this takes ~0.1 s.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = 0x46554747  # b"GGUF" read as a little-endian uint32
_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
_PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclasses.dataclass(frozen=True)
class Field:
  name: str
  types: list[GGUFValueType]
  value: Any

  def contents(self) -> Any:
    return self.value


@dataclasses.dataclass(frozen=True)
class Tensor:
  name: str
  tensor_type: GGMLQuantizationType
  shape: np.ndarray  # ggml's ne (innermost first), uint64
  n_elements: int
  data: np.ndarray


class _Cursor:
  def __init__(self, buf: memoryview):
    self.buf, self.pos = buf, 0

  def unpack(self, fmt: str) -> Any:
    (v,) = struct.unpack_from(fmt, self.buf, self.pos)
    self.pos += struct.calcsize(fmt)
    return v

  def string(self) -> str:
    n = int(self.unpack("<Q"))
    if self.pos + n > len(self.buf):
      raise ValueError("a string runs past the end of the file")
    s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
    self.pos += n
    return s

  def value(self, vtype: GGUFValueType) -> tuple[object, list[GGUFValueType]]:
    if vtype == GGUFValueType.STRING:
      return self.string(), [vtype]
    if vtype in _SCALARS:
      return self.unpack(_SCALARS[vtype]), [vtype]
    if vtype != GGUFValueType.ARRAY:
      raise ValueError(f"unknown value type {vtype}")
    etype = GGUFValueType(self.unpack("<I"))
    n = int(self.unpack("<Q"))
    if etype in _SCALARS and etype != GGUFValueType.BOOL:
      dt = np.dtype(_SCALARS[etype])
      end = self.pos + n * dt.itemsize
      if end > len(self.buf):
        raise ValueError("an array runs past the end of the file")
      out = np.frombuffer(self.buf, dt, n, self.pos).tolist()
      self.pos = end
    elif etype == GGUFValueType.STRING:
      out = [self.string() for _ in range(n)]
    else:
      out = [self.value(etype)[0] for _ in range(n)]
    return out, [vtype, etype] if n else [vtype]


class GGUFFile:
  """See the module contract."""

  def __init__(self, path: str | os.PathLike[str]):
    self.path = os.fspath(path)
    self.data = np.memmap(path, mode="r")
    cur = _Cursor(memoryview(self.data))
    try:
      if cur.unpack("<I") != _MAGIC:
        raise ValueError("GGUF magic invalid (or a big-endian file, which is not supported)")
      version = cur.unpack("<I")
      if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
      n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
      self.fields: dict[str, Field] = {}
      for _ in range(int(n_kv)):
        key = cur.string()
        value, types = cur.value(GGUFValueType(cur.unpack("<I")))
        if key in self.fields:
          raise ValueError(f"duplicate metadata key {key!r}")
        self.fields[key] = Field(key, types, value)
      infos = []
      for _ in range(int(n_tensors)):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(int(cur.unpack("<I")))]
        infos.append((name, dims, GGMLQuantizationType(cur.unpack("<I")), cur.unpack("<Q")))
    except struct.error as e:
      raise ValueError(f"truncated header ({e})") from None
    align = self.fields.get("general.alignment")
    alignment = 32 if align is None else align.value
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
      raise ValueError(f"bad general.alignment {alignment!r}")
    start = -(-cur.pos // alignment) * alignment
    self.tensors: list[Tensor] = []
    seen: set[str] = set()
    for name, dims, ttype, offset in infos:
      if name in seen:
        raise ValueError(f"duplicate tensor {name!r}")
      seen.add(name)
      n = int(np.prod(dims, dtype=np.int64)) if dims else 1
      shape = tuple(reversed([int(d) for d in dims]))
      if ttype in _PLAIN:
        dt, count = np.dtype(_PLAIN[ttype]), n
      else:
        block, size = GGML_QUANT_SIZES[ttype]
        dt, count, shape = np.dtype(np.uint8), n * size // block, \
            quant_shape_to_byte_shape(shape, ttype)
      at = start + int(offset)
      if at + count * dt.itemsize > len(self.data):
        raise ValueError(f"tensor {name!r} runs past the end of the file")
      data = self.data[at:at + count * dt.itemsize].view(dt).reshape(shape)
      self.tensors.append(Tensor(name, ttype, np.asarray(dims, np.uint64), n, data))

  def get_field(self, key: str) -> Field | None:
    return self.fields.get(key)
