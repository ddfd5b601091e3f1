#!/usr/bin/env bash
# One short, prepared check for a lent accelerator (the device tool runs it from the repo root).
# The device machine has JAX (0.11.2 on the lent H200) installed and reaches no registry: run from
# the source tree with PYTHONPATH=. (pyproject's jax>=0.12 pin is for the CPU venv; the code keeps
# working on 0.11.2). The tests run ON THE ACCELERATOR: PHASESERVE_TEST_ACCELERATOR=1 stops
# tests/conftest.py from forcing JAX_PLATFORMS=cpu. Results under $OUT (default ./device_out);
# record what it prints in BUILD_NOTES.md with the date.
set -uo pipefail
export PYTHONPATH=. PHASESERVE_TEST_ACCELERATOR=1
OUT=${OUT:-device_out}
mkdir -p "$OUT"
python -c "import jax, sys; print('jax', jax.__version__, jax.devices(), file=sys.stderr); \
assert jax.default_backend() != 'cpu', 'no accelerator visible'"
# Numerics first (f32 tolerances assume full-precision matmuls), then the engine on the device.
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 240 python -m pytest -q -x -p no:cacheprovider \
  tests/models/test_transformer.py tests/models/test_attention.py tests/models/test_paged_kv.py tests/serving/test_engine.py \
  tests/models/test_precision.py tests/models/test_gpu_paged_attention.py 2>&1 | tail -3
timeout 240 python -m launch.lab.bench_model --model small --json --dtype bfloat16 --quantize both \
  --prefill_tokens 128,512,2048 --prefill_batches 1,8 --decode_batches 1,8,64 \
  > "$OUT/bench_model.json" && tail -c 2000 "$OUT/bench_model.json"
# The engine's decode with the Pallas attention (the default on a GPU), then with the gather path.
timeout 240 python -m launch.lab.bench_engine --model small --json --sections decode,continuous \
  --trace_requests 64 --slots 32 > "$OUT/bench_engine.json" && tail -c 2000 "$OUT/bench_engine.json"
PHASESERVE_PALLAS_ATTENTION=0 timeout 240 python -m launch.lab.bench_engine --model small --json \
  --sections decode --slots 32 > "$OUT/bench_engine_gather.json" \
  && tail -c 1000 "$OUT/bench_engine_gather.json"
python -m launch.lab.plan --model palm-8b --hardware h200 --chips 1 --phase decode --batch 64 \
  --context 2048 --weights int8 --json > "$OUT/plan_h200.json"
# The Pallas decode attention compiled on the GPU against the gather path it replaces: an 8B
# model's shapes (palm-8b: 16 heads of 256 over one kv head, 32 layers), 64 rows at 8k context;
# the target is >= 2x the gather path and >= 70% of HBM bandwidth (hbm_fraction).
for k in pallas_gpu gather; do
  timeout 120 python -m launch.lab.bench_attention --kernel $k --model palm-8b --rows 8,64 \
    --context 8192 --page_size 64 --rounds 5 --hardware h200 --json > "$OUT/attention_$k.json" \
    && tail -c 600 "$OUT/attention_$k.json"
done
