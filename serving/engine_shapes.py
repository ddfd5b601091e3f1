"""The engine's program shapes: bucketed keys, the set sealed at readiness, rows by kv shard.

Contract: a program key is ``("prefill", R, T, attended)`` (packed: ``T`` is the call's ``N``
tokens, ``R`` its logits rows), ``("decode", R, attended)`` or ``("sample", R, phase)``. ``ProgramSet`` counts the keys dispatched (``count``: each compiled
once); after ``seal()`` a model program outside the set runs as the smallest dispatched one of
its phase that covers it (``cover``: more rows only where ``pad_rows``, a chunk and an attended
length at least as long; counted in ``covered``), and one nothing covers is logged, counted
(``unwarmed``) and compiles. ``arrange(slots, table_XM, num_pages, shards)`` places a call's
slots on rows ``R`` grouped by the kv shard of each slot's pages (``R = shards *
bucket(largest group)``); one shard: rows ``0..``. ``decode_rows(n, cap)``: one shard's decode
row count for ``n`` rows; ``packed(n)``: a packed prefill's token count. Letters:
``models/config.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Sequence

import numpy as np

from models.transformer import bucket
from serving.step_plan import PrefillChunk

_log = logging.getLogger(__name__)


def packed(n: int, floor: int = 16) -> int:
  """A packed prefill's token count ``n`` rounded up to four sizes an octave (16, 32, 48, 64,
  80, ..., 128, 160, ..., 256, 320, ...): at most a quarter of the tokens (below 64: at most
  15) are padding. Below 16, powers of two from ``floor`` (a draft model's catch-ups of one or
  two ids: ``serving.draft_model``)."""
  if n <= 16:
    return min(16, max(floor, 1 << max(0, n - 1).bit_length()))
  step = max(16, (1 << ((n - 1).bit_length() - 1)) // 4)
  return -(-n // step) * step


def decode_rows(n: int, cap: int) -> int:
  """A decode call's row count for ``n`` rows, at most ``cap``: a power of two, or 24 for 17-24
  rows (the tiled kernel runs them as a 16-row vector and an 8-row one: about three quarters of
  32 rows' time; the batches around capacity on 2 cores are 10-25 rows, so one more program
  there, none past it, keeps the warm start under 20 s)."""
  b = bucket(n, minimum=1)
  return min(24 if b == 32 and n <= 24 else b, cap)


def packed_sizes(cap: int, floor: int = 16) -> list[int]:
  """Every ``packed(n, floor)`` for ``1 <= n <= cap``."""
  out, n = [], 1
  while n <= cap:
    out.append(packed(n, floor))
    n = out[-1] + 1
  return out


@dataclasses.dataclass(frozen=True)
class Packed:
  """A packed prefill's host arrays: ``N`` tokens end to end (``slot_N``, ``pos_N``; padding:
  the null slot, position -1) and per chunk ``R`` its slot, end, last token's index and whether
  it samples (padding rows: the null slot)."""
  tokens_N: np.ndarray
  slot_N: np.ndarray
  pos_N: np.ndarray
  slots_R: np.ndarray
  end_R: np.ndarray
  last_R: np.ndarray
  want_R: np.ndarray


def pack(chunks: Sequence[PrefillChunk], n: int, r: int, null_slot: int) -> Packed:
  """``chunks`` end to end in ``n`` tokens, ``r`` rows (``n`` >= their tokens, ``r`` >= their
  count)."""
  out = Packed(np.zeros((n,), np.int32), np.full((n,), null_slot, np.int32),
               np.full((n,), -1, np.int32), np.full((r,), null_slot, np.int32),
               np.zeros((r,), np.int32), np.zeros((r,), np.int32), np.zeros((r,), bool))
  i = 0
  for j, c in enumerate(chunks):
    k = len(c.token_ids)
    out.tokens_N[i:i + k], out.slot_N[i:i + k] = c.token_ids, c.slot
    out.pos_N[i:i + k] = np.arange(c.start, c.start + k)
    out.slots_R[j], out.end_R[j], out.last_R[j], out.want_R[j] = (c.slot, c.start + k, i + k - 1,
                                                                  c.sample)
    i += k
  return out


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
