# Sourced by the device-call scripts (engine_lines.sh, w4a16_ab.sh, w8a16_ab.sh) from
# the repository root, after setting BUDGET_DEFAULT (seconds) and CC (a compile-cache
# folder). Sets LOGS (= $OUT, else a temporary folder), installs the wheels of a `.whl`
# folder (../shared/tools/device-wheels), names the GPU and starts the clock; then
#   left                 seconds the script has left of ${BUDGET:-$BUDGET_DEFAULT}
#   engine TAG LIMIT ARGS...
#                        one scripts/bench_h200.py run (--compile-cache $CC --tag _TAG
#                        ARGS), cut to what is left, skipped under 60 s; its log to
#                        $LOGS/TAG.log, its table and first errors printed. Variables
#                        assigned before the call (`JAXLLM_X=1 engine ...`) reach it.
LOGS=${OUT:-$(mktemp -d)}; mkdir -p "$LOGS"
export OUT=$LOGS PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
T0=$(date +%s)

left() { echo $(( ${BUDGET:-$BUDGET_DEFAULT} - $(date +%s) + T0 )); }

engine() {
  local tag=$1 lim=$2 l; shift 2
  l=$(left)
  if [ "$l" -lt 60 ]; then echo "$tag: skipped, $l s left"; return; fi
  [ "$lim" -gt "$l" ] && lim=$l
  echo "--- $tag (limit $lim s, at $(( $(date +%s) - T0 )) s)"
  timeout "$lim" python3 scripts/bench_h200.py --compile-cache "$CC" --tag "_$tag" "$@" \
    > "$LOGS/$tag.log" 2>&1
  echo "rc $?"
  sed -n '/^== /,$p' "$LOGS/$tag.log"
  grep -m3 -E "Error|error" "$LOGS/$tag.log"
}
