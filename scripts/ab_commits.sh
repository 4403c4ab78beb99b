#!/usr/bin/env bash
# Two commits on one card, back to back: bench_h200's workloads, then warm restarts of
# `jaxllm serve`. OLD is a folder holding the old commit's tree, e.g.
#   mkdir -p .ab/old && git archive OLD_SHA jaxllm pallas_kernels scripts configs pyproject.toml | tar -x -C .ab/old
#   bash scripts/ab_commits.sh .ab/old configs/models/llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 2048
# Order old, new, new, old for the benchmarks (each side once cold, once on a filled
# compile cache); then a cold start per side and ROUNDS warm restarts alternating.
# Env: WORKLOADS (latency,decode-1,throughput), BENCH_ARGS (more bench_h200 flags, e.g.
# "--quantization fp8 --profile"), ROUNDS (3), PHASES ("bench warm"), OUT (logs and
# JSON, default /tmp/ab). Arguments after OLD go to `jaxllm serve`.
set -u
OLD=$(cd "$1" && pwd); shift
NEW=$(cd "$(dirname "$0")/.." && pwd)
ARGS=("$@")
OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
tree() { [ "$1" = old ] && echo "$OLD" || echo "$NEW"; }
bench() {  # side pass
  (cd "$(tree "$1")" && python3 scripts/bench_h200.py --workloads "${WORKLOADS:-latency,decode-1,throughput}" \
     --repeat 3 --compile-cache "/tmp/ab-cc-$1" --tag="-$1-$2" ${BENCH_ARGS:-}) \
     >"$OUT/ab-$1-$2.log" 2>&1
  echo "$1 pass $2:"; grep -A4 "^== " "$OUT/ab-$1-$2.log" || tail -20 "$OUT/ab-$1-$2.log"
}
serve() {  # side cold|warm
  (cd "$(tree "$1")" && RUNS=$2 CACHE="/tmp/ab-serve-$1" OUT="$OUT" PORT=${PORT:-8131} \
     bash scripts/startup_time.sh "${ARGS[@]}") | grep "start to /health" | sed "s/^/$1 /"
}
for phase in ${PHASES:-bench warm}; do
  if [ "$phase" = bench ]; then
    bench old 1; bench new 1; bench new 2; bench old 2
  else
    for side in old new; do serve "$side" cold; done
    for _ in $(seq "${ROUNDS:-3}"); do for side in old new; do serve "$side" warm; done; done
  fi
done
