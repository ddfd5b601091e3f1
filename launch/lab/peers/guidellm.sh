#!/bin/bash
# GuideLLM (make peers-guidellm: guidellm 0.8.1 in .venv-guidellm) with its stock OpenAI HTTP
# backend (streamed chat completions, continuous usage in every chunk) against phaseserve with no
# flag but the model: PROFILE (GuideLLM's: poisson at RATE, sweep, synchronous, ...) on
# synthetic prompts for SECONDS; prints GuideLLM's report and the server's request counters, and
# fails when any request errored.
#   launch/lab/peers/guidellm.sh [RATE (1.0)] [SECONDS (40)] [NAME (default)] [PROFILE (poisson)]
# The tokenizer GuideLLM counts with: the Hugging Face export under build/mlperf/model/hf
# (written here when missing, as mlperf_side_by_side.sh does). Output under build/guidellm/NAME/.
set -u
cd "$(dirname "$0")/../../.."
RATE=${1:-1.0}; SECS=${2:-40}; NAME=${3:-default}; PROFILE=${4:-poisson}
OUT=build/guidellm/$NAME; HF=build/mlperf/model/hf
mkdir -p "$OUT"
[ -f $HF/config.json ] || .venv/bin/python -c "from pathlib import Path; from launch.lab.peers import core; \
core.write_model(core.PeersConfig(model='smollm2-135m', out='build/mlperf'), Path('build/mlperf'))"
P=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
.venv/bin/python -m launch.server --model smollm2-135m --port 0 --http_port "$P" > "$OUT/server.log" 2>&1 &
S=$!
trap 'kill -TERM $S 2>/dev/null; wait $S 2>/dev/null' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$P/ready" > /dev/null && break
  kill -0 $S 2>/dev/null || { echo "the server exited: see $OUT/server.log"; exit 1; }
  sleep 1
done
HF_HUB_OFFLINE=1 .venv-guidellm/bin/guidellm run \
  --backend kind=openai_http,target=http://127.0.0.1:$P \
  --profile kind=$PROFILE$([ "$PROFILE" = poisson ] && echo ",rate=$RATE") --constraint kind=max_duration,seconds=$SECS \
  --data kind=synthetic_text,prompt_tokens=128,output_tokens=64 \
  --tokenizer kind=huggingface_auto,model=$HF \
  --output kind=json,path=$OUT/guidellm.json --disable-console-interactive 2>&1 | tee "$OUT/report.txt"
curl -s "http://127.0.0.1:$P/metrics" > "$OUT/metrics.txt"
grep -E '^phaseserve_(rejections|requests)_total' "$OUT/metrics.txt"
.venv/bin/python - "$OUT/guidellm.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
b = d["benchmarks"][0]
totals = b["metrics"]["request_totals"]
print("request totals:", json.dumps(totals))
sys.exit(1 if totals.get("errored", 0) else 0)
PY
