# Sourced by bench_serve.sh and startup_time.sh (needs PORT set).
#   start_server LOG CMD...  runs CMD in the background, its output in LOG, and waits
#                            for http://127.0.0.1:$PORT/health; sets SERVER (its pid)
#                            and READY_S (seconds from the start to /health answering)
#   stop_server              Ctrl-C to SERVER, then waits for it to exit

start_server() {
  local log=$1 t0 t1
  shift
  t0=$(date +%s.%N)
  "$@" >"$log" 2>&1 &
  SERVER=$!
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 "$SERVER" 2>/dev/null || { echo "server died"; tail -20 "$log"; exit 1; }
    sleep 0.2
  done
  t1=$(date +%s.%N)
  READY_S=$(python3 -c "print(f'{$t1 - $t0:.1f}')")
}

stop_server() {
  kill -INT "$SERVER" 2>/dev/null
  wait "$SERVER" 2>/dev/null
}
