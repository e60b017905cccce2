# Sourced by the bench/ scripts (POSIX sh), which share through it what
# each used to repeat: the binary under test, the tools a script needs, a
# scratch directory removed at exit (with the server still running, if
# any), a free loopback port, a server's start and stop, the CPU's name,
# and the peer's models. The caller sets `me` (its name, for messages) and
# sources it by path, before changing directory:
#
#   me=serve.sh
#   . "$(dirname "$0")/lib.sh"
#   bench_bin "${1:-}"        # $bin, absolute; then cd "$root"
#
# Every failure prints "$me: ..." on stderr and exits: 2 for what the
# machine lacks (the binary, a tool), 1 for what failed.

root=$(cd "$(dirname "$0")/.." && pwd)
me=${me:-bench}
pid=
tmp=

# $bin: BIN as given on the command line (empty: build/kvtier), made
# absolute so that the script may cd: a bare name is looked up on PATH,
# then in the current directory.
bench_bin() {
    bin=${1:-$root/build/kvtier}
    case $bin in
        /*) ;;
        */*) bin=$(pwd)/$bin ;;
        *) bin=$(command -v "$bin" || echo "$(pwd)/$bin") ;;
    esac
    [ -x "$bin" ] || { echo "$me: $bin is not an executable (build it with make)" >&2; exit 2; }
}

# $lib: the libkvtier.a beside $bin (bench/synth_llama.c links against it).
bench_lib() {
    lib=$(dirname "$bin")/libkvtier.a
    [ -f "$lib" ] || { echo "$me: $lib not found (build it with make)" >&2; exit 2; }
}

# Each command named must be on PATH.
bench_need() {
    for c in "$@"; do
        command -v "$c" >/dev/null 2>&1 || { echo "$me: $c is needed" >&2; exit 2; }
    done
}

# $tmp: a fresh directory /tmp/kvtier-$1-XXXXXX. At exit the server ($pid),
# if one is running, is killed and the directory removed; SIGINT and
# SIGTERM exit 130 through the same path.
bench_tmp() {
    tmp=$(mktemp -d "/tmp/kvtier-$1-XXXXXX")
    trap bench_cleanup EXIT
    trap 'exit 130' INT TERM
}
bench_cleanup() {
    if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
    [ -z "$tmp" ] || rm -rf "$tmp"
}

# $port: PORT from the environment (a machine that gives each user a range
# of ports), else a loopback port free now (node asks the kernel for one);
# $base: its URL.
bench_port() {
    port=${PORT:-$(node -e 'const s = require("net").createServer().listen(0, "127.0.0.1", () => { console.log(s.address().port); s.close(); })')}
    base=http://127.0.0.1:$port
}

# After a script's start() has launched a server into the background ($pid,
# its log $tmp/server.log): wait until $base/health answers, up to $2
# tenths of a second (default 1200: two minutes); a server that exits or
# does not come up ends the script with its log's tail. $1 names it.
bench_wait_up() {
    i=0
    until curl -sf -o /dev/null --max-time 2 "$base/health"; do
        i=$((i + 1))
        if [ $i -gt "${2:-1200}" ] || ! kill -0 "$pid" 2>/dev/null; then
            echo "$me: the $1 server did not come up; its log:" >&2
            tail -n 40 "$tmp/server.log" >&2
            exit 1
        fi
        sleep 0.1
    done
}

# SIGTERM to the server and wait for it. $1: strict, its exit status
# must be 0 (kvtier's is, after saving its sessions); lenient, it is
# ignored (llama.cpp's server).
bench_stop() {
    kill -TERM "$pid"
    st=0
    wait "$pid" || st=$?
    pid=
    if [ "${1:-}" = strict ] && [ $st -ne 0 ]; then
        echo "$me: the server exited with status $st after SIGTERM; its log:" >&2
        tail -n 40 "$tmp/server.log" >&2
        exit 1
    fi
}

# The CPU's model name, for the tables' header lines.
bench_cpu() {
    cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n 1)
    echo "${cpu:-unknown}"
}

# $peer_args: PEER_ARGS, or by default -nr on a CPU with AMX, where
# llama.cpp's extra buffer types (AMX, repacked weights) crash its server's
# warm-up on the synthetic files (a segmentation fault, and
# tests/test_peer_logits.c's abort for the deepseek4 graph): there it runs
# with plain CPU buffers, which the tables' headers say.
bench_peer_args() {
    if [ -z "${PEER_ARGS+x}" ] && grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then peer_args=-nr
    else peer_args=${PEER_ARGS:-}; fi
}

# $cache/tools/synth_llama, built from bench/synth_llama.c against $lib
# with the packages' flags of the build ($(dirname $bin)/config.mk).
bench_synth_llama() {
    mkdir -p "$cache/tools" "$cache/models"
    pkg_libs=$(sed -n 's/^PKG_LIBS := //p' "$(dirname "$bin")/config.mk" 2>/dev/null || true)
    # shellcheck disable=SC2086
    cc -O2 -std=c11 -D_GNU_SOURCE -Wall -Wextra -Iinclude -Isrc -o "$cache/tools/synth_llama" \
        bench/synth_llama.c "$lib" $pkg_libs -lpthread -lm
}

# $2 made from $1 by llama-quantize to type $3 (through a .part file, so an
# interrupted run leaves no half file), unless $2 exists; the log beside it.
bench_quantize() {
    [ -f "$2" ] && return 0
    echo "$me: llama-quantize to $3: $2" >&2
    "$lbin/llama-quantize" "$1" "${2%.gguf}.part.gguf" "$3" >"${2%.gguf}.log" 2>&1 ||
        { tail -n 20 "${2%.gguf}.log" >&2; echo "$me: llama-quantize $3 of $1 failed" >&2; exit 1; }
    mv "${2%.gguf}.part.gguf" "$2"
}
