"""The session-11 A/B of the AMX kernel in the serving engine (BUILD_NOTES "AMX tiles for decode
batches"): ``launch.lab.bench_engine``'s decode section with this machine's measured CPU lowering
backend (variant ``amx``) or the same backend without the AMX kernel (``off``), each in its
own process, alternated:

    for v in amx off amx off; do .venv/bin/python -m launch.lab.model_speed.ab_amx_s11 $v bfloat16 none; done

Arguments: variant, --dtype, --quantize. Prints the variant, then bench_engine's JSON.
"""

from __future__ import annotations

import sys


def main() -> None:
  from absl import app

  variant, dtype, quantize = sys.argv[1:4]
  print(variant, flush=True)
  from launch.lab import bench_engine

  app.run(bench_engine.main, argv=["bench_engine", "--amx" if variant == "amx" else "--noamx",
                                   "--model", "smollm2-135m", "--dtype", dtype,
                                   "--quantize", quantize, "--sections", "decode",
                                   "--decode_batches", "16,64", "--rounds", "2", "--json"])


if __name__ == "__main__":
  main()
