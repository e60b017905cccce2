#!/bin/sh
# kvtier against llama.cpp, cell by cell on the same GGUF files:
# bench/peers.sh [BIN]
#
# The peer is the llama.cpp source that npm's node-llama-cpp 3.22.1 ships as
# a git bundle (installed with `npm ci --omit=optional --prefix tests/peer`
# when missing, as tests/test_peer.c does). It is cloned once into the cache
# dir and built there natively with cmake (bench/peer_llama.sh); a rerun
# reuses the build. The models are a synthetic 124.7M-parameter
# llama in F16 (bench/synth_llama.c, with the tokenizer of the clone's
# models/ggml-vocab-llama-spm.gguf), quantised to Q8_0 and Q4_K_M by
# llama-quantize, the ds4-mini DeepSeek-V4 preset (F32 from `kvtier model
# new`, Q8_0 by llama-quantize), and Qwen3-0.6B and Gemma 3 1B shapes with
# synthetic weights (bench/synth_llama.c --shape) in Q4_K_M; the last two
# kinds at the most threads only, all in the cache dir too. For each file, test (pp512, tg128,
# pp512 at depth 4096, tg32 at depth 4096) and thread count (1, 2), kvtier
# measures its cell, then llama-bench the same one. bench/peak.c measures the
# FMA peak (256-bit, and 512-bit where the CPU has AVX-512F) and the read
# bandwidth that the table relates the speeds to. A native llama.cpp build
# that dies of SIGILL (AMX on a VM without the tile state) is replaced by one
# without AMX (bench/peer_llama.sh); the header says which build ran. The
# table goes to stdout, the same rows to bench/peers.csv. Method and results:
# bench/PEERS.md.
#
# BIN defaults to build/kvtier; bench/synth_llama.c links against the
# libkvtier.a next to it.
#   KVT_PEER_CACHE=DIR  clone, build, models and tools (default ~/.cache/kvtier)
#   REPS=N              repetitions of each cell, both engines (default 5, QUICK 2)
#   QUICK=1             pp512 and tg128 on F16 at 2 threads only; the rows go to
#                       $KVT_PEER_CACHE/peers-quick.csv, not bench/peers.csv
#   JOBS=N              parallel jobs of the llama.cpp build (default 2)
#   CACHE_TYPES="f16 q8_0"
#                       adds the depth cells (pp512@d4096, tg32@d4096) of every
#                       llama-family file at the most threads once per cache
#                       type, both engines at that type for K and V (kvtier
#                       -ctk/-ctv; llama-bench -ctk/-ctv, with -fa 1 when V is
#                       quantised, as llama.cpp needs); llama-bench takes no
#                       f32 cache, so an f32 cell is kvtier's alone
#   CT_ONLY=1           only those cells (the rows go to $KVT_PEER_CACHE/peers-ct.csv)
#   CT_FILES="q8_0 qwen3-0.6b-q4_k_m"
#                       the files of those cells (labels as in the table's runs:
#                       f16 q8_0 q4_k_m qwen3-0.6b-q4_k_m gemma3-1b-q4_k_m; default all)
#   ROUNDS=N            each cell measured N times, kvtier and llama.cpp in turn,
#                       each engine's fastest kept (default 1)
# Needs git, cc, node, npm and flock; cmake (`tools/deps.sh peers`, which
# installs it when run as root).
set -eu
me=peers.sh
# shellcheck source=bench/lib.sh
. "$(dirname "$0")/lib.sh"
bench_bin "${1:-}"
bench_lib
bench_need git cc node npm flock
cd "$root"
tools/deps.sh peers || exit 2

cache=${KVT_PEER_CACHE:-$HOME/.cache/kvtier}
quick=${QUICK:-0}
if [ "$quick" = 1 ]; then reps=${REPS:-2}; else reps=${REPS:-5}; fi
jobs=${JOBS:-2}
cache_types=${CACHE_TYPES:-}
ct_only=${CT_ONLY:-0}
rounds=${ROUNDS:-1}
case $rounds in '' | *[!0-9]* | 0) echo "peers.sh: ROUNDS must be a positive integer, got '$rounds'" >&2; exit 2 ;; esac
for ct in $cache_types; do
    case $ct in f32 | f16 | bf16 | q8_0) ;; *) echo "peers.sh: CACHE_TYPES takes f32, f16, bf16, q8_0, got '$ct'" >&2; exit 2 ;; esac
done
[ "$ct_only" = 1 ] && [ -z "$cache_types" ] && { echo "peers.sh: CT_ONLY=1 needs CACHE_TYPES" >&2; exit 2; }
case $reps in '' | *[!0-9]* | 0) echo "peers.sh: REPS must be a positive integer, got '$reps'" >&2; exit 2 ;; esac
mkdir -p "$cache/tools" "$cache/models"
bench_tmp peers

# ---- the peer: node-llama-cpp's llama.cpp source, cloned and built once ----

. bench/peer_llama.sh
echo "peers.sh: llama.cpp $commit (built in $(cat "$src/build/kvtier-build-seconds" 2>/dev/null || echo '?') s)" >&2

# ---- the tools and the models ----

bench_synth_llama
cc -O2 -std=c11 -D_GNU_SOURCE -Wall -Wextra -mavx2 -mfma -o "$cache/tools/peak" bench/peak.c -lpthread

models=$cache/models
f16=$models/synth-llama-124m-f16.gguf
if [ ! -f "$f16" ]; then
    echo "peers.sh: writing $f16" >&2
    "$cache/tools/synth_llama" "$src/models/ggml-vocab-llama-spm.gguf" "$f16" >&2
fi
for q in Q8_0 Q4_K_M; do
    bench_quantize "$f16" "$models/synth-llama-124m-$(echo "$q" | tr '[:upper:]' '[:lower:]').gguf" "$q"
done

# The small models of the families people run with agents, in their real
# shapes with synthetic weights (bench/synth_llama.c --shape): Qwen3-0.6B
# with the qwen2 vocabulary, Gemma 3 1B with the gemma-4 one (its window
# layers keep rings, its global layers full rows), each quantised to Q4_K_M
fam_models="qwen3-0.6b:ggml-vocab-qwen2.gguf gemma3-1b:ggml-vocab-gemma-4.gguf"
for fm in $fam_models; do
    shp=${fm%%:*} voc=${fm#*:}
    out=$models/synth-$shp-q4_k_m.gguf
    [ -f "$out" ] && continue
    if [ ! -f "$models/synth-$shp-f16.gguf" ]; then
        echo "peers.sh: writing $models/synth-$shp-f16.gguf" >&2
        "$cache/tools/synth_llama" --shape "$shp" "$src/models/$voc" "$models/synth-$shp-f16.gguf" >&2
    fi
    bench_quantize "$models/synth-$shp-f16.gguf" "$out" Q4_K_M
done

# DeepSeek-V4: the ds4-mini preset written by kvtier (F32, with the tokenizer
# of the clone's models/ggml-vocab-deepseek-llm.gguf, which llama.cpp knows),
# quantised to Q8_0 by llama-quantize
ds4_f32=$models/ds4-mini-f32.gguf
if [ ! -f "$ds4_f32" ]; then
    echo "peers.sh: writing $ds4_f32" >&2
    "$bin" model new --preset ds4-mini --vocab "$src/models/ggml-vocab-deepseek-llm.gguf" --out "$ds4_f32" >&2
fi
bench_quantize "$ds4_f32" "$models/ds4-mini-q8_0.gguf" Q8_0
# a native build that dies of SIGILL (AMX) is replaced by one without AMX
peer_check "$models/synth-llama-124m-q4_k_m.gguf"

# ---- the machine ----

if [ "$quick" = 1 ]; then
    types=f16 tests="pp512 tg128" threads=2 csv=$cache/peers-quick.csv ds4_types=f32 fam_types=
else
    types="f16 q8_0 q4_k_m" tests="pp512 tg128 pp512@d4096 tg32@d4096" threads="1 2" csv=bench/peers.csv
    ds4_types="f32 q8_0" fam_types="qwen3-0.6b gemma3-1b"
fi
[ "$ct_only" = 1 ] && csv=$cache/peers-ct.csv
max_thr=0
for t in $threads; do [ "$t" -gt "$max_thr" ] && max_thr=$t; done
# measured before and after the cells; the table uses the better of the two
# (a VM's neighbours can only lower them)
# (CT_ONLY's rows are ratios only: no peak to relate them to)
if [ "$ct_only" = 1 ]; then
    : >"$tmp/peak"
else
    echo "peers.sh: measuring the FMA peak and the read bandwidth (bench/peak.c)" >&2
    "$cache/tools/peak" "$max_thr" >"$tmp/peak"
fi
for f in $types; do "$cache/tools/synth_llama" --sizes "$models/synth-llama-124m-$f.gguf" >"$tmp/sizes-$f.json"; done

cpu=$(bench_cpu)
kvt_commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || kvt_commit="$kvt_commit+changes"
{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "cpu: $cpu, $(nproc 2>/dev/null || echo '?') cores online; load average $(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo '?') at the start, LOAD_END at the end"
    echo "kvtier: $kvt_commit ($bin)"
    echo "llama.cpp: $commit (node-llama-cpp $peer_version), llama-bench defaults otherwise"
    echo "llama.cpp build: $peer_build"
    echo "repetitions: $reps per cell and engine, the fastest reported"
    [ "$rounds" = 1 ] || echo "rounds: $rounds per cell, kvtier and llama.cpp in turn, each engine's fastest kept"
    [ -z "$cache_types" ] || echo "cache types: $cache_types (K and V alike; llama-bench -fa 1 when V is quantised)"
} >"$tmp/head"

# ---- the cells: kvtier, then llama.cpp, on the same file ----

# kvtier's result for one cell: tok/s, or "refused: ..." / "failed: ..."
kvtier_cell() { # $1 file, $2 prompt, $3 gen, $4 depth, $5 threads, $6 cache type (-: the default)
    rm -f "$tmp/kv.csv"
    case ${6:--} in -) ct_args= ;; *) ct_args="-ctk $6 -ctv $6" ;; esac
    # shellcheck disable=SC2086 # ct_args: none or four words
    if "$bin" bench --suite llama --model "$1" --threads "$5" --prompt "$2" --gen "$3" --depth "$4" \
        --reps "$reps" $ct_args --csv "$tmp/kv.csv" >"$tmp/kv.out" 2>"$tmp/kv.err"; then
        awk -F, 'NR == 2 { print $8 }' "$tmp/kv.csv"
    else
        st=$?
        msg=$(grep '^kvtier: ' "$tmp/kv.err" | tail -n 1)
        msg=${msg#kvtier: }
        case $msg in
            "$1: "*) # the model did not open: the library's message, without the path and offset
                msg=${msg#"$1: "}
                echo "refused: ${msg%% (offset *}" | awk -v p="gguf $1: " '{
                    i = index($0, p); if (i) $0 = substr($0, 1, i - 1) substr($0, i + length(p)); print }' ;;
            *) echo "failed: ${msg:-exit status $st}" ;;
        esac
    fi
}

# llama-bench's: the fastest of its repetitions (samples_ts), as kvtier reports
llama_cell() { # the same arguments
    case ${6:--} in
        -) ct_args= ;;
        f32) echo "refused: llama-bench takes no f32 cache type"; return ;;
        f16) ct_args="-ctk $6 -ctv $6" ;;
        *) ct_args="-ctk $6 -ctv $6 -fa 1" ;; # a quantised V needs flash attention in llama.cpp
    esac
    # shellcheck disable=SC2086
    if "$lbin/llama-bench" -m "$1" -p "$2" -n "$3" -d "$4" -t "$5" -r "$reps" $ct_args -o jsonl \
        >"$tmp/ll.out" 2>"$tmp/ll.err"; then
        sed -n 's/.*"samples_ts": \[\([^]]*\)\].*/\1/p' "$tmp/ll.out" | tr ',' '\n' |
            awk 'NF { v = $1 + 0; if (v > m) m = v } END { if (m > 0) printf "%.3f\n", m; else print "failed: no samples" }'
    else
        echo "failed: $(grep -v '^[[:space:]]*$' "$tmp/ll.err" | tail -n 1)"
    fi
}

# The better of two results of one engine: the larger tok/s; a failure only
# when both failed (the latest message)
best() {
    case $1 in '' | refused:* | failed:*) echo "$2"; return ;; esac
    case $2 in refused:* | failed:*) echo "$1"; return ;; esac
    echo "$1 $2" | awk '{ print ($2 + 0 > $1 + 0 ? $2 : $1) }'
}

# What other processes ran during a cell, in cores: the machine's busy ticks
# (/proc/stat) less this script's own and its children's (/proc/$$/stat).
hz=$(getconf CLK_TCK 2>/dev/null || echo 100)
snap() {
    printf '%s %s %s\n' "$(awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9; exit }' /proc/stat)" \
        "$(awk '{ print $14 + $15 + $16 + $17 }' "/proc/$$/stat")" "$(cut -d' ' -f1 /proc/uptime)"
}
others() { # $1 snap before, $2 snap after
    echo "$1 $2" | awk -v hz="$hz" '{ w = ($6 - $3) * hz; o = w > 0 ? (($4 - $1) - ($5 - $2)) / w : 0
        printf "%.2f\n", (o > 0 ? o : 0) }'
}

# the runs, one a line: label, file, thread counts (comma-separated), cache
# type (-: each engine's default), tests (comma-separated). The llama's
# types at every thread count; ds4-mini and the family models (ratios only)
# at the most threads; with CACHE_TYPES, the depth cells of the llama-family
# files again at the most threads, once per type (ratios only)
: >"$tmp/runs"
thr_csv=$(echo $threads | tr ' ' ',')
test_csv=$(echo $tests | tr ' ' ',')
if [ "$ct_only" != 1 ]; then
    for f in $types; do echo "$f $models/synth-llama-124m-$f.gguf $thr_csv - $test_csv" >>"$tmp/runs"; done
    for f in $ds4_types; do echo "ds4-mini-$f $models/ds4-mini-$f.gguf $max_thr - $test_csv" >>"$tmp/runs"; done
    for f in $fam_types; do echo "$f-q4_k_m $models/synth-$f-q4_k_m.gguf $max_thr - $test_csv" >>"$tmp/runs"; done
fi
ct_files=${CT_FILES:-f16 q8_0 q4_k_m qwen3-0.6b-q4_k_m gemma3-1b-q4_k_m}
for ct in $cache_types; do
    for f in $ct_files; do
        case $f in
            f16 | q8_0 | q4_k_m) file=$models/synth-llama-124m-$f.gguf ;;
            qwen3-0.6b-q4_k_m | gemma3-1b-q4_k_m) file=$models/synth-$f.gguf ;;
            *) echo "peers.sh: CT_FILES: no file '$f'" >&2; exit 2 ;;
        esac
        echo "$f+ct-$ct $file $max_thr $ct pp512@d4096,tg32@d4096" >>"$tmp/runs"
    done
done
n_cells=0
while read -r f file thr_list ct test_list; do
    for t in $(echo "$test_list" | tr ',' ' '); do for n in $(echo "$thr_list" | tr ',' ' '); do n_cells=$((n_cells + 1)); done; done
done <"$tmp/runs"
: >"$tmp/rows"
i=0
t_start=$(date +%s)
# (fd 3: the engines must not read the list)
while read -r f file thr_list ct test_list <&3; do
    thr_list=$(echo "$thr_list" | tr ',' ' ')
    for t in $(echo "$test_list" | tr ',' ' '); do
        case $t in
            pp*@d*) p=${t#pp} p=${p%@*} g=0 d=${t#*@d} ;;
            tg*@d*) p=0 g=${t#tg} g=${g%@*} d=${t#*@d} ;;
            pp*) p=${t#pp} g=0 d=0 ;;
            tg*) p=0 g=${t#tg} d=0 ;;
        esac
        for n in $thr_list; do
            i=$((i + 1))
            kv= ll= o_kv=0 o_ll=0
            r=0
            while [ "$r" -lt "$rounds" ]; do # kvtier and llama.cpp in turn, each engine's fastest kept
                r=$((r + 1))
                s0=$(snap)
                kv=$(best "$kv" "$(kvtier_cell "$file" "$p" "$g" "$d" "$n" "$ct")")
                s1=$(snap)
                ll=$(best "$ll" "$(llama_cell "$file" "$p" "$g" "$d" "$n" "$ct")")
                s2=$(snap)
                o_kv=$(echo "$o_kv $(others "$s0" "$s1")" | awk '{ printf "%.2f\n", ($1 > $2 ? $1 : $2) }')
                o_ll=$(echo "$o_ll $(others "$s1" "$s2")" | awk '{ printf "%.2f\n", ($1 > $2 ? $1 : $2) }')
            done
            printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$f" "$t" "$n" "$p" "$g" "$d" "$kv" "$ll" \
                "$o_kv" "$o_ll" >>"$tmp/rows"
            echo "peers.sh: cell $i/$n_cells ($(($(date +%s) - t_start)) s): $f $t $n thread(s):" \
                "kvtier $kv, llama.cpp $ll; other processes used $o_kv and $o_ll cores" >&2
        done
    done
done 3<"$tmp/runs"

# ---- the table ----

[ "$ct_only" = 1 ] || "$cache/tools/peak" "$max_thr" >>"$tmp/peak"
sed "s/LOAD_END/$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo '?')/" "$tmp/head"
# shellcheck disable=SC2086 # one argument per file type
node - "$tmp" "$csv" $types <<'EOF'
const fs = require('fs');
const [tmp, csvPath, ...types] = process.argv.slice(2);
const peak = {}, seen = {};
for (const line of fs.readFileSync(`${tmp}/peak`, 'utf8').split('\n').filter(Boolean)) {
  const [what, thr, v] = line.split(/\s+/), k = `${what}/${thr}`;
  peak[k] = Math.max(peak[k] || 0, +v);
  (seen[k] = seen[k] || []).push((+v).toFixed(1));
}
const sizes = Object.fromEntries(types.map((t) => [t, JSON.parse(fs.readFileSync(`${tmp}/sizes-${t}.json`, 'utf8'))]));
const names = { f16: 'F16', q8_0: 'Q8_0', q4_k_m: 'Q4_K_M' };
const num = (s) => (/^[0-9.]+$/.test(s) ? +s : null);
const rows = [];
for (const line of fs.readFileSync(`${tmp}/rows`, 'utf8').split('\n').filter(Boolean)) {
  const [type, test, thr, p, g, d, kv, ll, okv, oll] = line.split('\t');
  const z = sizes[type], P = +p, G = +g, D = +d;
  if (!z) { // ds4-mini, the family models and the cache-type cells: ratios only
    const k = num(kv), l = num(ll);
    const ct = type.match(/^(.*)\+ct-(.*)$/), base = ct ? ct[1] : type;
    const fam = base.match(/^(qwen3-0\.6b|gemma3-1b)-(.*)$/);
    const label = (fam ? `${fam[1]} ${fam[2].toUpperCase()}`
      : names[base] || base.replace('ds4-mini-', 'ds4-mini ').toUpperCase().replace('DS4-MINI', 'ds4-mini')) +
      (ct ? `, K/V ${ct[2]}` : '');
    rows.push({ type: label, test, thr,
      kv, ll, k, l, ratio: k !== null && l ? k / l : null, unit: '', kr: null, lr: null, pk: null, okv, oll });
    continue;
  }
  const hd = z.n_embd / z.n_head;
  let unit, per, pk;
  if (P > 0) {
    // FLOPs of a prefill token: 2 per weight of every matrix but the embedding
    // table, plus q.k and p.v over the causal context (mean position D + (P-1)/2)
    unit = 'GFLOP/s';
    per = 2 * (z.params - z.embd_params) + 4 * z.n_layer * z.n_head * hd * (D + (P + 1) / 2);
    pk = peak[`fma/${thr}`];
  } else {
    // bytes a decode token reads: the weights as stored, but only one row of the
    // embedding table, plus the K and V rows of the context at f16
    unit = 'GB/s';
    per = z.bytes - z.embd_bytes + z.embd_bytes / z.n_vocab +
      2 * 2 * z.n_layer * z.n_head_kv * hd * (D + (G + 1) / 2);
    pk = peak[`read/${thr}`];
  }
  const rate = (v) => (v === null ? null : (v * per) / 1e9);
  const k = num(kv), l = num(ll);
  rows.push({ type: names[type] || type, test, thr, kv, ll, k, l, ratio: k !== null && l ? k / l : null,
    unit, kr: rate(k), lr: rate(l), pk, okv, oll });
}
const f = (v, d) => (v === null ? '' : v.toFixed(d));
const pct = (r, pk) => (r === null ? '' : `${r.toFixed(1)} (${((100 * r) / pk).toFixed(0)}%)`);
const cell = (s, v) => (v === null ? s : v.toFixed(1));
const q = (s) => (/[",\n]/.test(s) ? `"${s.replace(/"/g, '""')}"` : s);
const lim = (pre, unit) => Object.keys(peak).filter((k) => k.startsWith(pre)).map((k) =>
  `${peak[k].toFixed(1)} ${unit} on ${k.slice(pre.length)} thread(s) (before / after: ${seen[k].join(' / ')})`).join(', ');
console.log(`FMA peak: ${lim('fma/', 'GFLOP/s')}`);
if (Object.keys(peak).some((k) => k.startsWith('fma512/')))
  console.log(`512-bit FMA peak: ${lim('fma512/', 'GFLOP/s')} (the % of peak columns are of the 256-bit one)`);
else console.log('512-bit FMA peak: none (no AVX-512F)');
console.log(`read bandwidth: ${lim('read/', 'GB/s')}`);
console.log('');
console.log('| file | test | threads | kvtier tok/s | llama.cpp tok/s | kvtier / llama.cpp | kvtier (% of peak) | llama.cpp (% of peak) | unit | other load, cores |');
console.log('|---|---|---:|---:|---:|---:|---:|---:|---|---:|');
for (const r of rows)
  console.log(`| ${r.type} | ${r.test} | ${r.thr} | ${cell(r.kv, r.k)} | ${cell(r.ll, r.l)} | ${f(r.ratio, 2)} | ` +
    `${pct(r.kr, r.pk)} | ${pct(r.lr, r.pk)} | ${r.unit} | ${r.okv} / ${r.oll} |`);
const csv = ['type,test,threads,kvtier_tok_s,llamacpp_tok_s,ratio,unit,kvtier_rate,llamacpp_rate,peak,' +
  'other_cores_kvtier,other_cores_llamacpp']
  .concat(rows.map((r) => [r.type, r.test, r.thr, q(r.kv), q(r.ll), f(r.ratio, 4), r.unit, f(r.kr, 2), f(r.lr, 2),
    r.pk === null ? '' : r.pk.toFixed(2), r.okv, r.oll].join(',')));
fs.writeFileSync(csvPath, csv.join('\n') + '\n');
EOF
echo "rows written to $csv"
