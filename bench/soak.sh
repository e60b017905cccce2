#!/bin/sh
# A bounded load test of kvtier's server on loopback, run by hand (not in
# CI): bench/soak.sh [BIN]
#
# The server (ds4-tiny by default: fast enough that 64 clients keep its
# slots, queue and disk tier busy) runs with a fresh --kv-disk-dir while
# CLIENTS clients send mixed requests for SOAK_SECONDS (tests/e2e/soak.mjs:
# long shared system prompts and short ones, chat and completions,
# streaming or not, one in eight hanging up early). Its resident memory is
# sampled every 5 s. Then it must exit 0 on SIGTERM, `kvtier cache verify`
# must find no damage, and after a restart on the same directory REPLAY of
# the answered prompts must get the same replies as under load, served
# with no room in RAM (--kv-ram-mb 1), so each looks at the disk tier. Prints the figures; exits 1 on
# a failed check.
#
#   SOAK_SECONDS=N  the load's length (default 600)
#   CLIENTS=N   clients at once (default 64)
#   MODEL=M     the model (default ds4-tiny)
#   ARGS="..."  more serve arguments (e.g. --parallel 8)
#   REPLAY=N    prompts replayed after the restart (default 60)
set -eu
me=soak.sh
# shellcheck source=bench/lib.sh
. "$(dirname "$0")/lib.sh"
bench_bin "${1:-}"
bench_need node curl
secs=${SOAK_SECONDS:-600}
clients=${CLIENTS:-64}
model=${MODEL:-ds4-tiny}
replay=${REPLAY:-60}
cd "$root"
bench_tmp soak
bench_port

start() {
    # shellcheck disable=SC2086
    "$bin" serve --model "$model" --port "$port" --kv-disk-dir "$tmp/kv" ${ARGS:-} >>"$tmp/server.log" 2>&1 &
    pid=$!
    bench_wait_up kvtier
}

stop() { bench_stop strict; } # the server must exit 0 on SIGTERM

start
head -n 1 "$tmp/server.log"
(while kill -0 "$pid" 2>/dev/null; do
    printf '%s %s\n' "$(date +%s)" "$(awk '/^VmRSS/ { print $2 }' "/proc/$pid/status" 2>/dev/null)"
    sleep 5
done) >"$tmp/rss" &
sampler=$!
t0=$(date +%s)
echo "soak.sh: $clients clients for $secs s against $model"
node tests/e2e/soak.mjs "$base" load "$secs" "$clients" "$tmp/answered.json" || { echo "soak.sh: the load failed" >&2; exit 1; }
curl -s "$base/metrics" | grep -E '^kvtier_(requests_total|canceled_total|disk_saves_total|step_requests_max|steps_total|step_requests_total|cache_entries)' || true
stop
kill "$sampler" 2>/dev/null || true
# resident memory: after the first fifth of the run (warm-up), its range,
# and its level at each further fifth
awk -v t0="$t0" -v warm=$((secs / 5)) '
    $2 != "" { t = $1 - t0; if (t <= warm) w = $2; else { if (!n || $2 > hi) hi = $2; if (!n || $2 < lo) lo = $2; n++
               q = int(t / warm); at[q] = $2 } }
    END { printf "resident memory: %d KiB at the end of warm-up (%d s); after it %d to %d KiB in %d samples (%+.1f%%); at each fifth:",
          w, warm, lo, hi, n, w ? 100 * (hi - w) / w : 0
          for (q = 1; q <= 5; q++) if (q in at) printf " %d", at[q]
          printf " KiB\n" }' "$tmp/rss"
"$bin" cache verify --kv-disk-dir "$tmp/kv" || { echo "soak.sh: cache verify found damage" >&2; exit 1; }
# the replay with no room in RAM: each prompt is looked up on disk
ARGS="${ARGS:-} --kv-ram-mb 1" start
node tests/e2e/soak.mjs "$base" replay "$tmp/answered.json" "$replay" || { echo "soak.sh: a replayed reply differs" >&2; exit 1; }
stop
echo "soak.sh: passed"
