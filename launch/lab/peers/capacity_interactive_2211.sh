#!/bin/bash
# capacity at MLPerf's interactive SLO: vLLM then phaseserve, same HF dir, same loadgen flags
# (the run behind results/peers/capacity_interactive_2211/; paths relative to the repository root)
cd "$(dirname "$0")/../../.."
OUT=build/peers3/raw/capacity_interactive
mkdir -p $OUT
LG="--api openai --model smollm2-135m --vocab_size 49152 --max_context 1024 --find_capacity --profile interactive --slo interactive --rate 1 --max_rate 16 --search_steps 2 --num_requests 64 --seed 0"
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
wait_http() { for i in $(seq 900); do curl -sf http://127.0.0.1:$1/v1/models >/dev/null && return 0; sleep 1; done; return 1; }
P=$(port)
VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model build/peers3/model/hf --served-model-name smollm2-135m --dtype bfloat16 --max-model-len 1024 --host 127.0.0.1 --port $P > $OUT/vllm_server.log 2>&1 &
S=$!
wait_http $P && echo "vllm up $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)" && .venv/bin/python -m launch.lab.loadgen --target http://127.0.0.1:$P $LG --out $OUT/vllm > $OUT/vllm_loadgen.log 2>&1; echo "vllm rc $? $(date +%T)"
kill $S; wait $S 2>/dev/null
P=$(port)
.venv/bin/python -m launch.server --model build/peers3/model/hf --dtype bfloat16 --port 0 --http_port $P --served_model_name smollm2-135m --max_context 1024 --early_reject=false > $OUT/ps_server.log 2>&1 &
S=$!
for i in $(seq 900); do grep -q 'serving (start' $OUT/ps_server.log && break; sleep 1; done
echo "phaseserve up $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"; .venv/bin/python -m launch.lab.loadgen --target http://127.0.0.1:$P $LG --out $OUT/phaseserve > $OUT/ps_loadgen.log 2>&1; echo "ps rc $? $(date +%T)"
kill -TERM $S; wait $S 2>/dev/null
