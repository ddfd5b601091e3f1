#!/usr/bin/env bash
# One short, prepared check for a lent accelerator (the device tool runs it from the repo root).
# The device machine has JAX installed and reaches no registry: run from the source tree.
# Writes results under $OUT (default ./device_out). Not yet run on a device (none was lent when
# this was written); record what it prints in BUILD_NOTES.md with the date.
set -uo pipefail
export PYTHONPATH=.
OUT=${OUT:-device_out}
mkdir -p "$OUT"
python -c "import jax, sys; print('jax', jax.__version__, jax.devices(), file=sys.stderr)"
# Numerics first (f32 tolerances assume full-precision matmuls).
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 180 python -m pytest -q -x -p no:cacheprovider \
  tests/test_transformer.py tests/test_attention.py tests/test_generator.py 2>&1 | tail -3
timeout 300 python -m launch.bench_model --model small --json --dtype bfloat16 --quantize both \
  --prefill_tokens 128,512,2048 --prefill_batches 1,8 --decode_batches 1,8,64 \
  > "$OUT/bench_model.json" && tail -c 3000 "$OUT/bench_model.json"
python -m launch.plan --model palm-8b --hardware h200 --chips 1 --phase decode --batch 64 \
  --context 2048 --weights int8 --json > "$OUT/plan_h200.json"
