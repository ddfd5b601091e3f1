"""Multi-LoRA serving's host side: which adapters exist, and which sit in the device's slots.

Contract:
  * ``LoraRef(name, uid)``: an adapter as a request names it; ``uid`` is unique per load, so
    an adapter unloaded and loaded again under its name is a new adapter (its KV is never
    reused: the prefix cache keys on ``uid``).
  * ``LoraRegistry(cfg, max_rank=, max_cpu_loras=)``: thread-safe. ``load(name, path)`` reads a
    PEFT adapter (``models.io.peft``; rank at most ``max_rank``, the device slots' rank);
    ``unload(name)``; ``resolve(name)`` -> ``LoraRef`` or ``LookupError`` naming the adapters
    there are; ``weights(uid)`` the adapter's arrays padded to ``slot_rank`` (``max_rank``
    rounded up to 16, the native kernel's multiple; zeros change nothing). At most
    ``max_cpu_loras`` adapters' arrays stay in host memory (least recently used dropped, read
    again from their files when next used, also after an unload, for requests admitted
    before it).
  * ``LoraSlots(max_loras)``: the scheduler's view of the ``max_loras`` device slots: an
    adapter holds a slot while a running sequence uses it (``acquire`` / ``release``); a slot
    nobody uses is given to another adapter, least recently used first; ``take_loads()``: the
    slots to fill before the next step (``LoraLoad``). Pure bookkeeping: no JAX.
  * ``LoraConfig`` (the flags: ``--lora_modules``, ``--max_loras``, ``--max_lora_rank``,
    ``--max_cpu_loras``; 0 is auto) and ``build_registry(cfg, LoraConfig)`` -> the registry with
    the start-up adapters loaded and the device slots to make (None, 0: no adapters served).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import threading

import numpy as np

from models.config import ModelConfig
from models.io.peft import Adapter, adapter_rank, load_peft_adapter


@dataclasses.dataclass(frozen=True)
class LoraRef:
  name: str
  uid: int


@dataclasses.dataclass(frozen=True)
class LoraLoad:
  """Fill device slot ``slot`` with adapter ``uid`` before the step runs."""
  slot: int
  uid: int


@dataclasses.dataclass
class _Entry:
  ref: LoraRef
  path: str
  rank: int
  adapter: Adapter | None  # None: dropped from host memory (read again when used)


class LoraRegistry:
  """See the module contract."""

  def __init__(self, cfg: ModelConfig, *, max_rank: int, max_cpu_loras: int):
    if max_rank < 1 or max_cpu_loras < 1:
      raise ValueError("max_lora_rank and max_cpu_loras must be >= 1")
    self.cfg = cfg
    self.max_rank = max_rank
    self.max_cpu_loras = max_cpu_loras
    self._lock = threading.Lock()
    self._by_name: dict[str, _Entry] = {}
    self._by_uid: dict[int, _Entry] = {}
    self._host: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU order
    self._uids = itertools.count(1)

  def _read(self, path: str) -> Adapter:
    ad = load_peft_adapter(path, self.cfg)
    if ad.rank > self.max_rank:
      raise ValueError(f"adapter {path} has rank {ad.rank}, above --max_lora_rank "
                       f"{self.max_rank}")
    return ad

  def load(self, name: str, path: str | os.PathLike) -> LoraRef:
    """Reads and registers an adapter (``ValueError`` / ``FileNotFoundError`` with the cause;
    ``KeyError`` for a name already loaded)."""
    if not name or any(c.isspace() for c in name):
      raise ValueError(f"adapter name {name!r} must be non-empty, without spaces")
    ad = self._read(str(path))  # outside the lock: file reads
    with self._lock:
      if name in self._by_name:
        raise KeyError(f"adapter {name!r} is already loaded")
      e = _Entry(LoraRef(name, next(self._uids)), str(path), ad.rank, ad)
      self._by_name[name] = self._by_uid[e.ref.uid] = e
      self._touch(e)
      return e.ref

  def unload(self, name: str) -> LoraRef:
    """Forgets ``name`` (``LookupError`` if unknown); requests already holding it finish."""
    with self._lock:
      e = self._by_name.pop(name, None)
      if e is None:
        raise LookupError(self._unknown(name))
      return e.ref

  def resolve(self, name: str) -> LoraRef:
    with self._lock:
      e = self._by_name.get(name)
      if e is None:
        raise LookupError(self._unknown(name))
      return e.ref

  def _unknown(self, name: str) -> str:
    have = ", ".join(sorted(self._by_name)) or "none"
    return f"unknown LoRA adapter {name!r} (loaded: {have})"

  @property
  def slot_rank(self) -> int:
    return -(-self.max_rank // 16) * 16

  def names(self) -> list[LoraRef]:
    with self._lock:
      return sorted((e.ref for e in self._by_name.values()), key=lambda r: r.name)

  def listing(self) -> list[tuple[LoraRef, str]]:
    """(adapter, its directory) by name, read at once (a concurrent unload cannot split it)."""
    with self._lock:
      return sorted(((e.ref, e.path) for e in self._by_name.values()), key=lambda x: x[0].name)

  def weights(self, uid: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Adapter ``uid``'s ``a`` / ``b`` at ``max_rank`` (read again if dropped from memory)."""
    with self._lock:
      e = self._by_uid[uid]
      ad = e.adapter
    if ad is None:
      ad = self._read(e.path)
    with self._lock:
      e.adapter = ad
      self._touch(e)
    return ad.padded(self.slot_rank)

  def _touch(self, e: _Entry) -> None:
    """Most recently used; drops arrays beyond ``max_cpu_loras`` (the entry, a path, stays:
    a request admitted before an unload may still need the adapter)."""
    self._host[e.ref.uid] = None
    self._host.move_to_end(e.ref.uid)
    while len(self._host) > self.max_cpu_loras:
      uid, _ = self._host.popitem(last=False)
      self._by_uid[uid].adapter = None

  @property
  def host_adapters(self) -> int:
    with self._lock:
      return len(self._host)


class LoraSlots:
  """See the module contract."""

  def __init__(self, max_loras: int):
    if max_loras < 1:
      raise ValueError("max_loras must be >= 1")
    self.max_loras = max_loras
    self._uid: list[int | None] = [None] * max_loras  # slot -> adapter uid
    self._users = [0] * max_loras
    self._used = [0] * max_loras  # last acquire tick
    self._tick = itertools.count(1)
    self._loads: list[LoraLoad] = []
    self.loads = 0  # adapters moved onto the device so far

  def slot_of(self, uid: int) -> int | None:
    return self._uid.index(uid) if uid in self._uid else None

  def acquire(self, ref: LoraRef) -> int | None:
    """The device slot holding ``ref`` for one more sequence (filled by a ``LoraLoad`` when it
    is not there yet), or None while every slot is held by other adapters' sequences."""
    slot = self.slot_of(ref.uid)
    if slot is None:
      free = [s for s in range(self.max_loras) if not self._users[s]]
      if not free:
        return None
      slot = min(free, key=lambda s: (self._uid[s] is not None, self._used[s]))
      self._uid[slot] = ref.uid
      self._loads.append(LoraLoad(slot, ref.uid))
      self.loads += 1
    self._users[slot] += 1
    self._used[slot] = next(self._tick)
    return slot

  def release(self, slot: int) -> None:
    if self._users[slot] < 1:
      raise ValueError(f"release of LoRA slot {slot}, which no sequence holds")
    self._users[slot] -= 1

  def take_loads(self) -> tuple[LoraLoad, ...]:
    out, self._loads = tuple(self._loads), []
    return out

  @property
  def held(self) -> int:
    return sum(1 for u in self._users if u)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT directory) loaded at start-up
  max_loras: int = 0  # device slots (0: auto, one per start-up adapter up to 4; none: off)
  max_rank: int = 0  # the slots' rank (0: the largest start-up adapter's, 16 without one)
  max_cpu_loras: int = 0  # adapters' arrays kept in host memory (0: at least max_loras)


def parse_modules(values: list[str]) -> tuple[tuple[str, str], ...]:
  """``--lora_modules`` entries (each ``name=path``, several per entry split by spaces or
  commas, as vLLM's ``--lora-modules a=x b=y``) -> (name, path) pairs; ``ValueError`` naming a
  bad one."""
  out = []
  for entry in values:
    for item in entry.replace(",", " ").split():
      name, sep, path = item.partition("=")
      if not sep or not name or not path:
        raise ValueError(f"{item!r} is not name=path")
      out.append((name, path))
  names = [n for n, _ in out]
  dup = next((n for n in names if names.count(n) > 1), None)
  if dup:
    raise ValueError(f"the name {dup!r} is given twice")
  return tuple(out)


def build_registry(cfg: ModelConfig, conf: LoraConfig) -> tuple[LoraRegistry | None, int]:
  """(the registry, device slots); (None, 0) when no adapter is served. Errors name the
  module (``ValueError``)."""
  slots = conf.max_loras or min(len(conf.modules), 4)
  if not slots:
    return None, 0
  rank = conf.max_rank
  if not rank:
    try:
      rank = max((adapter_rank(p) for _, p in conf.modules), default=16)
    except (ValueError, FileNotFoundError, KeyError) as e:
      raise ValueError(f"--lora_modules: {e}") from None
  reg = LoraRegistry(cfg, max_rank=rank,
                     max_cpu_loras=max(conf.max_cpu_loras, slots, len(conf.modules)))
  for name, path in conf.modules:
    try:
      reg.load(name, path)
    except (ValueError, FileNotFoundError, KeyError) as e:
      raise ValueError(f"--lora_modules {name}={path}: {e}") from None
  return reg, slots


__all__ = ["LoraRef", "LoraLoad", "LoraRegistry", "LoraSlots", "LoraConfig", "parse_modules",
           "build_registry"]
