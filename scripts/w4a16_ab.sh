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
LOGS=${OUT:-$(mktemp -d)}; mkdir -p "$LOGS"
export OUT=$LOGS PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
T0=$(date +%s)
CC=/tmp/w4a16-ab-cc
left() { echo $(( ${BUDGET:-560} - $(date +%s) + T0 )); }
timeout $(( $(left) - 330 )) python3 scripts/w4a16_sweep.py ${PROJS:+--projs $PROJS} \
  > "$LOGS/sweep.log" 2>&1
echo "sweep rc $? at $(( $(date +%s) - T0 )) s"
sed -n '/^    proj /,$p' "$LOGS/sweep.log"
grep -m5 FAILED "$LOGS/sweep.log"
PICK=$(cat "$LOGS/w4a16_pick.json" 2>/dev/null || echo '{}')
engine() {  # tag limit settings-json [bench_h200 args]
  local tag=$1 lim=$2 set=$3; shift 3
  local l; l=$(left)
  if [ "$l" -lt 60 ]; then echo "$tag: skipped, $l s left"; return; fi
  [ "$lim" -gt "$l" ] && lim=$l
  echo "--- $tag (limit $lim s, at $(( $(date +%s) - T0 )) s)"
  JAXLLM_W4A16_SETTINGS=$set timeout "$lim" python3 scripts/bench_h200.py \
    --compile-cache "$CC" --tag "_$tag" "$@" > "$LOGS/$tag.log" 2>&1
  echo "rc $?"
  sed -n '/^== /,$p' "$LOGS/$tag.log"
  grep -m3 -E "Error|error" "$LOGS/$tag.log"
}
AWQ="--workloads digest,latency,decode-1 --repeat 3 --quantization awq"
if [ "$PICK" != "{}" ]; then
  engine pick 150 "$PICK" $AWQ
  engine dflt 150 '{}' $AWQ
  a=$LOGS/bench_h200_dflt.json b=$LOGS/bench_h200_pick.json
  [ -f "$a" ] && [ -f "$b" ] && python3 scripts/bench_h200.py --compare-digests "$a" "$b"
else
  echo "no pick: the defaults won every projection"
  engine dflt 150 '{}' $AWQ
fi
engine bf16 130 '{}' --workloads latency,decode-1 --repeat 3
echo "done at $(( $(date +%s) - T0 )) s"
