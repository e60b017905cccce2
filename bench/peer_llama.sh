# Sourced by bench/peers.sh, bench/serve_peer.sh and bench/serve_batch.sh
# (POSIX sh; bench/lib.sh has the rest they share): the peer, the llama.cpp
# source that npm's node-llama-cpp 3.22.1 ships as a git
# bundle (installed with `npm ci --omit=optional --prefix tests/peer` when
# missing, as tests/test_peer.c does), cloned once into $cache and built
# there natively with cmake: llama-bench, llama-quantize and llama-server.
# A rerun reuses the build. Expects $cache and $jobs; the caller is in the
# repository root. Sets $src (the clone), $lbin (its binaries), $commit and
# $peer_build (which build $lbin is, for a table's header).
# me: the caller's name, for messages.
#
# A native build can trap: on a Sapphire Rapids VM whose kernel does not
# grant the AMX tile state, -march=native compiles ggml's AMX path in and
# llama-bench dies of SIGILL on every quantised file. Once the caller has a
# quantised file it calls peer_check FILE: llama-bench runs on it (8
# prompt tokens, one thread, one repetition); when it dies of SIGILL (exit
# status 132) the clone is built again in build-noamx/ with
# -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 in CMAKE_C_FLAGS and
# CMAKE_CXX_FLAGS (GGML_NATIVE stays on: with gcc an explicit -mno-X holds
# against -march=native, and ggml compiles its AMX code only under
# __AMX_INT8__), $lbin moves there and $peer_build says so. A rerun that
# finds that build checks it the same way. PEER_LLAMA_BENCH=PATH replaces
# the native llama-bench that peer_check runs (tests of the detection).
me=${me:-peer_llama.sh}

peer=tests/peer
peer_version=3.22.1
bundle=$peer/node_modules/node-llama-cpp/llama/gitRelease.bundle
have_peer() {
    [ -f "$bundle" ] &&
        grep -q "\"version\": \"$peer_version\"" "$peer/node_modules/node-llama-cpp/package.json" 2>/dev/null
}
if ! have_peer; then
    # tests/test_peer.c holds the same lock while it installs
    exec 9<"$peer/package.json"
    flock 9
    if ! have_peer; then
        echo "$me: installing node-llama-cpp $peer_version: npm ci --omit=optional --prefix $peer" >&2
        npm ci --omit=optional --prefix "$peer" --no-audit --no-fund --loglevel=error >&2 ||
            { echo "$me: npm ci failed" >&2; exit 1; }
    fi
    exec 9<&-
    have_peer || { echo "$me: npm ci did not install $bundle" >&2; exit 1; }
fi

commit=$(git bundle list-heads "$bundle" | awk '$2 == "HEAD" { print $1; exit }')
[ -n "$commit" ] || { echo "$me: $bundle has no HEAD" >&2; exit 1; }
src=$cache/llama.cpp-$commit
if [ ! -f "$src/CMakeLists.txt" ]; then
    echo "$me: cloning llama.cpp $commit into $src" >&2
    rm -rf "$src.part"
    git -c advice.detachedHead=false clone -q "$bundle" "$src.part"
    [ "$(git -C "$src.part" rev-parse HEAD)" = "$commit" ] ||
        { echo "$me: the clone of $bundle is not at $commit" >&2; exit 1; }
    mv "$src.part" "$src"
fi
lbin=$src/build/bin
if [ ! -x "$lbin/llama-bench" ] || [ ! -x "$lbin/llama-quantize" ] || [ ! -x "$lbin/llama-server" ]; then
    echo "$me: building llama-bench, llama-quantize and llama-server with cmake (-j$jobs, nice 10; log $src/build.log)" >&2
    t0=$(date +%s)
    # LLAMA_OPENSSL=OFF: no HTTPS downloads, so no libssl-dev
    { nice -n 10 cmake -S "$src" -B "$src/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
          -DCMAKE_BUILD_TYPE=Release &&
          nice -n 10 cmake --build "$src/build" --target llama-bench llama-quantize llama-server -j "$jobs"; } \
        >"$src/build.log" 2>&1 ||
        { tail -n 30 "$src/build.log" >&2; echo "$me: the llama.cpp build failed (log $src/build.log)" >&2; exit 1; }
    echo $(($(date +%s) - t0)) >"$src/build/kvtier-build-seconds"
fi
# shellcheck disable=SC2034 # read by the caller
peer_build="native (GGML_NATIVE=ON)"
noamx_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

# peer_traps BENCH FILE LOG: true when llama-bench BENCH dies of SIGILL on
# FILE (exit status 128 + 4); its output goes to LOG.
peer_traps() {
    rc=0
    "$1" -m "$2" -p 8 -n 0 -r 1 -t 1 >"$3" 2>&1 || rc=$?
    [ "$rc" = 132 ]
}

# peer_check FILE: keeps $lbin at the native build when its llama-bench runs
# FILE, else builds (once) and moves to the build without AMX; exits when
# that one traps too.
peer_check() {
    noamx=$src/build-noamx
    log=$src/build/kvtier-trap-check.log
    if ! peer_traps "${PEER_LLAMA_BENCH:-$src/build/bin/llama-bench}" "$1" "$log"; then
        echo "$me: the native llama.cpp build does not die of SIGILL on $(basename "$1")" >&2
        return 0
    fi
    echo "$me: the native llama.cpp build dies of SIGILL (exit 132) on $(basename "$1") (log $log): using a build without AMX ($noamx_flags)" >&2
    if [ ! -x "$noamx/bin/llama-bench" ] || [ ! -x "$noamx/bin/llama-quantize" ] || [ ! -x "$noamx/bin/llama-server" ]; then
        echo "$me: building llama.cpp without AMX in $noamx (-j$jobs, nice 10; log $src/build-noamx.log)" >&2
        t0=$(date +%s)
        { nice -n 10 cmake -S "$src" -B "$noamx" -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
              -DGGML_AMX_BF16=OFF -DCMAKE_C_FLAGS="$noamx_flags" -DCMAKE_CXX_FLAGS="$noamx_flags" \
              -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release &&
              nice -n 10 cmake --build "$noamx" --target llama-bench llama-quantize llama-server -j "$jobs"; } \
            >"$src/build-noamx.log" 2>&1 ||
            { tail -n 30 "$src/build-noamx.log" >&2; echo "$me: the llama.cpp build without AMX failed (log $src/build-noamx.log)" >&2; exit 1; }
        echo $(($(date +%s) - t0)) >"$noamx/kvtier-build-seconds"
    fi
    if peer_traps "${PEER_LLAMA_BENCH_NOAMX:-$noamx/bin/llama-bench}" "$1" "$noamx/kvtier-trap-check.log"; then
        echo "$me: the llama.cpp build without AMX dies of SIGILL too (log $noamx/kvtier-trap-check.log)" >&2
        exit 1
    fi
    lbin=$noamx/bin
    # shellcheck disable=SC2034 # read by the caller
    peer_build="native without AMX (GGML_NATIVE=ON, CMAKE_C_FLAGS/CMAKE_CXX_FLAGS $noamx_flags): the native build died of SIGILL on $(basename "$1")"
}
