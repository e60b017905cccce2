#!/bin/sh
# DeepSeek-V4-Flash's shape at speed, kvtier against llama.cpp on the same
# files: bench/flash.sh [BIN]
#
# The file: the ds4-flash-bench preset (Flash's widths: D 4096, 64 heads of
# 512, 256 routed experts of width 2048, 6 used and 1 shared, the indexer,
# output groups and hyper-connections; 2 layers, ratio 4 then 128, the first
# hash-routed), written by `kvtier model new --type q8_0` with the tokenizer
# of the llama.cpp clone's models/ggml-vocab-deepseek-llm.gguf (so that
# llama-bench loads it), then in the two mixes ds4.c ships Flash in: a Q8_0
# trunk with the routed experts in IQ2_XXS (gate, up) and Q2_K (down), and
# with Q4_K routed experts. By default the mixes' experts are random blocks
# of those types (bench/synth_llama.c --experts, half a minute): a kernel's
# speed does not depend on the bits it multiplies, and llama-quantize needs
# hours for them on 2 shared cores (IQ2_XXS's grid search; Q4_K with an
# importance matrix took over 4 minutes of a loaded machine for the first
# of six expert tensors). QUANTIZE=llama makes them with llama-quantize
# instead (--allow-requantize, --tensor-type ffn_*_exps=..., an importance
# matrix of ones from bench/synth_llama.c --imatrix, which IQ2_XXS needs).
# All in the cache dir: the Q8_0 source is 14.9 GB, the mixes 4.8 and 8.5
# GB; the script stops when making a missing one would leave less than 25
# GB free.
#
# The cells: prefill of 512 and 4,096 tokens (pp512, pp4096) and a decode
# of 32 tokens (tg32), at 1 and 2 threads, kvtier (`bench --suite llama`)
# and llama-bench alternately, each the fastest of REPS; each figure with
# the 1-minute load average at its start (the machine may be shared). The
# decode's weight bytes read per token (every tensor but the token
# embedding, the hash table and the routed experts not chosen: 6 of 256 per
# layer, from `kvtier info`'s bytes by type) times its tokens per second,
# against the read bandwidth of bench/peak.c at the same threads. Table on
# stdout, rows to bench/flash.csv. Method and results: bench/PEERS.md.
#   KVT_PEER_CACHE=DIR  clone, build, models and tools (default ~/.cache/kvtier)
#   REPS=N              repetitions per cell and engine (default 2)
#   FILES="iq2 q4k"     the files measured (default both)
#   CELLS="pp512 pp4096 tg32"
#   THREADS="1 2"
#   JOBS=N              parallel jobs of a llama.cpp build (default 2)
#   QUANTIZE=llama      the mixes by llama-quantize (default: random blocks)
set -eu
me=flash.sh
# shellcheck source=bench/lib.sh
. "$(dirname "$0")/lib.sh"
bench_bin "${1:-}"
bench_lib
bench_need git cc node npm flock
cd "$root"

cache=${KVT_PEER_CACHE:-$HOME/.cache/kvtier}
reps=${REPS:-2}
jobs=${JOBS:-2}
files=${FILES:-iq2 q4k}
cells=${CELLS:-pp512 pp4096 tg32}
threads=${THREADS:-1 2}
models=$cache/models
mkdir -p "$models" "$cache/tools"
# shellcheck source=bench/peer_llama.sh
. "$root/bench/peer_llama.sh"
bench_tmp flash

# GB free on the filesystem of $models
free_gb() { df -P -k "$models" | awk 'NR == 2 { printf "%d\n", $4 / 1e6 }'; }
# $1 a file about to be made, $2 its size in GB: refused below 25 GB free after it
room_for() {
    [ -f "$1" ] && return 0
    left=$(($(free_gb) - $2))
    [ "$left" -ge 25 ] || { echo "$me: making $1 (~$2 GB) would leave $left GB free (at least 25 wanted)" >&2; exit 2; }
}

src_q8=$models/ds4-flash-bench-q8_0.gguf
room_for "$src_q8" 15
if [ ! -f "$src_q8" ]; then
    echo "$me: writing $src_q8 (kvtier model new --type q8_0)" >&2
    "$bin" model new --preset ds4-flash-bench --vocab "$src/models/ggml-vocab-deepseek-llm.gguf" --type q8_0 \
        --out "$src_q8" >&2
fi
bench_synth_llama
imatrix=$models/ds4-flash-bench.imatrix.dat
[ -f "$imatrix" ] || "$cache/tools/synth_llama" --imatrix "$src_q8" "$imatrix" >&2

# $1 output, $2 gate/up type, $3 down type: by llama-quantize through a
# .part file (its log beside it), or random blocks (synth_llama --experts)
mix() {
    [ -f "$1" ] && return 0
    if [ "${QUANTIZE:-}" = llama ]; then
        echo "$me: llama-quantize: $1" >&2
        "$lbin/llama-quantize" --allow-requantize --imatrix "$imatrix" --tensor-type "ffn_gate_exps=$2" \
            --tensor-type "ffn_up_exps=$2" --tensor-type "ffn_down_exps=$3" "$src_q8" "${1%.gguf}.part.gguf" Q8_0 \
            >"${1%.gguf}.log" 2>&1 ||
            { tail -n 20 "${1%.gguf}.log" >&2; echo "$me: llama-quantize of $1 failed" >&2; exit 1; }
        mv "${1%.gguf}.part.gguf" "$1"
    else
        echo "$me: random $2/$3 expert blocks: $1" >&2
        "$cache/tools/synth_llama" --experts "$src_q8" "$1" "$2" "$3" >&2
    fi
}
f_iq2=$models/ds4-flash-bench-iq2xxs-q2k.gguf
f_q4k=$models/ds4-flash-bench-q4k.gguf
for f in $files; do
    case $f in
        iq2) room_for "$f_iq2" 5; mix "$f_iq2" iq2_xxs q2_K ;;
        q4k) room_for "$f_q4k" 9; mix "$f_q4k" q4_K q4_K ;;
        *) echo "$me: FILES: iq2 or q4k, not $f" >&2; exit 2 ;;
    esac
done
first=$(echo "$files" | cut -d' ' -f1)
if [ "$first" = iq2 ]; then peer_check "$f_iq2"; else peer_check "$f_q4k"; fi

# the decode's weight bytes per token of a file, from `kvtier info`'s
# mapped bytes by type: all, less the routed experts not chosen (250 of
# 256 per layer), the hash table (i32) and the Q8_0 token embedding but
# one row (D V / 32 * 34 B of D 4096 and V from info)
read_bytes() { # $1 file, $2 its routed experts' types (awk regex)
    "$bin" info --model "$1" 2>/dev/null | awk -v rt="$2" '
        /^vocabulary / { v = $2 }
        /^mapped / { all = $2; s = $0; sub(/.*tensors: /, "", s); sub(/\).*/, "", s)
                     n = split(s, kv, ", ")
                     for (i = 1; i <= n; i++) { split(kv[i], p, " ")
                         if (p[1] ~ "^(" rt ")$") routed += p[2]; if (p[1] == "i32") tid += p[2] } }
        END { emb = 4096 * v / 32 * 34; printf "%.0f\n", all - routed * 250 / 256 - tid - emb + 4096 / 32 * 34 }'
}

cpu=$(bench_cpu)
kvt_commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || kvt_commit="$kvt_commit+changes"
max_thr=$(echo "$threads" | tr ' ' '\n' | sort -n | tail -n 1)
"$cache/tools/peak" "$max_thr" >"$tmp/peak" 2>/dev/null ||
    { cc -O2 -std=c11 -D_GNU_SOURCE -Wall -Wextra -mavx2 -mfma -o "$cache/tools/peak" bench/peak.c -lpthread &&
      "$cache/tools/peak" "$max_thr" >"$tmp/peak"; }
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); cpu: $cpu, $(nproc) cores"
echo "kvtier: $kvt_commit; llama.cpp: $commit ($peer_build); $reps repetitions per cell, the fastest"
echo "read bandwidth (bench/peak.c): $(awk '/^read/ { printf "%s threads %.2f GB/s  ", $2, $3 }' "$tmp/peak")"

csv=bench/flash.csv
[ -f "$csv" ] || echo "date,commit,file,cell,threads,kvtier_tps,llama_tps,ratio,load_kvtier,load_llama,read_gbs,bw_gbs" >"$csv"
load() { cut -d' ' -f1 /proc/loadavg; }
printf '%-12s %-7s %3s %12s %6s %12s %6s %7s %s\n' file cell thr kvtier load llama.cpp load ratio "decode GB/s (of bw)"
for f in $files; do
    case $f in iq2) file=$f_iq2 rt='iq2_xxs|q2_K' ;; q4k) file=$f_q4k rt='q4_K' ;; esac
    bytes=$(read_bytes "$file" "$rt")
    cat "$file" >/dev/null # into the page cache before either engine runs
    for c in $cells; do
        case $c in
            pp*) p=${c#pp} n=0 ;;
            tg*) p=0 n=${c#tg} ;;
        esac
        for t in $threads; do
            la=$(load)
            rm -f "$tmp/kv.csv"
            if "$bin" bench --suite llama --model "$file" --threads "$t" --prompt "$p" --gen "$n" --depth 0 \
                --reps "$reps" --csv "$tmp/kv.csv" >"$tmp/kv.out" 2>"$tmp/kv.err"; then
                kv=$(awk -F, 'NR == 2 { print $8 }' "$tmp/kv.csv")
            else kv=failed; tail -n 3 "$tmp/kv.err" >&2; fi
            lb=$(load)
            if "$lbin/llama-bench" -m "$file" -p "$p" -n "$n" -t "$t" -r "$reps" --no-warmup -o jsonl >"$tmp/ll.out" 2>"$tmp/ll.err"; then
                ll=$(sed -n 's/.*"samples_ts": \[\([^]]*\)\].*/\1/p' "$tmp/ll.out" | tr ',' '\n' |
                     awk 'NF { v = $1 + 0; if (v > m) m = v } END { printf "%.3f\n", m }')
            else ll=failed; tail -n 3 "$tmp/ll.err" >&2; fi
            ratio=$(echo "$kv $ll" | awk '$1 + 0 > 0 && $2 + 0 > 0 { printf "%.2f", $1 / $2; exit } { print "-" }')
            bw=$(awk -v t="$t" '$1 == "read" && $2 == t { print $3 }' "$tmp/peak")
            gbs=-
            case $c in tg*) gbs=$(echo "$kv $bytes" | awk '$1 + 0 > 0 { printf "%.2f", $1 * $2 / 1e9 }') ;; esac
            note=
            [ "$gbs" = - ] || note="$gbs ($(echo "$gbs ${bw:-0}" | awk '$2 > 0 { printf "%.0f%%", 100 * $1 / $2 }'); llama.cpp $(echo "$ll $bytes" | awk '$1 + 0 > 0 { printf "%.2f", $1 * $2 / 1e9 }'))"
            printf '%-12s %-7s %3s %12s %6s %12s %6s %7s %s\n' "$f" "$c" "$t" "$kv" "$la" "$ll" "$lb" "$ratio" "$note"
            echo "$(date -u '+%Y-%m-%d %H:%M'),$kvt_commit,$f,$c,$t,$kv,$ll,$ratio,$la,$lb,$gbs,${bw:-}" >>"$csv"
        done
    done
    echo "$f: $(basename "$file"), $(stat -c %s "$file") B; decode reads $bytes B of weights per token"
done
