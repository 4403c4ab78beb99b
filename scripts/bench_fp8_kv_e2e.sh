#!/usr/bin/env bash
# Issue 19 end to end: bench_h200.py's `long-context` workload (64 requests x 7,000
# random prompt tokens in, 256 greedy tokens out, all at once through LLM.generate)
# with bf16 KV and then with fp8 KV, and one line comparing the median wall-clock
# seconds. Each run is its own process: JAX keeps the card's memory until exit.
#
#   bash scripts/bench_fp8_kv_e2e.sh [--repeat 3] [--compile-cache DIR] [bench_h200 args]
#
# Arguments go to both runs after the defaults here, so a later flag wins (--model,
# --max-model-len, --long-shape ...). Logs, and bench_h200's JSON (bench_h200-long-kv-
# {auto,fp8}.json), go to $OUT when it is set, else to a temporary folder.
set -u
cd "$(dirname "$0")/.."
LOGS=${OUT:-$(mktemp -d)}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
for kv in auto fp8; do
  echo "== long-context, --kv-cache-dtype $kv"
  python3 scripts/bench_h200.py --workloads long-context --max-model-len 8192 --repeat 3 \
    --kv-cache-dtype "$kv" --tag="-long-kv-$kv" "$@" 2>&1 | tee "$LOGS/long-kv-$kv.log"
done
python3 - "$LOGS" <<'EOF'
import json, sys
def seconds(kv):
    """The median seconds from the run's `long-context {...}` line, or why none."""
    for line in open(f"{sys.argv[1]}/long-kv-{kv}.log"):
        if line.startswith("long-context {"):
            r = json.loads(line.split(" ", 1)[1])
            return r.get("seconds_median"), r
    return None, {"error": "no long-context line in the log"}
(bf, rb), (fp, rf) = seconds("auto"), seconds("fp8")
if bf is None or fp is None:
    sys.exit(f"long-context failed: bf16 KV {rb.get('error')}; fp8 KV {rf.get('error')}")
print(f"long-context {rb['shape']}: bf16 KV {bf:.2f} s, fp8 KV {fp:.2f} s, "
      f"bf16/fp8 {bf / fp:.2f}x ({'fp8 faster' if fp < bf else 'fp8 NOT faster'})")
EOF
