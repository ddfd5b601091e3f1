#!/usr/bin/env bash
# JetStream's own client benchmark (benchmarks/benchmark_serving.py from PyPI google-jetstream
# 0.2.2, run unchanged in .venv-jetstream) against phaseserve's jetstream_proto.Orchestrator.
#
#   bash launch/lab/jetstream_bench/run.sh        (from the repo root; `make jetstream-bench`)
#
# Makes a synthetic ShareGPT data set and a byte-level tiktoken file (make_inputs.py), starts
# `launch.server --model tiny` on a free port (CPU), waits for readiness (one JetStream Decode via
# launch.client), runs the benchmark (llama-3 tokenizer path, token-id requests, warm-up first,
# --save-result), prints its result JSON and always stops the server (SIGTERM, then SIGKILL).
# Exit status: the benchmark's (1 if it exited 0 but saved no result; 1 if start-up failed).
# Knobs (environment): JS_VENV PS_PY OUT_DIR NUM_PROMPTS REQUEST_RATE MAX_OUTPUT MAX_CONTEXT
# SERVER_ARGS STARTUP_TIMEOUT BENCH_TIMEOUT. Outputs in OUT_DIR (default build/jetstream_bench):
# inputs/, server.log, benchmark.log, request-outputs.json, JetStream-<rate>qps-llama-3-<date>.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
JS_VENV=${JS_VENV:-$ROOT/.venv-jetstream}
PS_PY=${PS_PY:-$ROOT/.venv/bin/python}
OUT_DIR=${OUT_DIR:-$ROOT/build/jetstream_bench}
NUM_PROMPTS=${NUM_PROMPTS:-20}
REQUEST_RATE=${REQUEST_RATE:-10}
MAX_OUTPUT=${MAX_OUTPUT:-16}
MAX_CONTEXT=${MAX_CONTEXT:-256}
SERVER_ARGS=${SERVER_ARGS:-}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-300}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-600}

for f in "$JS_VENV/bin/python" "$PS_PY"; do
  [ -x "$f" ] || { echo "jetstream-bench: $f not found (make jetstream-bench builds it)" >&2; exit 1; }
done
SCRIPT=$("$JS_VENV/bin/python" -c 'import os, benchmarks; print(os.path.join(os.path.dirname(benchmarks.__file__), "benchmark_serving.py"))') \
  || { echo "jetstream-bench: google-jetstream is not installed in $JS_VENV" >&2; exit 1; }

export JAX_PLATFORMS=cpu TF_CPP_MIN_LOG_LEVEL=2 TIKTOKEN_CACHE_DIR=
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
rm -rf "$OUT_DIR"/JetStream-*.json "$OUT_DIR"/request-outputs.json "$OUT_DIR"/server.log \
  "$OUT_DIR"/benchmark.log "$OUT_DIR"/inputs
IN=$OUT_DIR/inputs
TMP=$(mktemp -d "${TMPDIR:-/tmp}/jetstream-bench.XXXXXX")
SERVER_PID= READY_PID= BENCH_PID=

cleanup() {
  local rc=$?
  for pid in $READY_PID $BENCH_PID; do kill -TERM "$pid" 2>/dev/null; done
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null
    for _ in $(seq 1 150); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "jetstream-bench: server did not stop within 30 s of SIGTERM: SIGKILL" >&2
      kill -KILL "$SERVER_PID" 2>/dev/null
    fi
    wait "$SERVER_PID" 2>/dev/null
    echo "jetstream-bench: server stopped (exit $?); log: $OUT_DIR/server.log"
  fi
  rm -rf "$TMP"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

python3 launch/lab/jetstream_bench/make_inputs.py "$IN" >/dev/null || exit 1

echo "jetstream-bench: starting launch.server --model tiny (log: $OUT_DIR/server.log)"
# shellcheck disable=SC2086
"$PS_PY" -m launch.server --model tiny --port 0 --port_file "$TMP/port" \
  --max_context "$MAX_CONTEXT" $SERVER_ARGS >"$OUT_DIR/server.log" 2>&1 &
SERVER_PID=$!

t0=$SECONDS
until [ -s "$TMP/port" ]; do
  kill -0 "$SERVER_PID" 2>/dev/null || { echo "jetstream-bench: server exited during start-up:" >&2; tail -n 30 "$OUT_DIR/server.log" >&2; exit 1; }
  (( SECONDS - t0 < STARTUP_TIMEOUT )) || { echo "jetstream-bench: no port file after ${STARTUP_TIMEOUT} s" >&2; exit 1; }
  sleep 0.2
done
PORT=$(cat "$TMP/port")

# Readiness, then one JetStream Decode (text) as a smoke test; fail fast if the server dies.
timeout "$STARTUP_TIMEOUT" "$PS_PY" -m launch.client --target "127.0.0.1:$PORT" --jetstream \
  --wait_ready "$STARTUP_TIMEOUT" --max_tokens 1 hi >"$TMP/ready.log" 2>&1 &
READY_PID=$!
while kill -0 "$READY_PID" 2>/dev/null; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$READY_PID" 2>/dev/null
    echo "jetstream-bench: server exited during start-up:" >&2; tail -n 30 "$OUT_DIR/server.log" >&2; exit 1
  fi
  sleep 0.2
done
wait "$READY_PID"
ready_rc=$?
READY_PID=
[ "$ready_rc" -eq 0 ] || { echo "jetstream-bench: server not ready:" >&2; cat "$TMP/ready.log" >&2; exit 1; }
echo "jetstream-bench: server ready on 127.0.0.1:$PORT after $((SECONDS - t0)) s ($(tail -n 1 "$TMP/ready.log"))"

echo "jetstream-bench: $SCRIPT (log: $OUT_DIR/benchmark.log)"
# The script saves its result into the current directory; run it from OUT_DIR by path, so its
# own folder is on sys.path for `from eval_accuracy import eval_accuracy`.
# In the background, so that a signal to this script stops it (and the server) at once; its full
# output is benchmark.log, shown here without its "Making request" lines and TensorFlow's banner.
: >"$OUT_DIR/benchmark.log"
( cd "$OUT_DIR" && PYTHONUNBUFFERED=1 exec timeout -k 10 "$BENCH_TIMEOUT" "$JS_VENV/bin/python" "$SCRIPT" \
    --server 127.0.0.1 --port "$PORT" \
    --model llama-3 --tokenizer "$IN/byte.tiktoken" \
    --dataset sharegpt --dataset-path "$IN/sharegpt.json" \
    --num-prompts "$NUM_PROMPTS" --request-rate "$REQUEST_RATE" \
    --max-output-length "$MAX_OUTPUT" --warmup-first true --disable-tqdm \
    --save-result --additional-metadata-metrics-to-save \
    "{\"server\": \"phaseserve\", \"server_model\": \"tiny\", \"max_context\": \"$MAX_CONTEXT\"}" \
    --save-request-outputs --request-outputs-file-path "$OUT_DIR/request-outputs.json"
) >"$OUT_DIR/benchmark.log" 2>&1 &
BENCH_PID=$!
tail -n +1 -s 0.2 -f --pid="$BENCH_PID" "$OUT_DIR/benchmark.log" | grep --line-buffered -vE \
  '^(Making request|WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR|I0000 .*(port|cudart_stub)\.cc:.*)$' &
SHOW_PID=$!
wait "$BENCH_PID"
rc=$?
BENCH_PID=
wait "$SHOW_PID"

RESULT=$(ls -t "$OUT_DIR"/JetStream-*.json 2>/dev/null | head -n 1)
if [ "$rc" -eq 0 ] && [ -z "$RESULT" ]; then
  echo "jetstream-bench: the benchmark saved no result" >&2; rc=1
fi
if [ -n "$RESULT" ]; then
  echo "jetstream-bench: result $RESULT"
  python3 -m json.tool "$RESULT"
fi
if [ "$rc" -ne 0 ]; then
  echo "jetstream-bench: benchmark failed (exit $rc); server log tail:" >&2
  tail -n 30 "$OUT_DIR/server.log" >&2
fi
exit "$rc"
