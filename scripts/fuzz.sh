#!/usr/bin/env bash
# Runs the tests that feed arbitrary input to what listens on a socket or
# reads from disk, with many more cases than the test suite gives them:
# the RESP request and reply parsers, every command (as an open and as a
# restricted user), the peer codec of every protocol, the peer handshake and
# link frames, the coordinator's commands and the replication records.
#
#   scripts/fuzz.sh [cases=20000]          each target once, with that many cases
#   scripts/fuzz.sh [cases] SECONDS        each target again and again, with new
#                                          random cases each round, for SECONDS
#
# Each test is a proptest: a failure prints the smallest input that breaks it.
set -euo pipefail
cd "$(dirname "$0")/.."
CASES=${1:-20000}
SECONDS_PER_TARGET=${2:-0}
export PROPTEST_CASES=$CASES
cargo test --release -q --no-run -p tessera-wire -p tessera-protocol -p tessera-cluster -p tessera-node 2>/dev/null
run() {
    local name=$1
    shift
    local deadline=$((SECONDS + SECONDS_PER_TARGET)) rounds=0 output
    while :; do
        if ! output=$(cargo test --release -q "$@" 2>&1); then
            echo "$output" | tail -60
            exit 1
        fi
        rounds=$((rounds + 1))
        [ "$SECONDS" -lt "$deadline" ] || break
    done
    echo "== $name: $rounds round(s) of $CASES cases, 0 failures"
}
run "request and reply parsers" -p tessera-wire -- never_panic arbitrary
run "peer codecs and records" -p tessera-protocol -- messages_round_trip_and_cut_ones_are_errors garbage records_round_trip
run "peer port and coordinator" -p tessera-cluster -- survives_whatever
run "every command" -p tessera-node --test command_fuzz
