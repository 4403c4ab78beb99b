#!/usr/bin/env bash
# `serve` workload of BENCHMARKS.md and server start-up, one command:
#   1. cold start of `jaxllm serve` (empty compile cache) to /health answering,
#   2. `jaxllm bench serve` at request rate inf (the throughput requests over HTTP)
#      and at a fixed rate,
#   3. stop, start again on the filled compile cache: warm restart to /health.
# Then the offline `throughput` number to compare with comes from bench_h200.py.
#
#   MODEL=configs/models/llama-3.1-8b bash scripts/bench_serve.sh
#
# Env: MODEL (a folder with config.json; dummy weights), NUM_PROMPTS (1000),
# RATE (8), RATE_PROMPTS (200; 0 skips the fixed-rate run), WARM (1; 0 skips the warm
# restart), PORT (8000), OUT (results folder, default .), EXTRA (more `jaxllm serve` flags),
# CACHE (compile cache folder; default a new empty one, i.e. a cold start).
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-configs/models/llama-3.1-8b}
NUM_PROMPTS=${NUM_PROMPTS:-1000}
RATE=${RATE:-8}
RATE_PROMPTS=${RATE_PROMPTS:-200}
PORT=${PORT:-8000}
OUT=${OUT:-.}
CACHE=${CACHE:-$(mktemp -d /tmp/jaxllm-xla-XXXX)}
TAG=$(basename "$MODEL")
JAXLLM=(python3 -m jaxllm.entrypoints.cli)

. scripts/serve_lib.sh
SERVE=("${JAXLLM[@]}" serve "$MODEL" --load-format dummy --dtype bfloat16 --max-model-len 2048
       --port "$PORT" --compilation-cache-dir "$CACHE" ${EXTRA:-})

start_server "$OUT/serve-$TAG-cold.log" "${SERVE[@]}"
cold=$READY_S
echo "cold start to /health: $cold s"
for spec in "inf $NUM_PROMPTS" "$RATE $RATE_PROMPTS"; do
  set -- $spec
  [ "$2" = 0 ] && continue
  "${JAXLLM[@]}" bench serve --port "$PORT" --tokenizer "$MODEL" --num-prompts "$2" \
    --input-len 1024 --output-len 128 --ignore-eos --request-rate "$1" --disable-tqdm \
    --save-result --result-dir "$OUT" --result-filename "serve-$TAG-rate-$1.json" \
    2>&1 | grep -v "Warning\|httpx"
done
stop_server
if [ "${WARM:-1}" = 0 ]; then
  echo "{\"model\": \"$MODEL\", \"cold_start_s\": $cold}" >"$OUT/serve-$TAG-startup.json"
  exit 0
fi
start_server "$OUT/serve-$TAG-warm.log" "${SERVE[@]}"
warm=$READY_S
echo "warm restart to /health: $warm s"
grep -h "compilation cache\|engine ready" "$OUT/serve-$TAG-warm.log" | tail -2
stop_server
echo "{\"model\": \"$MODEL\", \"cold_start_s\": $cold, \"warm_restart_s\": $warm}" \
  >"$OUT/serve-$TAG-startup.json"
