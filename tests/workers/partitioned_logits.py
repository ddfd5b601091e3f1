"""Worker: the partitioned paged prefill + decode of tests/partitioning/test_paged_layouts.py on the global mesh.

Every process runs the same programs; the logits and the KV lengths are gathered and process 0
writes them to ``--out`` (an .npz, keys ``<ffn>-<attn>-<f32|int8>/<l1|l2|l3|lengths>``) for
tests/e2e/test_multihost.py to compare with one process over 8 devices.
"""

import jax

from partitioning.distributed import initialize, is_leader
from tests.workers.args import cluster, parser

CASES = (("ws_2d", "batch_z", False), ("ws_1d", "heads", True))  # (ffn, attn, int8 weights)


def case_name(ffn: str, attn: str, quantized: bool) -> str:
  return f"{ffn}-{attn}-{'int8' if quantized else 'f32'}"


def run_case(mesh, ffn: str, attn: str, quantized: bool) -> dict:
  """The case's outputs as host arrays (gathered from every process)."""
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils

  from partitioning import paged_step as PS
  from tests.partitioning import test_paged_layouts as T
  params, x, _ = T._case(quantized)
  step = PS.PagedShardedStep.make(T.CFG, mesh, ffn, attn)
  kv = step.init_kv(T.B, T.NP, T.Z, T.M, jnp.float32).replace(page_table=jnp.asarray(T._table()))
  got = T._run(step, step, step.place_params(params), kv, x)

  def host(a):
    if a.is_fully_addressable:
      return np.asarray(a)
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))

  return {"l1": host(got["l1"]), "l2": host(got["l2"]), "l3": host(got["l3"]),
          "lengths": host(got["kv"].lengths)}


def main() -> None:
  p = parser(__doc__)
  p.add_argument("--out", required=True)
  p.add_argument("--cases", default=",".join(case_name(*c) for c in CASES),
                 help="comma-separated case names (default: all)")
  args = p.parse_args()
  cases = [c for c in CASES if case_name(*c) in args.cases.split(",")]
  initialize(cluster(args))
  import numpy as np

  from partitioning.mesh import make_mesh
  mesh = make_mesh()
  out = {}
  for ffn, attn, q in cases:
    for k, v in run_case(mesh, ffn, attn, q).items():
      out[f"{case_name(ffn, attn, q)}/{k}"] = v
  if is_leader():
    np.savez(args.out, **out)
  print(f"process {jax.process_index()}: {len(cases)} cases on {mesh.devices.size} devices",
        flush=True)


if __name__ == "__main__":
  main()
