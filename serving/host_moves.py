"""The host tier's page moves on a pool's KV: spills out, loads back (the engine's side).

Contract: ``run(store, kv, plan, cap, num_pages) -> kv`` runs a plan's host-tier work in order:
``spills`` (device pages read and copied to the host asynchronously, put in ``store``),
``forget`` (entries dropped), then ``loads`` (entries taken from ``store`` and written onto
their device pages); at most ``cap`` pages a call, page counts padded to powers of two (few
programs; padding reads page 0 and writes past the pool: nothing). With two pools only prompt
pages are cached, on the prefill pool; the insert transfer carries loaded pages to decode's.
``read(kv, pages, cap) -> leaves`` reads pages to the host for another process (every leaf
``[L, len(pages), ...]``, numpy; the spills' warmed copy sizes). ``warm(kv, cap, num_pages) ->
(kv, programs)`` compiles every copy size up to ``cap`` without changing state (reads of page
0, writes to padding ids only). ``copy(kv, copies, cap, num_pages)`` copies pages ``src ->
dst`` within the pool (prefix pages into another kv shard's sub-pool), ``warm_copies``
compiles its sizes (padding copies nothing).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.paged_kv import PagedKV
from serving.engine_calls import copy_call, read_pages, write_pages
from models.transformer import bucket
from serving.host_tier import HostStore
from serving.step_plan import PageCopy, StepPlan


def run(store: HostStore, kv: PagedKV, plan: StepPlan, cap: int, num_pages: int) -> PagedKV:
  for g in range(0, len(plan.spills), cap):
    group = plan.spills[g:g + cap]
    ids_C = np.zeros((bucket(len(group), minimum=1),), np.int32)
    ids_C[:len(group)] = [sp.page for sp in group]
    leaves = jax.tree.leaves(read_pages(kv, jax.device_put(ids_C)))
    for i, sp in enumerate(group):
      page = tuple(leaf[:, i] for leaf in leaves)  # K and V (int8: values and scales)
      for part in page:
        part.copy_to_host_async()
      store.put(sp.key, page)
  for key in plan.forget:
    store.discard(key)
  for g in range(0, len(plan.loads), cap):
    loads = plan.loads[g:g + cap]
    n = bucket(len(loads), minimum=1)
    ids_C = np.full((n,), num_pages, np.int32)
    ids_C[:len(loads)] = [ld.page for ld in loads]
    pages = [store.take(ld.key) for ld in loads]
    leaves = []
    for j, first in enumerate(pages[0]):
      x = np.zeros((first.shape[0], n) + first.shape[1:], first.dtype)
      for i, page in enumerate(pages):
        x[:, i] = page[j]
      leaves.append(jax.device_put(x))
    k, v = jax.tree.unflatten(jax.tree.structure((kv.k_pages, kv.v_pages)), leaves)
    kv = write_pages(kv, jax.device_put(ids_C), k, v)
  return kv


def read(kv: PagedKV, pages: Sequence[int], cap: int) -> tuple[np.ndarray, ...]:
  chunks: list[list[np.ndarray]] = []
  for g in range(0, len(pages), cap):
    group = pages[g:g + cap]
    ids_C = np.zeros((bucket(len(group), minimum=1),), np.int32)
    ids_C[:len(group)] = group
    leaves = jax.tree.leaves(read_pages(kv, jax.device_put(ids_C)))
    chunks.append([np.asarray(leaf)[:, :len(group)] for leaf in leaves])
  return tuple(np.concatenate(parts, axis=1) for parts in zip(*chunks))


def warm(kv: PagedKV, cap: int, num_pages: int) -> tuple[PagedKV, int]:
  n, count = 1, 0
  while n <= cap:
    k, v = read_pages(kv, jnp.zeros((n,), jnp.int32))
    kv = write_pages(kv, jnp.full((n,), num_pages, jnp.int32), k, v)
    n, count = n * 2, count + 2
  return kv, count


def copy(kv: PagedKV, copies: tuple[PageCopy, ...], cap: int, num_pages: int) -> PagedKV:
  for g in range(0, len(copies), cap):  # padded to powers of two up to cap: warmed programs
    group = copies[g:g + cap]
    src_C = np.zeros((bucket(len(group), minimum=1),), np.int32)
    dst_C = np.full(src_C.shape, num_pages, np.int32)  # padding copies nothing
    src_C[:len(group)] = [c.src for c in group]
    dst_C[:len(group)] = [c.dst for c in group]
    kv = copy_call(kv, jax.device_put(src_C), jax.device_put(dst_C))
  return kv


def warm_copies(kv: PagedKV, cap: int, num_pages: int) -> tuple[PagedKV, int]:
  n, count = 1, 0
  while n <= cap:
    kv = copy_call(kv, jnp.zeros((n,), jnp.int32), jnp.full((n,), num_pages, jnp.int32))
    n, count = n * 2, count + 1
  return kv, count
