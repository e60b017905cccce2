#!/bin/sh
# One client's decode through the server against the engine's own decode
# loop, alternately: bench/serve_decode.sh [BIN]
#
# On the synthetic 124.7M-parameter llama of bench/peers.sh (F16, or
# MODEL=FILE), ROUNDS times: `kvtier bench` decodes TOKENS greedy tokens
# from a frontier of DEPTH (its best of 3); then a fresh `kvtier serve
# --parallel 1` streams a TOKENS-token greedy completion of a short prompt
# to one client (tests/e2e/load.mjs decode 1), RUNS times, best kept: its
# decode rate is the tokens after the first over the time from the first
# to the last, as the client sees them (HTTP, sampling, SSE included; the
# prefill not). Each row has the load average read before it, and the
# round's ratio compares two figures taken a few seconds apart.
#
#   THREADS=N   both sides' threads (default 2)
#   ROUNDS=N    rounds (default 3)
#   RUNS=N      server runs a round, the best kept (default 2)
#   TOKENS=N    tokens a reply (default 256)
#   DEPTH=N     the bench's frontier (default 64: about the prompt's tokens)
#   MODEL=FILE  the model (default ~/.cache/kvtier/models/synth-llama-124m-f16.gguf,
#               which bench/peers.sh or bench/serve_batch.sh make)
#   PORT=N      the server's port (default: a free one)
#   DRAFT=KIND  the server's --draft (default none: the bench's loop does
#               not draft)
set -eu
me=serve_decode.sh
# shellcheck source=bench/lib.sh
. "$(dirname "$0")/lib.sh"
bench_bin "${1:-}"
bench_need node curl
cd "$root"
threads=${THREADS:-2}
rounds=${ROUNDS:-3}
runs=${RUNS:-2}
tokens=${TOKENS:-256}
depth=${DEPTH:-64}
model=${MODEL:-$HOME/.cache/kvtier/models/synth-llama-124m-f16.gguf}
[ -f "$model" ] || { echo "$me: $model not found (bench/peers.sh makes it)" >&2; exit 2; }
bench_tmp serve-decode
bench_port
load() { cut -d' ' -f1 /proc/loadavg; }

echo "cpu: $(bench_cpu), $(nproc 2>/dev/null || echo '?') cores, $threads threads; $(basename "$model"); $tokens tokens; bench from $depth; server best of $runs"
printf '%-6s %-7s %10s %6s\n' round side tok/s load
r=1
while [ "$r" -le "$rounds" ]; do
    l=$(load)
    b=$("$bin" bench --suite llama --model "$model" --threads "$threads" --prompt 0 --depth "$depth" \
        --gen "$tokens" --reps 3 2>/dev/null | awk '/decode greedy/ { print $9 }')
    [ -n "$b" ] || { echo "$me: kvtier bench printed no decode row" >&2; exit 1; }
    printf '%-6s %-7s %10s %6s\n' "$r" bench "$b" "$l"
    l=$(load)
    "$bin" serve --model "$model" --port "$port" --ctx 4096 --threads "$threads" --no-kv-disk --parallel 1 \
        --draft "${DRAFT:-none}" >>"$tmp/server.log" 2>&1 &
    pid=$!
    bench_wait_up kvtier
    s=0
    k=1
    while [ "$k" -le "$runs" ]; do
        d=$(node tests/e2e/load.mjs "$base" decode 1 "$tokens" | sed 's/.*"decode_tok_s":\([0-9.]*\).*/\1/')
        s=$(echo "$s $d" | awk '{ print ($2 > $1 ? $2 : $1) }')
        k=$((k + 1))
    done
    bench_stop strict
    printf '%-6s %-7s %10s %6s   server/bench %.2f\n' "$r" serve "$s" "$l" "$(echo "$s $b" | awk '{ print $1 / $2 }')"
    r=$((r + 1))
done
