"""The session-10 A/B of SmolLM2-135M decode on XLA:CPU (BUILD_NOTES "Grouped native matmuls and
the contiguous cache on the native attention"): ``launch.lab.bench_model``'s decode measurement with
the two changes (variant ``new``) or with both undone in-process (``sep_xla``: ``quant.einsums``
as separate ``einsum`` calls, ``KVCache.attend`` through ``models.attention.attend``). Run the
variants alternately, each in its own process:

    for v in new sep_xla new sep_xla; do .venv/bin/python -m launch.lab.model_speed.ab_decode_s10 $v; done

Prints ``variant [(quantize, batch, ms_per_step, x_of_bound), ...]`` (bf16 params).
"""

from __future__ import annotations

import sys


def main() -> None:
  variant = sys.argv[1]
  from models import attention, kv_cache, quant

  if "sep" in variant:
    quant.einsums = lambda specs, x, ws: [quant.einsum(s, x, w) for s, w in zip(specs, ws)]
  if "xla" in variant:
    kv_cache.KVCache.attend = lambda self, l, q, pos, al: attention.attend(q, *self.read(l, al),
                                                                            pos)
  from launch.lab import bench_model as bm  # after the patches, as the A/B was run

  cfg_b = bm.BenchConfig(model="smollm2-135m", dtypes=("bfloat16",), quantize="all",
                         decode_batches=(1, 8), steps=16, repeats=7)
  meter = bm._ReadMeter(cfg_b.bandwidth_mb << 20)
  out = []
  for cfg, name, q, params in bm._param_sets(cfg_b):
    for b in cfg_b.decode_batches:
      r = bm._decode(cfg, params, name, q, b, cfg_b, meter)
      out.append((q, b, round(r["ms_per_step"], 2), round(r["x_of_bound"], 2)))
  print(variant, out, flush=True)


if __name__ == "__main__":
  main()
