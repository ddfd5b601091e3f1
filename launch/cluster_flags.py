"""The multi-process flags shared by the serving and sweep CLIs, and joining the cluster.

Contract: importing this module defines ``--coordinator_address``, ``--num_processes``,
``--process_id`` and ``--heartbeat_timeout_s`` once. ``join() -> Cluster`` (after the fake-device
flags are applied, before any JAX computation) calls ``partitioning.distributed.initialize`` (a
no-op for one process); the CPU backend is agreed on afterwards by
``launch.engine_flags.resolve_backend`` (process 0's, so every process traces the same programs).
Bad values raise ``CliError``.

  # a TPU pod slice, the same command on every host (JAX finds the others):
  python -m launch.server --coordinator_address auto ...
  # two hosts (or two local processes, 4 fake CPU devices each):
  python -m launch.server --coordinator_address HOST0:8476 --num_processes 2 --process_id 0 ...
  python -m launch.server --coordinator_address HOST0:8476 --num_processes 2 --process_id 1 ...
"""

from __future__ import annotations

from absl import flags

from launch.cli import CliError
from partitioning.distributed import Cluster

COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0's jax.distributed coordinator "
    "(multi-process; 'auto': JAX detects the cluster, e.g. a TPU pod slice; default: one "
    "process)")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "processes in the cluster",
                                     lower_bound=1)
PROCESS_ID = flags.DEFINE_integer("process_id", 0, "this process's index (0 serves)",
                                  lower_bound=0)
HEARTBEAT = flags.DEFINE_integer("heartbeat_timeout_s", 10, "a process silent this long is "
                                 "declared dead and every other one exits", lower_bound=1)


def cluster() -> Cluster:
  c = Cluster(COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value,
              heartbeat_timeout_s=HEARTBEAT.value)
  try:
    c.validate()
  except ValueError as e:
    raise CliError(str(e))
  return c


def join() -> Cluster:
  from partitioning import distributed as multihost
  c = cluster()
  multihost.initialize(c)
  return c
