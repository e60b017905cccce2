#!/bin/sh
# Several clients at once, kvtier's server beside llama.cpp's on the same
# file and the same requests: bench/serve_batch.sh [BIN]
#
# The model is the synthetic 124.7M-parameter llama of bench/peers.sh
# (bench/synth_llama.c, the llama SPM vocabulary of the llama.cpp tree) in
# F16 and in Q4_K_M by llama-quantize. For each file and each count N of
# 1, 2, 4 and 8 clients, each server runs on a fresh process with N
# requests at once (kvtier --parallel N; llama.cpp -np N, each slot a
# context of 4096) and N clients each stream a completion of TOKENS tokens
# of a short prompt of their own (tests/e2e/load.mjs decode), RUNS times;
# the best run's aggregate tok/s (every client's tokens over the time from
# the first request to the last reply's end) and its slowest request are
# reported. Then, on F16 with two requests at once and a context of 32768:
# a 40,000-byte prompt (19,869 tokens) starts, and 2 s later a short
# request asks for 16 tokens: its time to first token shows whether the
# long prefill holds it up (tests/e2e/load.mjs under-prefill).
#
# The table goes to stdout, the same rows to bench/serve-batch.csv. Method
# and results: bench/SERVE.md.
#
#   KVT_PEER_CACHE=DIR  clone, build, models (default ~/.cache/kvtier; the
#                       llama.cpp build is bench/peer_llama.sh's)
#   THREADS=N           both servers' threads (default 2)
#   RUNS=N              runs of each cell, the best kept (default 3)
#   TOKENS=N            tokens per client (default 64)
#   COUNTS="1 2 4 8"    the client counts
#   PREFILL=0           leave out the long-prefill case
#   DECODE=0            leave out the client counts (the long-prefill case only)
#   PEER_ARGS="..."     extra llama-server arguments (default: -nr on a CPU
#                       with AMX, as bench/serve_peer.sh)
#   JOBS=N              parallel jobs of the llama.cpp build (default 2)
#   PORT=N              the servers' port (default: a free one)
#   DRAFT=KIND          kvtier's --draft (default none: both engines decode
#                       plainly, as llama-server does by default)
set -eu
me=serve_batch.sh
# shellcheck source=bench/lib.sh
. "$(dirname "$0")/lib.sh"
bench_bin "${1:-}"
bench_lib
bench_need git cc node npm flock curl
cd "$root"
tools/deps.sh peers || exit 2
cache=${KVT_PEER_CACHE:-$HOME/.cache/kvtier}
jobs=${JOBS:-2}
threads=${THREADS:-2}
runs=${RUNS:-3}
tokens=${TOKENS:-64}
counts=${COUNTS:-1 2 4 8}
bench_peer_args
mkdir -p "$cache/tools" "$cache/models"
. bench/peer_llama.sh

# ---- the models (bench/peers.sh makes the same files) ----
bench_synth_llama
f16=$cache/models/synth-llama-124m-f16.gguf
q4=$cache/models/synth-llama-124m-q4_k_m.gguf
[ -f "$f16" ] || "$cache/tools/synth_llama" "$src/models/ggml-vocab-llama-spm.gguf" "$f16" >&2
bench_quantize "$f16" "$q4" Q4_K_M
peer_check "$q4" # a native build that dies of SIGILL: one without AMX

bench_tmp serve-batch
bench_port

start() { # $1: kvtier|llama, $2: model, $3: requests at once, $4: context per request
    if [ "$1" = kvtier ]; then
        "$bin" serve --model "$2" --port "$port" --ctx "$4" --threads "$threads" --no-kv-disk --parallel "$3" \
            --draft "${DRAFT:-none}" >>"$tmp/server.log" 2>&1 &
    else
        # shellcheck disable=SC2086
        # the file says a context of 8192, which llama.cpp's slots do not exceed
        ov=
        [ "$4" -gt 8192 ] && ov="--override-kv llama.context_length=int:$4"
        "$lbin/llama-server" -m "$2" --port "$port" -c $(($4 * $3)) -t "$threads" -tb "$threads" -np "$3" \
            $ov $peer_args >>"$tmp/server.log" 2>&1 &
    fi
    pid=$!
    bench_wait_up "$1"
}

stop() { bench_stop lenient; }

: >"$tmp/rows"
[ "${DECODE:-1}" = 0 ] && counts=
for m in "$f16" "$q4"; do
    [ -n "$counts" ] || break
    q=$(basename "$m" .gguf)
    q=${q##*-}
    for n in $counts; do
        for e in kvtier llama; do
            echo "serve_batch.sh: $e, $q, $n clients" >&2
            start "$e" "$m" "$n" 4096
            r=1
            while [ $r -le "$runs" ]; do
                node tests/e2e/load.mjs "$base" decode "$n" "$tokens" |
                    sed "s/^{/{\"engine\":\"$e\",\"type\":\"$q\",/" >>"$tmp/rows" ||
                    { echo "serve_batch.sh: $e $q $n failed; server log:" >&2; tail -n 40 "$tmp/server.log" >&2; exit 1; }
                r=$((r + 1))
            done
            stop
        done
    done
done
if [ "${PREFILL:-1}" != 0 ]; then
    for e in kvtier llama; do
        echo "serve_batch.sh: $e, a short request during a long prefill" >&2
        start "$e" "$f16" 2 32768
        node tests/e2e/load.mjs "$base" under-prefill 40000 | sed "s/^{/{\"engine\":\"$e\",\"case\":\"prefill\",/" \
            >>"$tmp/rows" || { echo "serve_batch.sh: $e under-prefill failed" >&2; exit 1; }
        stop
    done
fi

echo "cpu: $(bench_cpu), $(nproc 2>/dev/null || echo '?') cores, $threads threads; synth-llama-124m; $tokens tokens a client; best of $runs; llama-server ${peer_args:-(no extra arguments)}"
node - "$tmp/rows" bench/serve-batch.csv <<'JS'
const fs = require('fs');
const [rowsPath, csvPath] = process.argv.slice(2);
const rows = fs.readFileSync(rowsPath, 'utf8').split('\n').filter(Boolean).map((l) => JSON.parse(l));
const pad = (s, n) => String(s).padEnd(n), lpad = (s, n) => String(s).padStart(n);
const best = (e, t, n) => rows.filter((r) => r.engine === e && r.type === t && r.clients === n)
  .reduce((a, r) => (!a || r.aggregate_tok_s > a.aggregate_tok_s ? r : a), null);
const csv = ['type,clients,kvtier_tok_s,llama_tok_s,ratio,kvtier_slowest_s,llama_slowest_s,kvtier_tokens,llama_tokens'];
console.log(`${pad('type', 8)}${lpad('clients', 8)}${lpad('kvtier tok/s', 14)}${lpad('llama tok/s', 13)}${lpad('ratio', 7)}` +
  `${lpad('slowest kvtier s', 18)}${lpad('llama s', 9)}`);
for (const t of [...new Set(rows.filter((r) => r.type).map((r) => r.type))]) {
  for (const n of [...new Set(rows.filter((r) => r.type === t).map((r) => r.clients))]) {
    const k = best('kvtier', t, n), l = best('llama', t, n);
    const ratio = k.aggregate_tok_s / l.aggregate_tok_s;
    console.log(`${pad(t, 8)}${lpad(n, 8)}${lpad(k.aggregate_tok_s.toFixed(1), 14)}${lpad(l.aggregate_tok_s.toFixed(1), 13)}` +
      `${lpad(ratio.toFixed(2), 7)}${lpad(k.slowest_s.toFixed(3), 18)}${lpad(l.slowest_s.toFixed(3), 9)}`);
    csv.push([t, n, k.aggregate_tok_s, l.aggregate_tok_s, ratio.toFixed(3), k.slowest_s, l.slowest_s, k.tokens, l.tokens].join(','));
  }
}
const pf = rows.filter((r) => r.case === 'prefill');
if (pf.length) {
  console.log('\na short request 2 s into a long prefill (F16, 2 requests at once)');
  console.log(`${pad('engine', 11)}${lpad('long prompt', 12)}${lpad('long TTFT s', 13)}${lpad('short TTFT s', 14)}${lpad('short total s', 15)}`);
  csv.push('', 'engine,long_tokens,long_ttft_s,short_ttft_s,short_total_s');
  for (const r of pf) {
    console.log(`${pad(r.engine === 'llama' ? 'llama.cpp' : r.engine, 11)}${lpad(r.long_tokens, 12)}${lpad(r.long_ttft_s.toFixed(3), 13)}` +
      `${lpad(r.short_ttft_s.toFixed(3), 14)}${lpad(r.short_total_s.toFixed(3), 15)}`);
    csv.push([r.engine, r.long_tokens, r.long_ttft_s, r.short_ttft_s, r.short_total_s].join(','));
  }
}
fs.writeFileSync(csvPath, csv.join('\n') + '\n');
JS
echo "rows written to bench/serve-batch.csv"
