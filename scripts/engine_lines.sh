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
BUDGET_DEFAULT=540
CC=${COMPILE_CACHE:-/tmp/engine-lines-cc}
. scripts/device_lib.sh
for r in ${RUNS:-bf16 fp8 awq int8}; do
  case $r in
    bf16) engine bf16 170 --workloads latency,decode-1,throughput --repeat 10 "$@" ;;
    fp8)  engine fp8 170 --workloads latency,decode-1,throughput --repeat 10 \
            --quantization fp8 "$@" ;;
    awq)  engine awq 130 --workloads latency,decode-1 --repeat 5 --quantization awq "$@" ;;
    int8) engine int8 170 --workloads latency,decode-1,throughput --repeat 3 --quantization int8 "$@" ;;
    *) echo "RUNS: $r is not one of bf16 fp8 awq int8"; exit 2 ;;
  esac
done
echo "done at $(( $(date +%s) - T0 )) s"
