#!/bin/sh
# DeepSeek-V4's MTP layer against llama.cpp's: bench/mtp_peer.sh [BIN]
#
# Writes ds4-tiny+mtp=1 (PRESET) with the deepseek-llm vocabulary (a
# tokenizer llama.cpp reads; ../shared/vocab/ or the llama.cpp tree's
# models/), runs N tokens (default 200) through llama.cpp's model and MTP
# contexts (bench/mtp_peer_llama.cpp, built against the llama.cpp tree
# bench/peer_llama.sh builds: $cache/llama.cpp-*/build/bin) and through
# kvtier (bench/mtp_peer.c, against libkvtier.a), and prints how far the
# MTP logits are apart: once with each engine's own hidden states (the
# model's differences, which the peers test bounds, carried into the
# layer), once with kvtier's layer reading llama.cpp's (the layer alone).
# README.md, Speculative decoding, has the figures.
#
#   KVT_PEER_CACHE=DIR  the llama.cpp tree (default ~/.cache/kvtier)
#   PRESET=P N=N
set -eu
me=mtp_peer.sh
# shellcheck source=bench/lib.sh
. "$(dirname "$0")/lib.sh"
bench_bin "${1:-}"
bench_lib
bench_need cc c++
cd "$root"
cache=${KVT_PEER_CACHE:-$HOME/.cache/kvtier}
preset=${PRESET:-ds4-tiny+mtp=1}
n=${N:-200}
llama=$(ls -d "$cache"/llama.cpp-* 2>/dev/null | head -n 1)
[ -n "$llama" ] && [ -f "$llama/build/bin/libllama.so" ] ||
    { echo "$me: no llama.cpp build under $cache (run bench/peer_llama.sh)" >&2; exit 2; }
grep -q LLAMA_CONTEXT_TYPE_MTP "$llama/include/llama.h" ||
    { echo "$me: $llama has no MTP context (llama.cpp too old)" >&2; exit 2; }
vocab=$root/../shared/vocab/ggml-vocab-deepseek-llm.gguf
[ -f "$vocab" ] || vocab=$llama/models/ggml-vocab-deepseek-llm.gguf
[ -f "$vocab" ] || { echo "$me: no ggml-vocab-deepseek-llm.gguf" >&2; exit 2; }
bench_tmp mtp-peer
"$bin" model new --preset "$preset" --vocab "$vocab" --out "$tmp/m.gguf" >&2
c++ -O1 -std=c++17 -I"$llama/include" -I"$llama/ggml/include" bench/mtp_peer_llama.cpp \
    -L"$llama/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$llama/build/bin" -o "$tmp/ll"
# shellcheck disable=SC2046
cc -std=c11 -O1 -Isrc -Iinclude bench/mtp_peer.c "$lib" $(sed -n 's/^PKG_LIBS := //p' "$(dirname "$bin")/config.mk") \
    -lm -lpthread -o "$tmp/kv"
"$tmp/ll" "$tmp/m.gguf" "$n" "$tmp/ll.bin" 2>"$tmp/ll.log" || { tail -20 "$tmp/ll.log" >&2; exit 1; }
echo "# $preset, $n tokens, llama.cpp $(basename "$llama")"
echo "each engine's own hidden states:"
"$tmp/kv" "$tmp/m.gguf" "$tmp/ll.bin" "$n"
echo "kvtier's layer on llama.cpp's hidden states:"
LLH=1 "$tmp/kv" "$tmp/m.gguf" "$tmp/ll.bin" "$n"
