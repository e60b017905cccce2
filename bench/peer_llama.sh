# Sourced by bench/peers.sh, bench/serve_peer.sh and bench/serve_batch.sh
# (POSIX sh; bench/lib.sh has the rest they share): the peer, the llama.cpp
# source that npm's node-llama-cpp 3.22.1 ships as a git
# bundle (installed with `npm ci --omit=optional --prefix tests/peer` when
# missing, as tests/test_peer.c does), cloned once into $cache and built
# there natively with cmake: llama-bench, llama-quantize and llama-server.
# A rerun reuses the build. Expects $cache and $jobs; the caller is in the
# repository root. Sets $src (the clone), $lbin (its binaries) and $commit.
# me: the caller's name, for messages.
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
