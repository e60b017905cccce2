#!/bin/sh
# Run every benchmark suite: bench/run.sh [BIN [extra bench flags]]
# The table goes to stdout, the same rows to bench/results.csv. BIN defaults
# to build/kvtier; it runs from the repository root so that the default llama
# model (../shared/models/stories260K.gguf) resolves.
set -eu
me=run.sh
# shellcheck source=bench/lib.sh
. "$(dirname "$0")/lib.sh"
bench_bin "${1:-}"
[ $# -gt 0 ] && shift
cd "$root"
exec "$bin" bench --suite all --csv bench/results.csv "$@"
