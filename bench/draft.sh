#!/bin/sh
# Speculative decoding's drafters against plain decoding, on one file and
# in one run: bench/draft.sh [BIN]
#
# The model is the synthetic Qwen3-0.6B in Q4_K_M that bench/peers.sh
# writes ($cache/models/synth-qwen3-0.6b-q4_k_m.gguf; its F16 file, or one
# written here, when that is missing); the draft model a synthetic qwen3 of
# the same vocabulary (the llama.cpp tree's models/ggml-vocab-qwen2.gguf),
# 2 layers of 256 (bench/synth_llama.c --shape qwen3-tiny), F16. Two
# prompts: a copy-heavy one (a file to repeat with one change) and free
# text. For each prompt, REPS rounds of `kvtier run` with --draft none,
# ngram and model in turn (alternating, so load drifts reach each alike),
# greedy, MAX_TOKENS tokens; each run's decode tok/s, passes, drafts and
# accepted drafts come from its stderr line, and the ids of every run must
# equal plain decoding's (the script fails otherwise). The table goes to
# stdout: per prompt and drafter the median tok/s, the ratio to plain,
# passes, and the acceptance rate. Then the same on ds4-tiny and ds4-mini
# with an MTP layer (the presets ds4-tiny+mtp=1, ds4-mini+mtp=1: the
# model's weights are the preset's, the layer's random), --draft none,
# ngram and mtp. Method and results: README.md, Speculative decoding.
#
#   SETS="qwen3 ds4"    which tables (default both)
#   KVT_PEER_CACHE=DIR  models and tools (default ~/.cache/kvtier)
#   THREADS=N           decode threads (default 1)
#   REPS=N              rounds (default 3)
#   MAX_TOKENS=N        tokens a run (default 128)
set -eu
me=draft.sh
# shellcheck source=bench/lib.sh
. "$(dirname "$0")/lib.sh"
bench_bin "${1:-}"
bench_lib
bench_need cc awk
cd "$root"
cache=${KVT_PEER_CACHE:-$HOME/.cache/kvtier}
threads=${THREADS:-1}
reps=${REPS:-3}
max=${MAX_TOKENS:-128}
models=$cache/models

sets=${SETS:-qwen3 ds4}
vocab=$(ls "$cache"/llama.cpp-*/models/ggml-vocab-qwen2.gguf 2>/dev/null | head -n 1)
model=$models/synth-qwen3-0.6b-q4_k_m.gguf
[ -f "$model" ] || model=$models/synth-qwen3-0.6b-f16.gguf
draft=$models/synth-qwen3-tiny-f16.gguf
if case " $sets " in *" qwen3 "*) true ;; *) false ;; esac && { [ ! -f "$model" ] || [ ! -f "$draft" ]; }; then
    [ -n "$vocab" ] || { echo "$me: no ggml-vocab-qwen2.gguf under $cache (run bench/peers.sh once)" >&2; exit 2; }
    bench_synth_llama
    [ -f "$model" ] || "$cache/tools/synth_llama" --shape qwen3-0.6b "$vocab" "$model" >&2
    [ -f "$draft" ] || "$cache/tools/synth_llama" --shape qwen3-tiny "$vocab" "$draft" >&2
fi

bench_tmp draft
. "$(dirname "$0")/draft_prompts.sh"

# one run: prints "tok/s passes drafted accepted" and keeps the ids in $tmp/$3.ids
one() { # $1 prompt, $2 drafter, $3 tag ($model: the model)
    set -- "$1" "$2" "$3"
    extra=
    [ "$2" = model ] && extra="--model-draft $draft"
    # shellcheck disable=SC2086
    "$bin" run --model "$model" --prompt "$1" --max-tokens "$max" --threads "$threads" --output ids --no-kv-disk \
        --draft "$2" $extra >"$tmp/$3.ids" 2>"$tmp/$3.err" || { cat "$tmp/$3.err" >&2; exit 1; }
    sed -n 's/.*draft [a-z]*: [0-9]* tokens in \([0-9]*\) passes, \([0-9.]*\) tok\/s; \([0-9]*\) drafted, \([0-9]*\) accepted.*/\2 \1 \3 \4/p' \
        "$tmp/$3.err"
}

# the table of one model: drafters $1 (none first)
table() {
    drafters=$1
    printf '%-6s %-6s %8s %6s %7s %9s %9s\n' prompt draft tok/s x_plain passes drafted accepted
    for p in copy free; do
        eval "text=\$$p"
        : >"$tmp/$p.rows"
        for r in $(seq 1 "$reps"); do
            for d in $drafters; do
                line=$(one "$text" "$d" "$p-$d")
                [ -n "$line" ] || { echo "$me: no figures from --draft $d" >&2; cat "$tmp/$p-$d.err" >&2; exit 1; }
                cmp -s "$tmp/$p-$d.ids" "$tmp/$p-none.ids" ||
                    { echo "$me: --draft $d changed the reply ($p, round $r)" >&2; exit 1; }
                echo "$d $line" >>"$tmp/$p.rows"
            done
        done
        for d in $drafters; do
            awk -v d="$d" '$1 == d { print $2 }' "$tmp/$p.rows" | sort -n >"$tmp/s"
            med=$(awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }' "$tmp/s")
            [ "$d" = none ] && base=$med
            awk -v d="$d" -v p="$p" -v med="$med" -v base="$base" '$1 == d { pa = $3; dr += $4; ac += $5; n++ }
                END { printf "%-6s %-6s %8.1f %6.2fx %7d %9d %8.0f%%\n", p, d, med, med / base, pa, dr / n, dr ? 100 * ac / dr : 0 }' \
                "$tmp/$p.rows"
        done
    done
}

for set in $sets; do
    case $set in
    qwen3)
        echo "# $(bench_cpu), load $(cut -d' ' -f1-3 /proc/loadavg), $threads thread(s), $max greedy tokens, $reps rounds alternating; model $(basename "$model"), draft $(basename "$draft")"
        table "none ngram model" ;;
    ds4)
        for model in ds4-tiny+mtp=1 ds4-mini+mtp=1; do
            echo "# $(bench_cpu), load $(cut -d' ' -f1-3 /proc/loadavg), $threads thread(s), $max greedy tokens, $reps rounds alternating; model $model (its MTP layer drafts)"
            table "none ngram mtp"
        done ;;
    *) echo "$me: SETS takes qwen3 and ds4, not '$set'" >&2; exit 2 ;;
    esac
done
