#!/usr/bin/env bash
# A cold start of `jaxllm serve` and a warm restart on the same compilation cache
# folder, each followed by a mixed load (jaxllm/benchmarks/mixed_load.py: plain,
# streamed, n=2, stop strings, logprobs, chat, clients leaving mid-stream). Prints
# seconds to /health, the load's answers and the server's exit status per start.
#
#   bash scripts/restart_check.sh                          # the default model
#   NUM=2000 bash scripts/restart_check.sh configs/models/llama-3.1-8b --load-format dummy
#
# Env: NUM (requests after each start, 500), CONCURRENCY (32), CACHE (default: a new
# empty folder), PORT (8123), OUT (logs, default /tmp). Arguments go to `jaxllm serve`.
set -uo pipefail
cd "$(dirname "$0")/.."
NUM=${NUM:-500}
CONCURRENCY=${CONCURRENCY:-32}
CACHE=${CACHE:-$(mktemp -d /tmp/jaxllm-restart-XXXX)}
PORT=${PORT:-8123}
OUT=${OUT:-/tmp}
. scripts/serve_lib.sh
# A chat template for folders without one (dummy-weight configs).
TEMPLATE="$OUT/chatml.jinja"
printf '%s' "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}" > "$TEMPLATE"
status=0
for run in cold warm; do
  log="$OUT/restart-$run.log"
  start_server "$log" python3 -m jaxllm.entrypoints.cli serve "$@" --port "$PORT" \
    --compilation-cache-dir "$CACHE" --chat-template "$TEMPLATE"
  echo "$run start to /health: $READY_S s"
  grep -h "programs ready" "$log" | sed 's/^.*INFO /  /'
  python3 -m jaxllm.benchmarks.mixed_load "http://127.0.0.1:$PORT" --num "$NUM" \
    --concurrency "$CONCURRENCY" --seed "${#run}" || status=1
  curl -s -o /dev/null -w "  /health after the load: %{http_code}\n" "http://127.0.0.1:$PORT/health"
  stop_server
  echo "  exit status: $? ; engine deaths in the log: $(grep -c 'engine process died' "$log")"
done
exit $status
