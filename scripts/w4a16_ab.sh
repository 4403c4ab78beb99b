#!/usr/bin/env bash
# One device call: sweep the Mosaic W4A16 kernel's settings per projection
# (scripts/w4a16_sweep.py), then the AWQ engine with the kernel's defaults and with the
# sweep's pick (JAXLLM_W4A16_SETTINGS), greedy digests compared, then bf16 beside them.
#
#   BUDGET=560 bash scripts/w4a16_ab.sh
#
# Each engine run is cut to what the call has left; logs and JSON go to $OUT.
set -u
cd "$(dirname "$0")/.."
BUDGET_DEFAULT=560
CC=/tmp/w4a16-ab-cc
. scripts/device_lib.sh
timeout $(( $(left) - 330 )) python3 scripts/w4a16_sweep.py ${PROJS:+--projs $PROJS} \
  > "$LOGS/sweep.log" 2>&1
echo "sweep rc $? at $(( $(date +%s) - T0 )) s"
sed -n '/^    proj /,$p' "$LOGS/sweep.log"
grep -m5 FAILED "$LOGS/sweep.log"
PICK=$(cat "$LOGS/w4a16_pick.json" 2>/dev/null || echo '{}')
AWQ="--workloads digest,latency,decode-1 --repeat 3 --quantization awq"
if [ "$PICK" != "{}" ]; then
  JAXLLM_W4A16_SETTINGS=$PICK engine pick 150 $AWQ
  JAXLLM_W4A16_SETTINGS='{}' engine dflt 150 $AWQ
  a=$LOGS/bench_h200_dflt.json b=$LOGS/bench_h200_pick.json
  [ -f "$a" ] && [ -f "$b" ] && python3 scripts/bench_h200.py --compare-digests "$a" "$b"
else
  echo "no pick: the defaults won every projection"
  JAXLLM_W4A16_SETTINGS='{}' engine dflt 150 $AWQ
fi
JAXLLM_W4A16_SETTINGS='{}' engine bf16 130 --workloads latency,decode-1 --repeat 3
echo "done at $(( $(date +%s) - T0 )) s"
