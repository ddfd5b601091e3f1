"""How many XLA programs this process has loaded, counted from JAX's own compile events.

Contract: ``ProgramCounter()`` listens to ``/jax/core/compile/backend_compile_duration`` (one event
per executable XLA compiled or read from the persistent cache: either way a program is loaded
and its code mapped into memory) from construction until ``close()``. ``count`` is the total,
``names`` the count per jitted function, ``mark()`` remembers the current count (readiness) and
``since_mark`` is how many came after it (each logged as a warning with its name): a serving
process with a closed program set keeps it at 0. ``map_count()`` is the process's memory mappings (lines of ``/proc/self/maps``; None where
there is none) and ``max_map_count()`` the kernel's limit (``vm.max_map_count``; None where
unknown). ``breakdown()`` is where the programs' time went since construction, from JAX's
events (seconds summed over threads: the warm-up compiles side by side): ``trace_s`` (Python to
jaxpr), ``lower_s`` (jaxpr to StableHLO), ``compile_or_load_s`` (XLA compiles, or reads from the
persistent cache), of it ``cache_read_s``, and ``cache_hits`` / ``cache_misses``: an XLA:CPU program costs mappings, and past the limit a compile aborts the process.
``trim_heap()`` hands the C heap's free memory back to the kernel (glibc ``malloc_trim``; False
where there is none): the warm-up runs every program once and their temporaries stay in the
process's RSS otherwise. ``mapping_warning(before, after, programs, limit)`` is the start-up check: a message when the
mappings after warm-up leave less than a quarter of the limit (or room for fewer than 32 more
programs at the measured cost per program), else None.
"""

from __future__ import annotations

import collections
import logging
import threading

import jax

EVENT = "/jax/core/compile/backend_compile_duration"
_STAGES = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
           EVENT: "compile_or_load_s",
           "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read_s"}
_COUNTS = {"/jax/compilation_cache/cache_hits": "cache_hits",
           "/jax/compilation_cache/cache_misses": "cache_misses"}
_log = logging.getLogger(__name__)


class ProgramCounter:
  def __init__(self) -> None:
    self.count = 0
    self.names: collections.Counter[str] = collections.Counter()
    self._mark = 0
    self._marked = False
    self._lock = threading.Lock()
    self._seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
    self._counts: collections.Counter[str] = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(self._on_event)
    jax.monitoring.register_event_listener(self._on_count)

  def _on_count(self, event: str, **kw: str | int) -> None:
    if event in _COUNTS:
      with self._lock:
        self._counts[_COUNTS[event]] += 1

  def breakdown(self) -> dict[str, float | int]:
    with self._lock:
      out: dict[str, float | int] = {k: round(self._seconds[k], 4) for k in _STAGES.values()}
      return out | {k: self._counts[k] for k in _COUNTS.values()}

  def _on_event(self, event: str, duration_secs: float, **kw: str | int) -> None:
    if event in _STAGES:
      with self._lock:
        self._seconds[_STAGES[event]] += duration_secs
    if event == EVENT:
      fun_name = str(kw.get("fun_name", ""))
      with self._lock:
        self.count += 1
        self.names[fun_name] += 1
      if self._marked:
        _log.warning("XLA program %r loaded after readiness (%.2f s)", fun_name, duration_secs)

  def mark(self) -> None:
    self._mark = self.count
    self._marked = True

  @property
  def since_mark(self) -> int:
    return self.count - self._mark

  def close(self) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_event)
    jax.monitoring.unregister_event_listener(self._on_count)


def map_count() -> int | None:
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


def max_map_count() -> int | None:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read().strip())
  except (OSError, ValueError):
    return None


def mapping_warning(before: int | None, after: int | None, programs: int,
                    limit: int | None) -> str | None:
  if before is None or after is None or limit is None:
    return None
  per = max(0.0, (after - before) / programs) if programs else 0.0
  room = limit - after
  if room >= limit / 4 and (per == 0 or room >= 32 * per):
    return None
  return (f"memory mappings: {after} of the kernel's vm.max_map_count {limit} after compiling "
          f"{programs} programs (~{per:.0f} each): a few more programs would abort the process "
          "(LLVM 'Unable to allocate section memory'). Raise the limit (sysctl -w "
          "vm.max_map_count=262144) or shrink the program set (--max_slots, --max_chunk, "
          "--max_prefill_chunks, --max_context).")


def trim_heap() -> bool:
  try:
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    return bool(libc.malloc_trim(0))
  except (OSError, AttributeError):
    return False


def rss_bytes() -> int | None:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError):
    pass
  return None
