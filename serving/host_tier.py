"""The host-memory tier's storage (Mooncake's DRAM tier): KV pages the device cache spilled.

Contract: ``HostStore()`` maps a key (an int the prefix cache hands out) to one page's K and V
(every layer). The engine ``put``s a spilled page as device arrays whose host copy it has
started (``copy_to_host_async``); ``materialize()`` (called at the start of the next step,
whatever that step plans) turns them into numpy arrays and drops the device buffers, so the copy
overlaps a step and device memory is given back; ``pending`` counts the entries still held as
device arrays. ``take(key)`` returns (and removes) a page's data for a load back onto the device;
``discard(key)`` forgets one (host-tier eviction). ``nbytes`` is what the tier holds. The budget
and the LRU order are the prefix cache's (``serving.prefix_cache``); this is only the bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class HostStore:
  def __init__(self):
    self._data: dict[int, tuple[Any, ...]] = {}
    self._device: set[int] = set()  # keys still held as device arrays

  def __contains__(self, key: int) -> bool:
    return key in self._data

  def __len__(self) -> int:
    return len(self._data)

  def put(self, key: int, parts: tuple[Any, ...]) -> None:
    self._data[key] = parts
    if not all(isinstance(p, np.ndarray) for p in parts):
      self._device.add(key)

  @property
  def pending(self) -> int:
    return len(self._device)

  def materialize(self) -> None:
    for key in list(self._device):
      if key in self._data:
        self._data[key] = tuple(np.asarray(p) for p in self._data[key])
    self._device.clear()

  def take(self, key: int) -> tuple[np.ndarray, ...]:
    parts = self._data.pop(key)
    self._device.discard(key)
    return tuple(np.asarray(p) for p in parts)

  def discard(self, key: int) -> None:
    self._data.pop(key, None)
    self._device.discard(key)

  @property
  def nbytes(self) -> int:
    return sum(int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize
               for parts in self._data.values() for p in parts)

  def clear(self) -> None:
    """Forgets every page (a rebuilt prefix cache hands out keys anew)."""
    self._data.clear()
    self._device.clear()
