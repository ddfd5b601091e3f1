"""Smoke worker: joins the runtime, sums an array sharded over the global 8-device mesh."""

import jax

from partitioning.distributed import initialize, is_leader
from tests.workers.args import cluster, parser


def main() -> None:
  args = parser(__doc__).parse_args()
  initialize(cluster(args))
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from partitioning.mesh import make_mesh
  mesh = make_mesh()
  n = mesh.devices.size
  x = jax.make_array_from_callback(
      (4 * n,), NamedSharding(mesh, P(("x", "y", "z"))),
      lambda idx: np.arange(4 * n, dtype=np.float32)[idx])
  total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
  print(f"process {jax.process_index()} of {jax.process_count()}: devices {n} "
        f"local {jax.local_device_count()} leader {is_leader()} sum {float(total)}", flush=True)


if __name__ == "__main__":
  main()
