"""What the serving loop shows of itself to the front ends: its fixed capacity and its occupancy
now (``ServingLoop.capacity()`` / ``occupancy()``), plain values any thread may hold."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Capacity:
  """What the loop can hold: fixed by its configuration (``ServingLoop.capacity``)."""
  kv_pages: int
  page_size: int
  kv_bytes: int
  bytes_per_page: int
  max_slots: int
  max_context: int
  max_step_tokens: int
  max_prefill_chunks: int
  max_chunk: int
  prefix_cache: bool
  host_tier_pages: int
  attention_sinks: bool
  vocab_size: int


@dataclasses.dataclass(frozen=True)
class Occupancy:
  """What the loop holds now (``ServingLoop.occupancy``): requests queued in the scheduler,
  on their way to it (``arriving``), running (of which ``decoding``), and KV pages."""
  waiting: int
  arriving: int
  running: int
  decoding: int
  pages_used: int
  pages_free: int
  pages_cached: int
  host_tier_pages_used: int
