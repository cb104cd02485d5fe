#!/usr/bin/env bash
# Two builds of tessera side by side: the CPU time a request costs each (user +
# system, from /proc), one worker each, redis-benchmark -n 1000000 -r 1000000
# -c 50, after 1,000,000 SETs load both. Rounds alternate which goes first, so
# that a neighbour's load falls on both alike; the report gives each round's
# figures and the medians.
# Usage: scripts/bench-two-builds.sh BEFORE_BINARY AFTER_BINARY ROUNDS TEST:PIPELINE...
#   e.g. scripts/bench-two-builds.sh /tmp/tessera-old target/release/tessera 5 get:16 lpush:16 get:1
set -euo pipefail
[ $# -ge 4 ] || { sed -n 2,8p "$0" >&2; exit 2; }
before=$1 after=$2 rounds=$3
shift 3
command -v redis-benchmark >/dev/null || { echo "needs redis-benchmark (apt-get install redis-tools)" >&2; exit 1; }
data=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$data"; }
trap cleanup EXIT
declare -A port pid
port[before]=7701 port[after]=7702
for build in before after; do
    binary=$before
    [ "$build" = after ] && binary=$after
    "$binary" serve --port "${port[$build]}" --dir "$data/$build" --log warn --threads 1 &
    pid[$build]=$!
    pids+=($!)
done
sleep 1
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
requests=1000000
for build in before after; do
    redis-benchmark -p "${port[$build]}" -t set -n $requests -r 1000000 -P 16 -c 50 -q >/dev/null
done
results="$data/results"
for round in $(seq 1 "$rounds"); do
    order="before after"
    [ $((round % 2)) = 0 ] && order="after before"
    for test in "$@"; do
        for build in $order; do
            ticks=$(cpu_ticks "${pid[$build]}")
            redis-benchmark -p "${port[$build]}" -t "${test%%:*}" -n $requests -r 1000000 -P "${test##*:}" -c 50 -q \
                >/dev/null
            ticks=$(($(cpu_ticks "${pid[$build]}") - ticks))
            # A tick is 10 ms: µs a request = ticks * 10,000 / requests.
            echo "$test $build $(echo "scale=3; $ticks * 10000 / $requests" | bc)" >>"$results"
        done
    done
    echo "round $round done" >&2
done
echo "| test:pipeline | before, CPU µs/request (rounds) | after | median after / before |"
echo "|---|---|---|---:|"
for test in "$@"; do
    figures() { awk -v t="$test" -v b="$1" '$1 == t && $2 == b {print $3}' "$results"; }
    median() { sort -n | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
    b=$(figures before | median) a=$(figures after | median)
    echo "| $test | $(figures before | paste -sd' ') | $(figures after | paste -sd' ') | $(echo "scale=2; $a / $b" | bc) |"
done
