#!/bin/sh
# Times between tokens while other requests' sessions are saved:
# bench/storeq.sh [BIN]
#
# The timing that tests/test_storeq.c checked as storeq_save_itl, here
# because a time is no unit test's to check (it failed on a loaded
# machine): the suite checks the property it stood for by a count
# instead (storeq_steps_never_wait: no round of the scheduler waited on
# the store). The model: the synthetic llama-124m that bench/peers.sh
# writes ($cache/models/synth-llama-124m-f16.gguf; written here from the
# llama SPM vocabulary of ../shared/vocab when missing). One server with
# 32 API keys (two pooled sessions a key), --parallel 4, --threads
# THREADS, --ctx 4096, and a save policy that saves nothing at the end of
# a prefill; tests/e2e/storeq.mjs leaves a 3,600-token session and a
# short one in RAM for each of three keys, then runs two streams of 480
# tokens while each of those keys sends a short request whose new
# session evicts its long one (a save of the whole session, on the store
# thread). It prints the times between the streams' tokens (median, p99,
# max) and fails when the p99 is above three times the median. Method and
# results: bench/SERVE.md, "Times between tokens while sessions are saved".
#
#   KVT_PEER_CACHE=DIR  models and tools (default ~/.cache/kvtier)
#   THREADS=N           the server's compute threads (default 1)
#   PORT=N              the server's port (default: a free one)
set -eu
me=storeq.sh
# shellcheck source=bench/lib.sh
. "$(dirname "$0")/lib.sh"
bench_bin "${1:-}"
bench_need node curl
cd "$root"
cache=${KVT_PEER_CACHE:-$HOME/.cache/kvtier}
threads=${THREADS:-1}
model=$cache/models/synth-llama-124m-f16.gguf
if [ ! -f "$model" ]; then
    vocab=${KVT_SHARED:-../shared}/vocab/ggml-vocab-llama-spm.gguf
    [ -f "$vocab" ] || { echo "$me: no $model, and no $vocab to write it from" >&2; exit 2; }
    bench_lib
    bench_need cc
    bench_synth_llama
    "$cache/tools/synth_llama" "$vocab" "$model.part" >&2
    mv "$model.part" "$model"
fi

bench_tmp storeq
keys=32
i=0
while [ $i -lt $keys ]; do printf 'k%02d\n' $i; i=$((i + 1)); done >"$tmp/keys"
if [ -n "${PORT:-}" ]; then port=$PORT; base=http://127.0.0.1:$port; else bench_port; fi
"$bin" serve --model "$model" --host 127.0.0.1 --port "$port" --ctx 4096 --threads "$threads" --parallel 4 \
    --kv-disk-dir "$tmp/kv" --api-key-file "$tmp/keys" \
    --kv-cache-align-tokens 8192 --kv-cache-continued-interval 8192 >"$tmp/server.log" 2>&1 &
pid=$!
bench_wait_up kvtier
echo "$me: $(bench_cpu), load $(cut -d' ' -f1-3 /proc/loadavg), --threads $threads, $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
rc=0
node tests/e2e/storeq.mjs "$base" "$keys" || rc=$?
bench_stop strict
exit $rc
