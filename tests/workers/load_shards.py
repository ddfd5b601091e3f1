"""Memory worker: imports a checkpoint into a layout's shardings over the global mesh and prints
one ``RESULT {json}`` line: the peak anonymous memory beyond the bytes placed so far
(``tests.peak_memory.ExcessWatch``; where those are known only at the end, orbax and the naive
control, beyond the final total), bytes placed / read / held by this process's devices, the
largest tensor, and (``--sums``) every weight's global sum for the caller to check.

``--mode sharded`` is the direct path (``models.io.hf_import`` / ``models.io.checkpoint`` with target
shardings); ``--mode naive`` the whole-copy control: load every array on the first device, then
``device_put`` into the shardings (one process only).
"""

import json
import math
import time

from partitioning.distributed import initialize
from tests.workers.args import cluster, parser


def main() -> None:
  p = parser(__doc__)
  p.add_argument("--checkpoint", required=True)
  p.add_argument("--kind", choices=("hf", "orbax", "init"), default="hf")  # init: a preset
  p.add_argument("--mode", choices=("sharded", "naive"), default="sharded")
  p.add_argument("--layout", default="ws_2d")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--quantize", action="store_true")
  p.add_argument("--sums", action="store_true")
  args = p.parse_args()
  initialize(cluster(args))
  import jax
  import jax.numpy as jnp
  import numpy as np

  from models.io import checkpoint, hf_import, loader
  from models.quant import QuantArray
  from models.weights import abstract_params
  from partitioning.layouts import param_shardings
  from partitioning.mesh import make_mesh
  from tests.peak_memory import ExcessWatch

  dtype = jnp.dtype(args.dtype)
  cfg = loader.load_config(args.checkpoint)
  mesh = make_mesh()
  shardings = param_shardings(cfg, mesh, args.layout, args.quantize)
  floats = jax.tree.leaves(abstract_params(cfg, dtype))
  largest = max(math.prod(a.shape) * dtype.itemsize for a in floats)
  # What this process's devices hold, in the file's dtype (bf16): one read per distinct shard.
  held = 0
  for a, s in zip(floats, jax.tree.leaves(param_shardings(cfg, mesh, args.layout, False))):
    distinct = {tuple(map(str, i)) for i in s.addressable_devices_indices_map(a.shape).values()}
    held += len(distinct) * math.prod(s.shard_shape(a.shape)) * 2
  read = [0]

  def progress(ev):
    watch.placed(ev.placed_bytes - watch.placed_bytes)
    read[0] = ev.read_bytes

  start = time.perf_counter()
  with ExcessWatch() as watch:
    if args.mode == "naive":
      if args.kind == "hf":
        _, whole = hf_import.load_hf_checkpoint(args.checkpoint, dtype, quantize=args.quantize)
      else:
        whole = checkpoint.restore_params(args.checkpoint, dtype=dtype)
      params = jax.device_put(whole, shardings)
      jax.block_until_ready(params)
      del whole
      watch.placed(sum(s.data.nbytes for a in jax.tree.leaves(params)
                       for s in a.addressable_shards))
    elif args.kind == "init":
      from models.io import placement
      params = placement.init_params(cfg, jax.random.key(0), dtype, shardings,
                                     quantized=args.quantize, progress=progress)
    elif args.kind == "hf":
      _, params = hf_import.load_hf_checkpoint(args.checkpoint, dtype, shardings=shardings,
                                               quantize=args.quantize, progress=progress)
    else:  # orbax reads in its own threads: the placed bytes are known once it returns
      params = checkpoint.restore_params(args.checkpoint, shardings, dtype=dtype)
      jax.block_until_ready(params)
      watch.placed(sum(s.data.nbytes for a in jax.tree.leaves(params)
                       for s in a.addressable_shards))
  # Where placed bytes are only known at the end (orbax, the naive control), the excess is
  # measured against the final total: peak - placed (the weaker, never larger, form).
  counted = args.mode == "sharded" and args.kind != "orbax"
  out = {"process": jax.process_index(), "counted": counted,
         "excess": watch.excess if counted else watch.peak - watch.placed_bytes,
         "peak": watch.peak, "seconds": round(time.perf_counter() - start, 2),
         "placed": watch.placed_bytes, "read": read[0], "held": held, "largest": largest,
         "samples": watch.samples, "shards_ok": all(
             a.sharding == s for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)))}
  if args.sums:
    sums = jax.jit(lambda p: [jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(p)],
                   out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    out["sums"] = {jax.tree_util.keystr(k): float(np.asarray(t.addressable_data(0)))
                   for (k, _), t in zip(flat, sums(params))}  # one program for every weight
    out["quantized"] = any(isinstance(x, QuantArray) for x in jax.tree.leaves(
        params, is_leaf=lambda x: isinstance(x, QuantArray)))
  print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
