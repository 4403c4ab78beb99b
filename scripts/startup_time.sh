#!/usr/bin/env bash
# Start-up time of `jaxllm serve` to /health answering (docs/benchmarks.md's method):
# a cold start on an empty compilation cache folder, then a warm restart on the same
# folder. Prints seconds to /health and the engine's own breakdown per start.
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

start() {   # $1: cold | warm
  local log="$OUT/startup-$1.log" t0 t1 pid
  t0=$(date +%s.%N)
  python3 -m jaxllm.entrypoints.cli serve "${ARGS[@]}" --port "$PORT" \
    --compilation-cache-dir "$CACHE" >"$log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "$1: server died"; tail -20 "$log"; exit 1; }
    sleep 0.2
  done
  t1=$(date +%s.%N)
  kill -INT "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  python3 -c "print(f'$1 start to /health: {$t1 - $t0:.1f} s')"
  grep -h "engine ready\|programs:" "$log" | sed 's/^/  /'
}

ARGS=("$@")
for run in $RUNS; do
  [ "$run" = cold ] && rm -rf "$CACHE" && mkdir -p "$CACHE"
  start "$run"
done
echo "cache folder: $CACHE"
