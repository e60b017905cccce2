#!/bin/sh
# Run every benchmark suite: bench/run.sh [BIN [extra bench flags]]
# The table goes to stdout, the same rows to bench/results.csv. BIN defaults
# to build/kvtier; it runs from the repository root so that the default llama
# model (../shared/models/stories260K.gguf) resolves.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-$root/build/kvtier}
[ $# -gt 0 ] && shift
case $bin in
    /*) ;;
    */*) bin=$(pwd)/$bin ;;
    *) bin=$(command -v "$bin") ;;
esac
[ -x "$bin" ] || { echo "run.sh: $bin is not an executable (build it with make)" >&2; exit 2; }
cd "$root"
exec "$bin" bench --suite all --csv bench/results.csv "$@"
