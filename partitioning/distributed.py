"""JAX's multi-controller runtime for phaseserve: one model, one global mesh, many processes.

Contract: ``Cluster(coordinator_address, num_processes, process_id, ...)`` describes this
process's place (``"auto"``: JAX detects the cluster; ``Cluster.single()`` the default;
``validate()`` raises ``ValueError``). ``initialize(cluster)`` calls ``jax.distributed.initialize``
once, before any computation, with heartbeat timeouts and gloo CPU collectives; afterwards
``jax.devices()`` is global. ``is_leader()``: process 0 (the one that serves). ``Broadcast(name)``:
an ordered stream of byte messages from process 0 to the others over the runtime's key-value
store (``publish`` / ``receive(timeout_s)``). ``agree(name, compute)``: every process gets
process 0's JSON value of ``compute()`` (measured choices must be equal everywhere, or processes
would trace different programs); every process makes the same calls in the same order.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import jax

KEEP = 64  # messages a Broadcast keeps in the store (>> the few steps processes can drift)


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Where this process sits in a multi-process JAX run."""
  coordinator_address: str | None = None  # "host:port" of process 0's coordinator service
  num_processes: int = 1
  process_id: int = 0
  heartbeat_timeout_s: int = 10  # a peer silent this long is declared dead
  init_timeout_s: int = 120  # every process must join within this
  shutdown_timeout_s: int = 30

  @classmethod
  def single(cls) -> "Cluster":
    return cls()

  @property
  def auto(self) -> bool:
    """``coordinator_address="auto"``: JAX detects the cluster (TPU pod slices, SLURM, MPI)."""
    return self.coordinator_address == "auto"

  @property
  def multi(self) -> bool:
    return self.auto or self.num_processes > 1

  def validate(self) -> None:
    if self.num_processes < 1:
      raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
    if not 0 <= self.process_id < self.num_processes:
      raise ValueError(
          f"process_id must be in [0, {self.num_processes}), got {self.process_id}")
    if self.multi and not self.coordinator_address:
      raise ValueError("coordinator_address (host:port) is required with num_processes > 1")
    if self.coordinator_address is not None and not self.auto:
      host, sep, port = self.coordinator_address.rpartition(":")
      if not sep or not host or not port.isdigit():
        raise ValueError(
            f"coordinator_address must be host:port, got {self.coordinator_address!r}")
    for name in ("heartbeat_timeout_s", "init_timeout_s", "shutdown_timeout_s"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1 second, got {getattr(self, name)}")


def initialize(cluster: Cluster) -> None:
  """Joins the multi-process runtime (no-op for one process). Call before any JAX computation."""
  cluster.validate()
  if not cluster.multi:
    return
  # Only the CPU client reads this (TPU / GPU collectives are their own): set it always.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  timeouts: dict[str, Any] = dict(initialization_timeout=cluster.init_timeout_s,
                  heartbeat_timeout_seconds=cluster.heartbeat_timeout_s,
                  shutdown_timeout_seconds=cluster.shutdown_timeout_s)
  if cluster.auto:
    jax.distributed.initialize(**timeouts)
  else:
    jax.distributed.initialize(cluster.coordinator_address, num_processes=cluster.num_processes,
                               process_id=cluster.process_id, **timeouts)
  if jax.default_backend() == "cpu":
    # A multi-process CPU program (gloo collectives) loaded from the persistent compilation
    # cache hangs in its first collective (jax 0.12.1; fresh compiles run): compile afresh.
    jax.config.update("jax_enable_compilation_cache", False)


def is_leader() -> bool:
  return jax.process_index() == 0


def _client():
  from jax._src import distributed  # the runtime's own client: its key-value store
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("jax.distributed is not initialized (partitioning.distributed.initialize)")
  return client


class Broadcast:
  """Ordered messages from process 0 to the others (see the module contract)."""

  def __init__(self, name: str):
    self.name = name
    self._next = 0
    self._client = _client()

  def _key(self, i: int) -> str:
    return f"phaseserve/{self.name}/{i}"

  def publish(self, data: bytes) -> None:
    self._client.key_value_set_bytes(self._key(self._next), data)
    if self._next >= KEEP:
      self._client.key_value_delete(self._key(self._next - KEEP))
    self._next += 1

  def receive(self, timeout_s: float) -> bytes | None:
    try:
      data = self._client.blocking_key_value_get_bytes(self._key(self._next),
                                                        max(1, int(timeout_s * 1000)))
    except Exception as e:  # the runtime raises its own error type for DEADLINE_EXCEEDED
      if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
        return None
      raise
    self._next += 1
    return data


_agreed: dict[str, int] = {}  # agreements made so far per name, in this process


def agree(name: str, compute: Callable[[], object], timeout_s: float = 600.0) -> Any:
  """Process 0's ``compute()`` on every process (see the module contract)."""
  if jax.process_count() == 1:
    return compute()
  # The n-th agreement on ``name`` in this process: every process makes the same calls in the
  # same order, so the keys match, and a name may be agreed on again (a sweep's next cell).
  n = _agreed.get(name, 0)
  _agreed[name] = n + 1
  key = f"phaseserve/agree/{name}/{n}"
  client = _client()
  if is_leader():
    value = compute()
    client.key_value_set_bytes(key, json.dumps(value).encode())
    return value
  return json.loads(client.blocking_key_value_get_bytes(key, int(timeout_s * 1000)))
