#!/bin/sh
# Serving benchmark: bench/serve.sh [BIN]
#
# Time to first token of an agent session over HTTP: a 25,000-token system
# prompt (ds4-mini) served cold, from the RAM tier (the next turn of the same
# conversation) and from the disk tier (a new conversation with the same
# system prompt, after a restart). The table goes to stdout, the same rows to
# bench/serve.csv. Method and results: bench/SERVE.md.
#
# RUNS=N repeats the whole sequence on a fresh disk dir N times (default 1)
# and reports the fastest run of each case. THREADS=N passes --threads N.
# Needs node (no npm packages: tests/e2e/bench.mjs uses raw fetch) and curl.
set -eu
me=serve.sh
# shellcheck source=bench/lib.sh
. "$(dirname "$0")/lib.sh"
bench_bin "${1:-}"
bench_need node curl
cd "$root"
runs=${RUNS:-1}
threads=${THREADS:-}

bench_tmp serve-bench
bench_port

start() { # $1: the disk dir
    if [ -n "$threads" ]; then
        "$bin" serve --model ds4-mini --port "$port" --kv-disk-dir "$1" --threads "$threads" >>"$tmp/server.log" 2>&1 &
    else
        "$bin" serve --model ds4-mini --port "$port" --kv-disk-dir "$1" >>"$tmp/server.log" 2>&1 &
    fi
    pid=$!
    bench_wait_up kvtier 600
}

stop() { bench_stop strict; }

one() { # $1: case
    node tests/e2e/bench.mjs "$base" "$1" "$tmp/state.json" >>"$tmp/rows" ||
        { echo "serve.sh: the $1 request failed; server log:" >&2; cat "$tmp/server.log" >&2; exit 1; }
}

r=1
while [ $r -le "$runs" ]; do
    echo "run $r of $runs: cold, RAM, restart, disk" >&2
    start "$tmp/kv-$r"
    one cold
    one ram
    stop
    start "$tmp/kv-$r"
    one disk
    stop
    r=$((r + 1))
done

echo "cpu: $(bench_cpu), $(nproc 2>/dev/null || echo '?') cores; model ds4-mini; $runs run(s), fastest shown"
node - "$tmp/rows" bench/serve.csv <<'EOF'
const fs = require('fs');
const [rowsPath, csvPath] = process.argv.slice(2);
const best = {};
for (const line of fs.readFileSync(rowsPath, 'utf8').split('\n').filter(Boolean)) {
  const r = JSON.parse(line);
  if (!best[r.case] || r.ttft_s < best[r.case].ttft_s) best[r.case] = r;
}
const names = { cold: 'cold (prefill everything)', ram: 'RAM hit (next turn)', disk: 'disk hit (after restart)' };
const cold = best.cold.ttft_s;
const rows = ['cold', 'ram', 'disk'].map((c) => ({ ...best[c], ratio: best[c].ttft_s / cold }));
const pad = (s, n) => String(s).padEnd(n);
const lpad = (s, n) => String(s).padStart(n);
console.log(`${pad('case', 28)}${lpad('prompt', 8)}${lpad('cached', 8)}${lpad('TTFT s', 10)}${lpad('vs cold', 10)}` +
  `${lpad('load s', 9)}${lpad('prefill s', 11)}${lpad('save s', 9)}`);
for (const r of rows)
  console.log(`${pad(names[r.case], 28)}${lpad(r.prompt_tokens, 8)}${lpad(r.cached_tokens, 8)}` +
    `${lpad(r.ttft_s.toFixed(3), 10)}${lpad(r.ratio.toFixed(4), 10)}` +
    `${lpad(r.load_s.toFixed(3), 9)}${lpad(r.prefill_s.toFixed(3), 11)}${lpad(r.save_s.toFixed(3), 9)}`);
console.log(`speedup over cold: RAM ${(cold / best.ram.ttft_s).toFixed(1)}x, disk ${(cold / best.disk.ttft_s).toFixed(1)}x`);
const csv = ['case,prompt_tokens,cached_tokens,ttft_s,ratio_to_cold,load_s,prefill_s,save_s']
  .concat(rows.map((r) => [r.case, r.prompt_tokens, r.cached_tokens, r.ttft_s, r.ratio.toFixed(4), r.load_s,
    r.prefill_s, r.save_s].join(',')));
fs.writeFileSync(csvPath, csv.join('\n') + '\n');
EOF
echo "rows written to bench/serve.csv"
