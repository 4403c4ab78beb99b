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
LOGS=${OUT:-$(mktemp -d)}; mkdir -p "$LOGS"
export OUT=$LOGS PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
T0=$(date +%s)
CC=/tmp/w8a16-ab-cc
left() { echo $(( ${BUDGET:-570} - $(date +%s) + T0 )); }
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
engine() {  # tag limit switch settings-json [bench_h200 args]
  local tag=$1 lim=$2 sw=$3 set=$4; shift 4
  local l; l=$(left)
  if [ "$l" -lt 60 ]; then echo "$tag: skipped, $l s left"; return; fi
  [ "$lim" -gt "$l" ] && lim=$l
  echo "--- $tag (limit $lim s, at $(( $(date +%s) - T0 )) s)"
  JAXLLM_FP8_MOSAIC=$sw JAXLLM_W8A16_SETTINGS=$set timeout "$lim" \
    python3 scripts/bench_h200.py --compile-cache "$CC" --tag "_$tag" "$@" > "$LOGS/$tag.log" 2>&1
  echo "rc $?"
  sed -n '/^== /,$p' "$LOGS/$tag.log"
  grep -m3 -E "Error|error" "$LOGS/$tag.log"
}
FP8="--workloads digest,latency,decode-1 --repeat ${REPEAT:-5} --quantization fp8"
engine mosaic 150 1 "$PICK" $FP8
engine xla 150 0 '{}' $FP8
a=$LOGS/bench_h200_xla.json b=$LOGS/bench_h200_mosaic.json
[ -f "$a" ] && [ -f "$b" ] && python3 scripts/bench_h200.py --compare-digests "$a" "$b"
engine bf16 130 0 '{}' --workloads latency,decode-1 --repeat 5
echo "done at $(( $(date +%s) - T0 )) s"
