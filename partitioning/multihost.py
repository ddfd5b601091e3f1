"""JAX's multi-controller runtime for phaseserve: one model, one global mesh, many processes.

Contract:
  * ``Cluster(coordinator_address, num_processes, process_id, ...)``: a frozen description of
    this process's place in a multi-process run; ``Cluster.single()`` is the one-process default
    (``initialize`` is then a no-op). ``Cluster.validate()`` raises ``ValueError`` naming the bad
    field.
  * ``initialize(cluster)`` calls ``jax.distributed.initialize`` once, before any JAX computation,
    with the heartbeat and initialisation timeouts of ``cluster`` (a process whose peer died
    stops with an error after about ``heartbeat_timeout_s`` instead of hanging in a collective).
    It selects gloo for CPU collectives (``jax_cpu_collectives_implementation``), so cross-process
    CPU meshes work (the tests' 2 processes x 4 fake devices).
  * After ``initialize`` ``jax.devices()`` is the global device list (every process's devices)
    and ``partitioning.mesh.make_mesh()`` spans them; ``jax.local_devices()`` are this process's.
  * ``is_leader()``: true on process 0 (the one that serves gRPC / HTTP).

The runtime is JAX's own (a coordinator service in process 0, heartbeats, a key-value store):
phaseserve adds nothing to it but the step-plan broadcast in ``serving.multihost``.
"""

from __future__ import annotations

import dataclasses

import jax


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
  def multi(self) -> bool:
    return self.num_processes > 1

  def validate(self) -> None:
    if self.num_processes < 1:
      raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
    if not 0 <= self.process_id < self.num_processes:
      raise ValueError(
          f"process_id must be in [0, {self.num_processes}), got {self.process_id}")
    if self.multi and not self.coordinator_address:
      raise ValueError("coordinator_address (host:port) is required with num_processes > 1")
    if self.coordinator_address is not None:
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
  jax.distributed.initialize(
      cluster.coordinator_address, num_processes=cluster.num_processes,
      process_id=cluster.process_id, initialization_timeout=cluster.init_timeout_s,
      heartbeat_timeout_seconds=cluster.heartbeat_timeout_s,
      shutdown_timeout_seconds=cluster.shutdown_timeout_s)


def is_leader() -> bool:
  return jax.process_index() == 0
