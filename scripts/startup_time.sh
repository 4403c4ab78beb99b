#!/usr/bin/env bash
# Start-up time of `jaxllm serve` to /health answering (docs/benchmarks.md's method):
# a cold start on an empty compilation cache folder, then a warm restart on the same
# folder. Prints seconds to /health and the start-up timeline the log gives per start:
# the engine's breakdown ("engine ready in"), the engine process's from its spawn
# ("engine core ready"), and the server process's to listening ("server ready in"),
# then the time of a first chat completion sent once /health answers.
#
#   bash scripts/startup_time.sh                 # default model, cold then warm
#   RUNS=warm CACHE=/tmp/xc bash scripts/startup_time.sh --max-num-seqs 64
#
# Env: RUNS ("cold warm"; "warm" alone reuses CACHE as it is), CACHE (default: a
# fresh temp folder), PORT (8123), OUT (logs folder, default /tmp). Arguments are
# passed to `jaxllm serve` (a model path first, if any).
set -uo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-cold warm}
CACHE=${CACHE:-$(mktemp -d /tmp/jaxllm-startup-XXXX)}
PORT=${PORT:-8123}
OUT=${OUT:-/tmp}

. scripts/serve_lib.sh

start() {   # $1: cold | warm
  local log="$OUT/startup-$1.log"
  start_server "$log" python3 -m jaxllm.entrypoints.cli serve "${ARGS[@]}" --port "$PORT" \
    --compilation-cache-dir "$CACHE"
  local t0 t1 code
  t0=$(date +%s.%N)
  code=$(curl -s -o "$OUT/startup-$1-first.json" -w '%{http_code}' \
    "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model": "'"$(curl -s "http://127.0.0.1:$PORT/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')"'", "messages": [{"role": "user", "content": "Say hello in one sentence."}], "max_tokens": 32}')
  t1=$(date +%s.%N)
  stop_server
  echo "$1 start to /health: $READY_S s; first chat completion (32 tokens) HTTP $code in $(python3 -c "print(f'{$t1 - $t0:.1f}')") s after"
  grep -h "engine ready\|programs:\|engine core ready\|server ready" "$log" | sed 's/^/  /'
}

ARGS=("$@")
for run in $RUNS; do
  [ "$run" = cold ] && rm -rf "$CACHE" && mkdir -p "$CACHE"
  start "$run"
done
echo "cache folder: $CACHE"
