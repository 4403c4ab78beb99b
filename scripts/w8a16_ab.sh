#!/usr/bin/env bash
# One device call: the Mosaic weight-only FP8 kernel against its peers and a sweep of
# its settings (scripts/w8a16_sweep.py), then the online-FP8 engine with the kernel
# (JAXLLM_FP8_MOSAIC=1, the sweep's pick in JAXLLM_W8A16_SETTINGS) and without it
# (XLA's Triton GEMMs, the default), greedy digests compared; bf16 after, if time is left.
#
#   BUDGET=570 bash scripts/w8a16_ab.sh   (SWEEP=0: the engines only; SKIP_PEERS=1: the
#   sweep without the peer table; RESERVE: seconds kept for the engines, 330;
#   ENGINE_IF_AHEAD=1: the engines only where the sweep's layer beat XLA's)
#
# Each engine run is cut to what the call has left; logs and JSON go to $OUT.
set -u
cd "$(dirname "$0")/.."
BUDGET_DEFAULT=570
CC=/tmp/w8a16-ab-cc
. scripts/device_lib.sh
if [ "${SWEEP:-1}" = 1 ]; then
  timeout $(( $(left) - ${RESERVE:-330} )) python3 scripts/w8a16_sweep.py ${PROJS:+--projs $PROJS} \
    ${SKIP_PEERS:+--skip-peers} ${PEER_MS:+--peer-ms $PEER_MS} > "$LOGS/sweep.log" 2>&1
  echo "sweep rc $? at $(( $(date +%s) - T0 )) s"
  grep -E "^ +(variant|default) " "$LOGS/sweep.log"
  sed -n '/^    proj /,$p' "$LOGS/sweep.log"
  grep -m5 FAILED "$LOGS/sweep.log"
fi
PICK=$(cat "$LOGS/w8a16_pick.json" 2>/dev/null || echo '{}')
if [ "${ENGINE_IF_AHEAD:-0}" = 1 ] && [ "$(cat "$LOGS/w8a16_verdict.txt" 2>/dev/null)" != ahead ]; then
  echo "engines skipped: the kernel's layer is not ahead of XLA's (ENGINE_IF_AHEAD=1)"
  exit 0
fi
FP8="--workloads digest,latency,decode-1 --repeat ${REPEAT:-5} --quantization fp8"
JAXLLM_FP8_MOSAIC=1 JAXLLM_W8A16_SETTINGS=$PICK engine mosaic 150 $FP8
JAXLLM_FP8_MOSAIC=0 JAXLLM_W8A16_SETTINGS='{}' engine xla 150 $FP8
a=$LOGS/bench_h200_xla.json b=$LOGS/bench_h200_mosaic.json
[ -f "$a" ] && [ -f "$b" ] && python3 scripts/bench_h200.py --compare-digests "$a" "$b"
JAXLLM_FP8_MOSAIC=0 JAXLLM_W8A16_SETTINGS='{}' engine bf16 130 --workloads latency,decode-1 --repeat 5
echo "done at $(( $(date +%s) - T0 )) s"
