"""The engine's program shapes: bucketed keys, the set sealed at readiness, rows by kv shard.

Contract: a program key is ``("prefill", R, T, attended)``, ``("decode", R, attended)`` or
``("sample", R, phase)``. ``ProgramSet`` counts the keys dispatched (``count``: each compiled
once); after ``seal()`` a model program outside the set runs as the smallest dispatched one of
its phase that covers it (``cover``: more rows only where ``pad_rows``, a chunk and an attended
length at least as long; counted in ``covered``), and one nothing covers is logged, counted
(``unwarmed``) and compiles. ``arrange(slots, table_XM, num_pages, shards)`` places a call's
slots on rows ``R`` grouped by the kv shard of each slot's pages (``R = shards *
bucket(largest group)``); one shard: rows ``0..``. Letters: ``models/config.py``.
"""

from __future__ import annotations

import collections
import logging
from typing import Sequence

import numpy as np

from models.transformer import bucket

_log = logging.getLogger(__name__)


def powers(lo: int, hi: int) -> list[int]:
  """Powers of two from ``lo`` up to ``hi``, and ``hi`` itself."""
  out, v = [], lo
  while v < hi:
    out.append(v)
    v *= 2
  return out + [hi]


class ProgramSet:
  """See the module contract."""

  def __init__(self) -> None:
    self.shapes: set[tuple] = set()
    self.sealed = False
    self.unwarmed = 0  # dispatches after seal() of a program warm-up did not compile
    self.covered = 0  # after seal(), programs run as a larger warmed one (``cover``)

  @property
  def count(self) -> int:
    return len(self.shapes)

  def seal(self) -> None:
    self.sealed = True

  def cover(self, key: tuple, pad_rows: bool) -> tuple:
    """``key``, or after ``seal()`` the smallest dispatched key of its phase covering it."""
    if not self.sealed or key in self.shapes:
      return key
    fits = [k for k in self.shapes if k[0] == key[0] and len(k) == len(key)
            and all(a >= b for a, b in zip(k[1:], key[1:])) and (pad_rows or k[1] == key[1])]
    if not fits:
      return key
    best = min(fits, key=lambda k: (int(np.prod(k[1:])), k))
    self.covered += 1
    _log.warning("program %s was not compiled at warm-up: run as %s", key, best)
    return best

  def dispatch(self, key: tuple) -> None:
    """Counts a dispatch; after ``seal()`` one outside the set is a hole (logged, counted)."""
    if self.sealed and key not in self.shapes:
      self.unwarmed += 1
      _log.error("program %s was not compiled at warm-up: compiling it while serving", key)
    self.shapes.add(key)


def arrange(slots: Sequence[int], table_XM: np.ndarray, num_pages: int, shards: int,
            cap: int | None = None) -> tuple[int, list[int]]:
  """(rows R, row of each slot): unsharded, rows 0..; else grouped by the shard of the slot's
  pages, ``R = shards * min(bucket(largest group), cap)`` (``cap``: the decode slots, whose
  buckets stop there, as the engine's ``buckets()`` does)."""
  if shards == 1:
    return bucket(len(slots), minimum=1), list(range(len(slots)))
  per_shard = num_pages // shards
  shard = []
  for s in slots:
    page = int(table_XM[s, 0])
    if not 0 <= page < num_pages:
      raise ValueError(f"slot {s} holds no page: cannot place it on a kv shard")
    shard.append(page // per_shard)
  groups = collections.Counter(shard)
  r_s = bucket(max(groups.values()), minimum=1)
  if cap is not None:
    r_s = min(r_s, cap)
  seen: collections.Counter[int] = collections.Counter()
  row_of = []
  for sh in shard:
    row_of.append(sh * r_s + seen[sh])
    seen[sh] += 1
  return shards * r_s, row_of
