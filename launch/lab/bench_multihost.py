"""What one serving step pays for spanning processes: the plan broadcast and a collective.

  # two local processes, 4 fake CPU devices each (run both; process 0 prints one JSON line)
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m launch.lab.bench_multihost \
      --coordinator_address 127.0.0.1:8476 --num_processes 2 --process_id 0 &
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m launch.lab.bench_multihost \
      --coordinator_address 127.0.0.1:8476 --num_processes 2 --process_id 1

Timed with nothing else running on the devices: the round trip of a 32-row decode plan
(``serving.plan_codec`` through ``partitioning.distributed.Broadcast``, process 0 to 1 and an
acknowledgement back), and one small all-reduce over the global mesh (``[8, E]`` f32 rows summed;
a sharded layer does a few), ``--reps`` times each; the mean in ms.
"""

from __future__ import annotations

import json
import time

from absl import flags

from launch import cli, cluster_flags

_REPS = flags.DEFINE_integer("reps", 200, "timed repetitions of each", lower_bound=1)
_WIDTH = flags.DEFINE_integer("width", 576, "all-reduced row width (SmolLM2's embed)",
                              lower_bound=1)


def main(argv: list[str]) -> None:
  cli.start(argv)
  cluster_flags.join()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from partitioning.mesh import make_mesh
  from serving import plan_codec
  from serving.sampling import SamplingParams
  from serving.scheduler import DecodeRow, SlotSetup, StepPlan
  plan = StepPlan(step=0, prefill=(), decode=tuple(DecodeRow(f"req-{i}", i, 100 + i)
                                                   for i in range(32)),
                  setups=(SlotSetup(3, "req-3", SamplingParams(seed=1)),),
                  page_table=np.zeros((32, 64), np.int32))
  data = plan_codec.encode(("execute", (plan,)))
  from partitioning.distributed import Broadcast, is_leader
  reps = _REPS.value
  there, back = Broadcast("bench/there"), Broadcast("bench/back")
  t0 = time.perf_counter()
  for _ in range(reps):  # ping-pong: process 0 publishes, process 1 answers
    if is_leader():
      there.publish(data)
      while back.receive(10.0) is None:
        pass
    else:
      while (got := there.receive(10.0)) is None:
        pass
      plan_codec.decode(got)
      back.publish(b"k")  # (a Broadcast from process 1: only process 0 reads it)
  rtt = (time.perf_counter() - t0) / reps
  mesh = make_mesh()
  x = jax.device_put(np.ones((jax.device_count(), _WIDTH.value), np.float32),
                     NamedSharding(mesh, P(("x", "y", "z"))))
  f = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=NamedSharding(mesh, P()))
  f(x).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(reps):
    f(x).block_until_ready()
  ar = (time.perf_counter() - t0) / reps
  if is_leader():
    print(json.dumps({"plan_bytes": len(data), "broadcast_round_trip_ms": rtt * 1e3,
                      "allreduce_ms": ar * 1e3, "width": _WIDTH.value, "reps": reps,
                      "processes": jax.process_count(), "devices": jax.device_count(),
                      "platform": jax.devices()[0].platform}), flush=True)
  if jax.process_count() > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  cli.run(main)
