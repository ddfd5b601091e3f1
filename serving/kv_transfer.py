"""KV pages moved between two serving processes (Splitwise: prefill in one, decode in another):
a prompt's whole pages, read from one engine's pool and adopted into the other's host tier.

Contract:
  * ``KvPages(tokens, parts, layout)``: ``tokens`` are the ids the pages hold (a whole number of
    pages), ``parts`` the pool's K and V leaves, each ``[L, P, ...]`` for P pages (with an int8
    KV cache: values and scales), ``layout`` a string both sides must share (page size, every
    leaf's dtype and per-page shape). ``to_bytes()`` / ``KvPages.from_bytes(b)``: numpy's
    ``.npz`` of raw leaf bytes with dtype names and shapes (bfloat16 survives; no pickle);
    ``ValueError`` for bytes that are not one.
  * ``export_prefix(loop, tokens, ns, timeout) -> KvPages | None`` (any thread; the work runs on
    the loop's thread between steps, ``serving.loop_tasks``): the longest prefix of ``tokens``
    whose pages the prefix cache holds on the device (None: no page).
  * ``import_prefix(loop, pages, ns, timeout) -> int`` (any thread; runs on the loop's): the
    pages the prefix cache does not hold yet become host-tier entries under their token ids
    (``PrefixCache.adopt``), so the next request with that prefix loads them instead of
    computing them (its prefill then covers only the rest); returns the tokens adopted (0 when
    the pages' own shapes and dtypes are not the layout they claim, the layouts differ, the cache
    has no host tier, or the tier is full: nothing malformed reaches the engine).
  * ``KvSource``: what a transport between the processes implements, ``fetch(params, tokens,
    credential) -> KvPages | None`` (``params``: the prefill side's handoff; ``credential``: what
    the client presented, for a prefill side that authenticates; None: nothing to fetch, the
    decode side computes the prompt itself).
"""

from __future__ import annotations

import abc
import dataclasses
import io
from typing import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from serving.loop import ServingLoop


@dataclasses.dataclass(frozen=True)
class KvPages:
  tokens: tuple[int, ...]
  parts: tuple[np.ndarray, ...]
  layout: str

  @property
  def num_pages(self) -> int:
    return int(self.parts[0].shape[1]) if self.parts else 0

  def to_bytes(self) -> bytes:
    # Each leaf as raw bytes with its dtype's name and shape: .npz has no bfloat16.
    arrays: dict[str, np.ndarray] = {}
    for i, p in enumerate(self.parts):
      arrays[f"part{i}"] = np.frombuffer(np.ascontiguousarray(p).tobytes(), np.uint8)
      arrays[f"dtype{i}"] = np.asarray(p.dtype.name)
      arrays[f"shape{i}"] = np.asarray(p.shape, np.int64)
    arrays["tokens"] = np.asarray(self.tokens, np.int64)
    arrays["layout"] = np.asarray(self.layout)
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as bool
    return buf.getvalue()

  @classmethod
  def from_bytes(cls, data: bytes) -> "KvPages":
    try:
      with np.load(io.BytesIO(data), allow_pickle=False) as z:
        n = sum(1 for k in z.files if k.startswith("part"))
        parts = tuple(z[f"part{i}"].view(jnp.dtype(str(z[f"dtype{i}"])))
                      .reshape(tuple(z[f"shape{i}"])) for i in range(n))
        return cls(tuple(int(t) for t in z["tokens"]), parts, str(z["layout"]))
    except (OSError, KeyError, ValueError, TypeError) as e:
      raise ValueError(f"not a KV page transfer: {e}") from None


def layout_of(parts: Sequence[np.ndarray], page_size: int) -> str:
  """The layout string of pages whose leaves are ``parts`` (``[L, P, ...]`` each)."""
  leaves = ";".join(f"{p.dtype.name}{[p.shape[0], *p.shape[2:]]}" for p in parts)
  return f"page_size={page_size};{leaves}"


def export_prefix(loop: ServingLoop, tokens: Sequence[int], ns: int = 0,
                  timeout: float = 30.0) -> KvPages | None:
  def run() -> KvPages | None:
    kv = loop.scheduler.kv
    cache = kv.prefix_cache
    shard = cache.best_shard(tokens, ns)
    if shard is None:
      return None
    # ``match`` leaves the last token to compute; a transfer wants every whole page it holds.
    whole = list(tokens) + [0]
    m = cache.match(whole, shard, count=False, ns=ns)
    if not m.nodes:
      return None
    parts = loop.engine.read_pages(m.pages)
    n = len(m.nodes) * kv.page_size
    return KvPages(tuple(tokens[:n]), parts, layout_of(parts, kv.page_size))
  return loop.tasks.call(run, timeout)


def import_prefix(loop: ServingLoop, pages: KvPages, ns: int = 0, timeout: float = 30.0) -> int:
  def run() -> int:
    kv = loop.scheduler.kv
    store = kv.host_store
    if store is None or not pages.parts or len(pages.tokens) != pages.num_pages * kv.page_size \
        or not pages.layout == layout_of(pages.parts, kv.page_size) == _expected_layout(loop):
      return 0  # data that does not describe itself, or not this pool's pages
    cache = kv.prefix_cache
    shard = cache.best_shard(pages.tokens, ns)
    added = cache.adopt(pages.tokens, 0 if shard is None else shard, ns)
    for i, key in added:
      store.put(key, tuple(np.ascontiguousarray(p[:, i]) for p in pages.parts))
    return len(added) * kv.page_size
  return loop.tasks.call(run, timeout)


def _expected_layout(loop: ServingLoop) -> str:
  """This engine's page layout (its pool's first page, read)."""
  own = loop.engine.read_pages([0])
  return layout_of(own, loop.scheduler.kv.page_size)


class KvSource(abc.ABC):
  """A transport from the prefill process (see the module contract)."""

  @abc.abstractmethod
  def fetch(self, params: Mapping[str, object], tokens: Sequence[int],
            credential: str = "") -> KvPages | None: ...
