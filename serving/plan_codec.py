"""A safe wire form of the scheduler's ``StepPlan`` (and the other engine-call arguments).

Contract: ``encode(value) -> bytes`` and ``decode(bytes) -> value`` round-trip ``StepPlan``s and
everything in them (``PrefillChunk``, ``DecodeRow``, ``SlotSetup``, ``SamplingParams``,
``Sinks``, ``PageCopy``, ``PageSpill``, ``PageLoad``, ``LoraLoad``), ints, floats, strings, bools, None,
tuples, lists, str-keyed dicts and numpy arrays (dtype and shape kept), exactly:
``decode(encode(p)) == p`` field by field, arrays bit for bit. JSON underneath, so nothing but
these types can come out of ``decode`` (no pickle: a message from the coordinator's key-value
store cannot run code); an unknown type name raises ``ValueError``. Used by
``serving.multihost`` to broadcast each step's plan from process 0 to the others.
"""

from __future__ import annotations

import base64
import dataclasses
import json

import numpy as np

from serving.kv_pages import PageCopy
from serving.lora import LoraLoad
from serving.prefix_cache import PageLoad, PageSpill
from serving.request import Sinks
from serving.sampling import SamplingParams
from serving.scheduler import DecodeRow, PrefillChunk, SlotSetup, StepPlan

_TYPES: dict[str, type] = {t.__name__: t for t in (
    StepPlan, PrefillChunk, DecodeRow, SlotSetup, SamplingParams, Sinks, PageCopy, PageSpill,
    PageLoad, LoraLoad)}


def _to_json(x: object) -> object:
  if x is None or isinstance(x, (bool, str)):
    return x
  if isinstance(x, (int, np.integer)):
    return int(x)
  if isinstance(x, (float, np.floating)):
    return float(x)
  if isinstance(x, tuple):
    return {"t": [_to_json(v) for v in x]}
  if isinstance(x, list):
    return [_to_json(v) for v in x]
  if isinstance(x, np.ndarray):
    return {"nd": base64.b64encode(np.ascontiguousarray(x).tobytes()).decode("ascii"),
            "dtype": x.dtype.str, "shape": list(x.shape)}
  if dataclasses.is_dataclass(x) and type(x).__name__ in _TYPES:
    return {"dc": type(x).__name__,
            "f": {f.name: _to_json(getattr(x, f.name)) for f in dataclasses.fields(x)}}
  if isinstance(x, dict) and all(isinstance(k, str) for k in x):
    return {"d": {k: _to_json(v) for k, v in x.items()}}
  raise TypeError(f"cannot encode {type(x).__name__} for the step broadcast")


def _from_json(x: object) -> object:
  if isinstance(x, list):
    return [_from_json(v) for v in x]
  if not isinstance(x, dict):
    return x
  if "t" in x:
    return tuple(_from_json(v) for v in x["t"])
  if "nd" in x:
    raw = base64.b64decode(x["nd"])
    return np.frombuffer(raw, np.dtype(x["dtype"])).reshape(x["shape"]).copy()
  if "dc" in x:
    cls = _TYPES.get(x["dc"])
    if cls is None:
      raise ValueError(f"unknown type {x['dc']!r} in a step broadcast")
    return cls(**{k: _from_json(v) for k, v in x["f"].items()})
  if "d" in x:
    return {k: _from_json(v) for k, v in x["d"].items()}
  raise ValueError(f"malformed step broadcast value: {sorted(x)}")


def encode(value: object) -> bytes:
  return json.dumps(_to_json(value), separators=(",", ":")).encode()


def decode(data: bytes) -> object:
  return _from_json(json.loads(data))
