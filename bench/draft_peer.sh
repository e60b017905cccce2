#!/bin/sh
# Speculative decoding in kvtier's server beside llama.cpp's, on the same
# files and the same requests: bench/draft_peer.sh [BIN]
#
# Two files: ../shared/models/stories260K.gguf (a real model) and the
# synthetic Qwen3-0.6B in Q4_K_M of bench/draft.sh (made here, as there,
# when missing; llama-quantize writes the Q4_K_M). A third, asked for with
# FILES=qwen35: bench/synth_llama.c's qwen3.5-0.8b-mtp in F16 (Qwen3.5-0.8B's
# shape with an MTP layer, random weights: its MTP layer drafts poorly by
# nature), on which the settings are kvtier --draft none and mtp and
# llama.cpp --spec-type none and draft-mtp (unless KVT_SETS, LLAMA_SETS). Draft models: for
# Qwen3-0.6B the synthetic qwen3-tiny of bench/draft.sh (2 layers of 256,
# the same vocabulary, random weights: it drafts poorly by nature); for
# stories260K there is no smaller real model of its vocabulary here, so it
# drafts for itself: a pair that keeps every greedy draft and saves
# nothing, which shows what the draft-model machinery costs at full
# acceptance, not what a draft model gains.
#
# The settings, each on a fresh server process (one request at a time):
#   kvtier     --draft none, ngram, model (--model-draft DRAFT); defaults
#              otherwise (--draft-max 8, adaptive)
#   llama.cpp  --spec-type none, ngram-simple, ngram-map-k, ngram-map-k4v,
#              ngram-mod, ngram-cache, each with its defaults; ngram-simple
#              once more with a 3-token key and 8-token drafts
#              (--spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8,
#              the shape of kvtier's drafter); draft-simple with -md DRAFT
# REPS rounds go through every setting in turn (alternating, so the
# machine's load drifts reach each alike). Each server gets a short warm-up
# request, then two: a copy-heavy one (a text to repeat with a change) and
# free text, both POST /v1/completions with the same body on both servers:
# the prompt verbatim, temperature 0, MAX_TOKENS tokens, streamed.
#
# Figures per request: decode tok/s client-side (the completion's tokens
# after the first over the time from the first streamed piece to the
# stream's end; the same clock for both servers), end-to-end tok/s (the
# tokens over the time from the request to the stream's end: on a model
# as fast as stories260K a reply takes a few tens of milliseconds and its
# pieces reach the client in bursts, so only this one means much there),
# llama.cpp's own
# timings.predicted_per_second next to it, and the drafts and accepted
# drafts (llama.cpp's timings.draft_n and draft_n_accepted; kvtier's
# /metrics counters kvtier_draft_tokens_total and
# kvtier_draft_accepted_tokens_total, read before and after). Every kvtier
# reply must equal its --draft none reply (the script fails otherwise); a
# llama.cpp reply that differs from its own plain one is marked.
# The table goes to stdout (the rows of every request to
# bench/draft-peer.csv): per file, prompt and setting the median tok/s
# over the rounds, the ratio to the same engine's plain decoding, the
# median end-to-end tok/s, the acceptance, and for kvtier the ratios to
# llama.cpp's best speculative setting on that file and prompt (decode
# and end-to-end, each against the setting best by that measure).
# Method and results: bench/SERVE.md, Speculative decoding beside
# llama.cpp's server.
#
#   KVT_PEER_CACHE=DIR  clone, build, models (default ~/.cache/kvtier; the
#                       llama.cpp build is bench/peer_llama.sh's)
#   FILES="stories qwen3"  which files (default these two; qwen35 the third)
#   THREADS=N           both servers' threads (default 2)
#   REPS=N              rounds (default 3)
#   MAX_TOKENS=N        tokens a request (default 128)
#   PORT=N              the servers' port (default 19200)
#   LLAMA_SETS="..."    llama.cpp's settings (names as in the table)
#   KVT_SETS="..."      kvtier's (none ngram model)
#   PEER_ARGS="..."     extra llama-server arguments (default: -nr on a CPU
#                       with AMX, as bench/serve_peer.sh)
#   JOBS=N              parallel jobs of the llama.cpp build (default 2)
set -eu
me=draft_peer.sh
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
reps=${REPS:-3}
max=${MAX_TOKENS:-128}
files=${FILES:-stories qwen3}
llama_sets=${LLAMA_SETS:-none ngram-simple ngram-simple-3-8 ngram-map-k ngram-map-k4v ngram-mod ngram-cache draft-simple}
kvt_sets=${KVT_SETS:-none ngram model}
bench_peer_args
mkdir -p "$cache/tools" "$cache/models"
. bench/peer_llama.sh

stories=$root/../shared/models/stories260K.gguf
qwen_f16=$cache/models/synth-qwen3-0.6b-f16.gguf
qwen=$cache/models/synth-qwen3-0.6b-q4_k_m.gguf
qwen_draft=$cache/models/synth-qwen3-tiny-f16.gguf
q35=$cache/models/synth-qwen3.5-0.8b-mtp-f16.gguf
case " $files " in *" qwen35 "*)
    if [ ! -f "$q35" ]; then
        bench_synth_llama
        "$cache/tools/synth_llama" --shape qwen3.5-0.8b-mtp "$src/models/ggml-vocab-qwen35.gguf" "$q35" >&2
    fi
    peer_check "$q35" ;;
esac
case " $files " in *" qwen3 "*)
    if [ ! -f "$qwen" ] || [ ! -f "$qwen_draft" ]; then
        bench_synth_llama
        [ -f "$qwen" ] || [ -f "$qwen_f16" ] ||
            "$cache/tools/synth_llama" --shape qwen3-0.6b "$src/models/ggml-vocab-qwen2.gguf" "$qwen_f16" >&2
        [ -f "$qwen_draft" ] ||
            "$cache/tools/synth_llama" --shape qwen3-tiny "$src/models/ggml-vocab-qwen2.gguf" "$qwen_draft" >&2
        bench_quantize "$qwen_f16" "$qwen" Q4_K_M
    fi
    peer_check "$qwen" ;;
esac
case " $files " in *" stories "*)
    [ -f "$stories" ] || { echo "$me: $stories missing" >&2; exit 2; } ;;
esac

bench_tmp draft-peer
port=${PORT:-19200}
base=http://127.0.0.1:$port

# The prompts, per file tag ($tag_copy, $tag_free). Qwen3: bench/draft.sh's (a C function to repeat
# with a rename; a story's start). stories260K knows no instructions and
# has a context of 512: its copy-heavy prompt is a short story told once
# and begun again, which the model goes on repeating; its free text the
# start of a story.
. "$(dirname "$0")/draft_prompts.sh"
qwen3_copy=$copy
qwen3_free=$free
qwen35_copy=$copy
qwen35_free=$free
stories_copy="Lily and Ben went to the park. They saw a big red ball. Lily said, \"Let's play with the ball!\" Ben kicked the ball and it went up high. They laughed and played all day. Then they went home and ate cake.

Lily and Ben went to the park. They saw a big red ball."
stories_free="Once upon a time, there was a little girl named"

start() { # $1 engine, $2 setting, $3 model, $4 draft model, $5 context
    if [ "$1" = kvtier ]; then
        extra=
        [ "$2" = model ] && extra="--model-draft $4"
        # shellcheck disable=SC2086
        "$bin" serve --model "$3" --port "$port" --ctx "$5" --threads "$threads" --parallel 1 --no-kv-disk \
            --draft "$2" $extra >>"$tmp/server.log" 2>&1 &
    else
        case $2 in
        none) extra= ;;
        ngram-simple-3-8) extra="--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8" ;;
        draft-simple) extra="--spec-type draft-simple -md $4 -td $threads -tbd $threads" ;;
        *) extra="--spec-type $2" ;;
        esac
        # shellcheck disable=SC2086
        "$lbin/llama-server" -m "$3" --port "$port" -c "$5" -t "$threads" -tb "$threads" -np 1 \
            $extra $peer_args >>"$tmp/server.log" 2>&1 &
    fi
    pid=$!
    bench_wait_up "$1 ($2)"
}

# One request: streams the completion and prints one JSON line (tok/s,
# tokens, the server's timings if any, the text).
ask() { # $1 prompt, $2 max tokens
    node - "$base" "$1" "$2" <<'EOF'
const [base, prompt, max] = process.argv.slice(2);
const body = JSON.stringify({ model: 'm', prompt, max_tokens: Number(max), temperature: 0, stream: true,
  stream_options: { include_usage: true } });
(async () => {
  const t0 = performance.now();
  const res = await fetch(base + '/v1/completions', { method: 'POST', headers: { 'content-type': 'application/json' }, body });
  if (!res.ok) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
  const dec = new TextDecoder();
  let buf = '', text = '', first = 0, pieces = 0, usage = null, timings = null;
  for await (const chunk of res.body) {
    buf += dec.decode(chunk, { stream: true });
    let i;
    while ((i = buf.indexOf('\n\n')) >= 0) {
      const ev = buf.slice(0, i); buf = buf.slice(i + 2);
      for (const line of ev.split('\n')) {
        if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
        const d = JSON.parse(line.slice(6));
        const piece = d.choices && d.choices[0] && d.choices[0].text;
        if (piece) { if (!first) first = performance.now(); text += piece; pieces++; }
        if (d.usage) usage = d.usage;
        if (d.timings) timings = d.timings;
      }
    }
  }
  const t1 = performance.now();
  const n = usage ? usage.completion_tokens : timings ? timings.predicted_n : pieces;
  const tps = n > 1 && t1 > first ? (n - 1) / ((t1 - first) / 1000) : 0;
  const e2e = n / ((t1 - t0) / 1000);
  console.log(JSON.stringify({ tps, e2e, n, ttft_s: (first - t0) / 1000, timings, text }));
})().catch((e) => { console.error(e.message); process.exit(1); });
EOF
}

metric() { # $1 counter name: its value on kvtier's /metrics
    curl -s --max-time 10 "$base/metrics" | awk -v k="$1" '$1 == k { print $2; f = 1 } END { if (!f) print 0 }'
}

# Every setting of one engine on one file, one round: rows
# "engine setting prompt round tok/s server_tok/s drafted accepted tokens"
# go to $tmp/rows, each reply's text to $tmp/<file>-<engine>-<setting>-<prompt>.txt
round() { # $1 file tag, $2 model, $3 draft, $4 ctx, $5 round
    for e in kvtier llama; do
        [ $e = kvtier ] && sets=$ksets || sets=$lsets
        for s in $sets; do
            start $e "$s" "$2" "$3" "$4"
            ask "Hello" 4 >/dev/null || { tail -n 20 "$tmp/server.log" >&2; exit 1; }
            for p in copy free; do
                eval "text=\$${1}_$p"
                d0=0 a0=0
                if [ $e = kvtier ]; then d0=$(metric kvtier_draft_tokens_total); a0=$(metric kvtier_draft_accepted_tokens_total); fi
                ask "$text" "$max" >"$tmp/one.json" || { echo "$me: $e $s $p failed" >&2; tail -n 20 "$tmp/server.log" >&2; exit 1; }
                if [ $e = kvtier ]; then
                    d1=$(metric kvtier_draft_tokens_total); a1=$(metric kvtier_draft_accepted_tokens_total)
                    dr=$((d1 - d0)) ac=$((a1 - a0))
                else
                    dr=$(node -e 'const j=require(process.argv[1]); console.log(j.timings && j.timings.draft_n || 0)' "$tmp/one.json")
                    ac=$(node -e 'const j=require(process.argv[1]); console.log(j.timings && j.timings.draft_n_accepted || 0)' "$tmp/one.json")
                fi
                node -e 'const j=require(process.argv[1]); process.stdout.write(j.text)' "$tmp/one.json" >"$tmp/$1-$e-$s-$p.txt"
                same=1
                if ! cmp -s "$tmp/$1-$e-$s-$p.txt" "$tmp/$1-$e-none-$p.txt"; then
                    [ $e = kvtier ] && { echo "$me: kvtier --draft $s changed the reply ($1, $p, round $5)" >&2; exit 1; }
                    same=0
                fi
                node -e 'const j=require(process.argv[1]); const t=j.timings;
                    console.log([j.tps.toFixed(2), t ? t.predicted_per_second.toFixed(2) : "-", j.n, j.e2e.toFixed(2)].join(" "))' "$tmp/one.json" |
                    while read -r tps stps n e2e; do echo "$1 $e $s $p $5 $tps $stps $dr $ac $n $same $e2e"; done >>"$tmp/rows"
            done
            bench_stop lenient
        done
    done
}

for f in $files; do
    ksets=$kvt_sets lsets=$llama_sets
    case $f in
    stories) model=$stories draft=$stories ctx=512 ;;
    qwen3) model=$qwen draft=$qwen_draft ctx=2048 ;;
    qwen35) model=$q35 draft=$q35 ctx=2048 ksets=${KVT_SETS:-none mtp} lsets=${LLAMA_SETS:-none draft-mtp} ;;
    *) echo "$me: FILES takes stories, qwen3 and qwen35, not '$f'" >&2; exit 2 ;;
    esac
    echo "$me: $f: $reps rounds of kvtier ($ksets) and llama.cpp ($lsets)" >&2
    for r in $(seq 1 "$reps"); do round "$f" "$model" "$draft" "$ctx" "$r"; done
done

echo "# $(bench_cpu), $(nproc 2>/dev/null || echo '?') cores, load $(cut -d' ' -f1-3 /proc/loadavg) at the end; $threads threads," \
    "$max greedy tokens, $reps rounds alternating, median; llama.cpp $commit${peer_args:+ ($peer_args)}"
{
    echo "file,engine,setting,prompt,round,tok_s,server_tok_s,drafted,accepted,tokens,same_reply,e2e_tok_s"
    tr ' ' ',' <"$tmp/rows"
} >bench/draft-peer.csv
awk '
    { k = $1 " " $2 " " $3 " " $4; c = ++n[k]; v[k, c] = $6; sv[k, c] = $7; ev[k, c] = $12; dr[k] += $8; ac[k] += $9
      if (!$11) diff[k] = 1; if (!(k in seen)) { seen[k] = 1; order[++no] = k } }
    function med(arr, k, m,   i, j, t, a) { for (i = 1; i <= m; i++) a[i] = arr[k, i] + 0
        for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
        return m % 2 ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2 }
    END {
        for (i = 1; i <= no; i++) { k = order[i]; split(k, f, " "); m[k] = med(v, k, n[k]); me[k] = med(ev, k, n[k])
            if (f[2] == "llama" && f[3] != "none" && m[k] > best[f[1], f[4]]) { best[f[1], f[4]] = m[k]; bname[f[1], f[4]] = f[3] }
            if (f[2] == "llama" && f[3] != "none" && me[k] > beste[f[1], f[4]]) { beste[f[1], f[4]] = me[k]; bnamee[f[1], f[4]] = f[3] } }
        printf "%-8s %-5s %-7s %-17s %8s %8s %8s %8s %9s %9s %10s %8s\n", "file", "text", "engine", "setting", "tok/s", "x_plain", "e2e", "accept",
            "vs_best", "e2e_best", "llama_own", "reply"
        for (i = 1; i <= no; i++) { k = order[i]; split(k, f, " ")
            plain = m[f[1] " " f[2] " none " f[4]]
            vb = f[2] == "kvtier" && best[f[1], f[4]] ? sprintf("%.2fx", m[k] / best[f[1], f[4]]) : "-"
            vbe = f[2] == "kvtier" && beste[f[1], f[4]] ? sprintf("%.2fx", me[k] / beste[f[1], f[4]]) : "-"
            acc = dr[k] ? sprintf("%.0f%%", 100 * ac[k] / dr[k]) : "-"
            own = f[2] == "llama" ? sprintf("%.1f", med(sv, k, n[k])) : "-"
            printf "%-8s %-5s %-7s %-17s %8.1f %7.2fx %8.1f %8s %9s %9s %10s %8s\n", f[1], f[4], f[2], f[3], m[k],
                plain ? m[k] / plain : 0, me[k], acc, vb, vbe, own, diff[k] ? "differs" : "same" }
        for (k in bname) { split(k, f, SUBSEP); printf "# llama.cpp best speculative setting, %s %s: %s (decode), %s (e2e)\n", f[1], f[2], bname[k], bnamee[k] }
    }' "$tmp/rows"
echo "rows written to bench/draft-peer.csv"
