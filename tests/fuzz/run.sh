#!/bin/sh
# Runs libFuzzer targets, one after another, each in one process:
#   tests/fuzz/run.sh BUILD_DIR TARGET...          (what `make fuzz` runs)
# Each target runs for FUZZ_SECONDS (default 60) on its corpus
# BUILD_DIR/corpus/<target>/, which is kept between runs (what a run adds,
# the next one starts from), with the seeds of tests/fuzz/seeds/<target>/ and
# BUILD_DIR/seeds/<target>/ read as well, and the dictionary of
# tests/fuzz/dict/ that suits it. Its log is BUILD_DIR/logs/<target>.log,
# and what it finds (a crash, a leak, a timeout of FUZZ_TIMEOUT seconds,
# default 30, more than FUZZ_RSS_MB of memory, default 2048, or a broken
# property) is saved in BUILD_DIR/crashes/<target>/. Prints one line per
# target (also appended to BUILD_DIR/summary.txt) and exits 1 when any
# target found something. FUZZ_FLAGS adds libFuzzer flags (-max_len=N, ...).
set -u
fb=$1
shift
secs=${FUZZ_SECONDS:-60}
found=0
mkdir -p "$fb/logs"
header=$(printf '%-17s %8s %12s %8s %6s %6s  %s' target seconds executions exec/s cov rss_mb result)
echo "$header"
echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC')" >>"$fb/summary.txt"
for t in "$@"; do
    bin=$fb/fuzz-$t
    log=$fb/logs/$t.log
    if [ ! -x "$bin" ]; then
        echo "$t: no $bin (make fuzz-build)" >&2
        found=1
        continue
    fi
    mkdir -p "$fb/corpus/$t" "$fb/crashes/$t"
    case $t in
    api_* | template) dict=tests/fuzz/dict/json.dict ;;
    *) dict=tests/fuzz/dict/$t.dict ;;
    esac
    [ -f "$dict" ] || dict=
    seeds=
    for d in "tests/fuzz/seeds/$t" "$fb/seeds/$t"; do
        [ -d "$d" ] && seeds="$seeds $d"
    done
    # what counts as found: crash-, leak-, timeout-, oom- files (not
    # slow-unit- ones: libFuzzer's note of a unit over -report_slow_units,
    # which a paused process also leaves; that is reported, not counted)
    found_files() { ls "$fb/crashes/$t" | grep -v '^slow-unit-' | wc -l; }
    before=$(found_files)
    # shellcheck disable=SC2086
    "$bin" -max_total_time="$secs" -timeout="${FUZZ_TIMEOUT:-30}" -rss_limit_mb="${FUZZ_RSS_MB:-2048}" \
        -print_final_stats=1 -artifact_prefix="$fb/crashes/$t/" ${dict:+-dict=$dict} ${FUZZ_FLAGS:-} \
        "$fb/corpus/$t" $seeds >"$log" 2>&1
    rc=$?
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
    rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$log" | tail -n 1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)
    after=$(found_files)
    slow=$(sed -n 's/^stat::slowest_unit_time_sec: *//p' "$log" | tail -n 1)
    if [ "$rc" = 0 ] && [ "$after" = "$before" ]; then
        result=ok
        [ "${slow:-0}" -ge 10 ] && result="ok (slowest unit ${slow} s: rerun it alone to tell a pause from a slow input)"
    else
        found=1
        new=$(ls -t "$fb/crashes/$t" | grep -v '^slow-unit-' | head -n 1)
        result="FOUND (exit $rc): $fb/crashes/$t/$new, log $log"
    fi
    line=$(printf '%-17s %8s %12s %8s %6s %6s  %s' "$t" "$secs" "${execs:-?}" "${speed:-?}" "${cov:-?}" \
        "${rss:-?}" "$result")
    echo "$line"
    echo "$line" >>"$fb/summary.txt"
    if [ "$result" != ok ]; then
        grep -E '^(==[0-9]+==ERROR|SUMMARY|fuzz: property broken|.*runtime error)' "$log" | head -n 5 | sed 's/^/    /'
    fi
done
if [ "$found" != 0 ]; then
    echo "fuzz: found something; reproduce with $fb/fuzz-TARGET FILE, keep the input in tests/fuzz/regress/TARGET/" >&2
fi
exit "$found"
