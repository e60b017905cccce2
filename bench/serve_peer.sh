#!/bin/sh
# Time to first token beside llama.cpp's server, on the same file and the
# same requests: bench/serve_peer.sh [BIN]
#
# The model is a synthetic Qwen 3.5 of Qwen3.5-0.8B's shape (bench/synth_llama.c
# --shape qwen3.5-0.8b, the vocabulary of the llama.cpp tree's
# models/ggml-vocab-qwen35.gguf) in Q4_K_M by llama-quantize: 18 Gated
# DeltaNet layers, whose state no prefix cache of llama.cpp's can roll back,
# and 6 full attention layers. The agent request is tests/e2e/bench.mjs's
# with a system prompt of 70,000 bytes: 29,757 tokens with the question. Each server runs the same
# sequence on a fresh process:
#   kvtier     cold, then the next turn (RAM), then SIGTERM, a restart on the
#              same --kv-disk-dir and a new conversation (disk)
#   llama.cpp  cold, then the next turn (warm: its slot and prompt cache),
#              then a restart and the new conversation (restart: nothing of
#              it survives; its --slot-save-path files are saved before the
#              stop and restored after the restart, as far as it can)
# The table goes to stdout, the same rows to bench/serve-peer.csv. Method
# and results: bench/SERVE.md.
#
#   KVT_PEER_CACHE=DIR  clone, build, models (default ~/.cache/kvtier; the
#                       llama.cpp build is bench/peer_llama.sh's)
#   THREADS=N           both servers' threads (default 2)
#   SYS_BYTES=N         the system prompt's bytes (default 70000: 29,7xx
#                       tokens of the qwen35 vocabulary, 2.35 bytes each)
#   PEER_ARGS="..."     extra llama-server arguments (default: -nr on a CPU
#                       with AMX, below; else none)
#   JOBS=N              parallel jobs of the llama.cpp build (default 2)
set -eu
me=serve_peer.sh
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
sys_bytes=${SYS_BYTES:-70000}
# -nr on a CPU with AMX (bench/lib.sh, bench_peer_args)
bench_peer_args
mkdir -p "$cache/tools" "$cache/models"
. bench/peer_llama.sh

# ---- the model ----
bench_synth_llama
shp=qwen3.5-0.8b
f16=$cache/models/synth-$shp-f16.gguf
model=$cache/models/synth-$shp-q4_k_m.gguf
if [ ! -f "$model" ]; then
    [ -f "$f16" ] || "$cache/tools/synth_llama" --shape "$shp" "$src/models/ggml-vocab-qwen35.gguf" "$f16" >&2
    bench_quantize "$f16" "$model" Q4_K_M
fi
peer_check "$model" # a native build that dies of SIGILL: one without AMX
# llama.cpp renders with the model family's own template (the file, like
# the vocabulary it was made from, has none); kvtier chooses the same one
# by architecture (src/chat/template_qwen.c)
tmpl=$src/models/templates/Qwen3.5-4B.jinja
[ -f "$tmpl" ] || { echo "serve_peer.sh: $tmpl missing" >&2; exit 1; }

bench_tmp serve-peer
bench_port
ctx=32768

start() { # $1: kvtier|llama
    if [ "$1" = kvtier ]; then
        "$bin" serve --model "$model" --port "$port" --ctx $ctx --threads "$threads" --kv-disk-dir "$tmp/kv" \
            >>"$tmp/server.log" 2>&1 &
    else
        # shellcheck disable=SC2086
        "$lbin/llama-server" -m "$model" --port "$port" -c $ctx -t "$threads" -tb "$threads" --jinja \
            -np 1 --chat-template-file "$tmpl" --slot-save-path "$tmp/slots" $peer_args >>"$tmp/server.log" 2>&1 &
    fi
    pid=$!
    bench_wait_up "$1"
}

stop() { bench_stop lenient; }

one() { # $1: engine, $2: case
    peer=0
    [ "$1" = llama ] && peer=1
    BENCH_PEER=$peer BENCH_SYS_BYTES=$sys_bytes node tests/e2e/bench.mjs "$base" "$2" "$tmp/state-$1.json" \
        | sed "s/^{/{\"engine\":\"$1\",/" >>"$tmp/rows" ||
        { echo "serve_peer.sh: $1 $2 failed; server log:" >&2; tail -n 40 "$tmp/server.log" >&2; exit 1; }
}

slots() { # $1: save|restore; llama.cpp's slot files, reported, never fatal
    curl -s --max-time 600 -X POST "$base/slots/0?action=$1" -H 'content-type: application/json' \
        -d '{"filename":"bench.bin"}' >"$tmp/slot-$1.json" 2>&1 || true
    echo "serve_peer.sh: llama.cpp slot $1: $(head -c 300 "$tmp/slot-$1.json")" >&2
}

mkdir -p "$tmp/kv" "$tmp/slots"
echo "serve_peer.sh: kvtier: cold, RAM, restart, disk" >&2
start kvtier
one kvtier cold
one kvtier ram
stop
start kvtier
one kvtier disk
stop
echo "serve_peer.sh: llama.cpp: cold, warm, slot save, restart, slot restore, new conversation" >&2
start llama
one llama cold
one llama ram
slots save
stop
start llama
slots restore
one llama disk
stop

echo "cpu: $(bench_cpu), $(nproc 2>/dev/null || echo '?') cores, $threads threads; model $(basename "$model"); llama-server ${peer_args:-(no extra arguments)}"
node - "$tmp/rows" bench/serve-peer.csv <<'EOF'
const fs = require('fs');
const [rowsPath, csvPath] = process.argv.slice(2);
const rows = fs.readFileSync(rowsPath, 'utf8').split('\n').filter(Boolean).map((l) => JSON.parse(l));
const get = (e, c) => rows.find((r) => r.engine === e && r.case === c);
const names = { kvtier: { cold: 'cold', ram: 'RAM hit (next turn)', disk: 'disk hit (after restart)' },
  llama: { cold: 'cold', ram: 'warm (next turn)', disk: 'after restart' } };
const pad = (s, n) => String(s).padEnd(n);
const lpad = (s, n) => String(s).padStart(n);
console.log(`${pad('engine', 11)}${pad('case', 26)}${lpad('prompt', 8)}${lpad('cached', 8)}${lpad('TTFT s', 10)}` +
  `${lpad('vs cold', 9)}${lpad('vs llama', 10)}`);
const csv = ['engine,case,prompt_tokens,cached_tokens,ttft_s,ratio_to_cold,ratio_to_llama'];
for (const e of ['kvtier', 'llama']) {
  for (const c of ['cold', 'ram', 'disk']) {
    const r = get(e, c), cold = get(e, 'cold'), peer = get('llama', c);
    const rc = r.ttft_s / cold.ttft_s, rp = r.ttft_s / peer.ttft_s;
    console.log(`${pad(e === 'llama' ? 'llama.cpp' : e, 11)}${pad(names[e][c], 26)}${lpad(r.prompt_tokens, 8)}` +
      `${lpad(r.cached_tokens ?? '?', 8)}${lpad(r.ttft_s.toFixed(3), 10)}${lpad(rc.toFixed(4), 9)}${lpad(rp.toFixed(4), 10)}`);
    csv.push([e, c, r.prompt_tokens, r.cached_tokens ?? '', r.ttft_s, rc.toFixed(4), rp.toFixed(4)].join(','));
  }
}
fs.writeFileSync(csvPath, csv.join('\n') + '\n');
EOF
echo "rows written to bench/serve-peer.csv"
