#!/usr/bin/env bash
# The open issues' engine lines in one device call (one process a run: JAX keeps the
# card's memory until exit), most wanted first, each run cut to what the call has left:
#   bf16   latency (10 runs: issue 23's median and worst), decode-1, throughput
#   fp8    the same (W8A8; issue 19's and 23's FP8 lines)
#   awq    latency, decode-1 (issue 19's W4A16 line)
#   int8   latency, decode-1, throughput (issue 19's INT8 line)
#
#   BUDGET=540 RUNS="bf16 fp8 awq int8" bash scripts/engine_lines.sh [bench_h200 args]
#
# BUDGET: seconds for the whole script (start it with the call's limit less ~30 s);
# a run that would start with under 60 s left is skipped and says so. Arguments go to
# every run (a later flag wins). With a `.whl` folder (../shared/tools/device-wheels)
# its wheels are installed first. Logs and bench_h200's JSON go to $OUT (else a
# temporary folder); the last lines printed are each run's table.
set -u
cd "$(dirname "$0")/.."
LOGS=${OUT:-$(mktemp -d)}; mkdir -p "$LOGS"
export OUT=$LOGS PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
T0=$(date +%s)
CC=${COMPILE_CACHE:-/tmp/engine-lines-cc}
run() {  # tag limit_s bench_h200 args...
  local tag=$1 lim=$2; shift 2
  local left=$(( ${BUDGET:-540} - $(date +%s) + T0 ))
  if [ "$left" -lt 60 ]; then echo "$tag: skipped, ${left} s left"; return; fi
  [ "$lim" -gt "$left" ] && lim=$left
  echo "--- $tag (limit ${lim} s, at $(( $(date +%s) - T0 )) s)"
  timeout "$lim" python3 scripts/bench_h200.py --compile-cache "$CC" --tag "_$tag" "$@" \
    > "$LOGS/$tag.log" 2>&1
  echo "rc $?"
  sed -n '/^== /,$p' "$LOGS/$tag.log"
  grep -m3 -E "Error|error" "$LOGS/$tag.log"
}
for r in ${RUNS:-bf16 fp8 awq int8}; do
  case $r in
    bf16) run bf16 170 --workloads latency,decode-1,throughput --repeat 10 "$@" ;;
    fp8)  run fp8 170 --workloads latency,decode-1,throughput --repeat 10 \
            --quantization fp8 "$@" ;;
    awq)  run awq 130 --workloads latency,decode-1 --repeat 5 --quantization awq "$@" ;;
    int8) run int8 170 --workloads latency,decode-1,throughput --repeat 3 --quantization int8 "$@" ;;
    *) echo "RUNS: $r is not one of bf16 fp8 awq int8"; exit 2 ;;
  esac
done
echo "done at $(( $(date +%s) - T0 )) s"
