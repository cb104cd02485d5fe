#!/usr/bin/env bash
# Runs the tests that feed arbitrary input to what listens on a socket or
# reads from disk, with many more cases than the test suite gives them:
# the RESP request and reply parsers, the peer codec of every protocol, the
# peer handshake, the coordinator's commands and the replication records.
#
#   scripts/fuzz.sh [cases=20000]
#
# Each test is a proptest: a failure prints the smallest input that breaks it.
set -euo pipefail
cd "$(dirname "$0")/.."
CASES=${1:-20000}
export PROPTEST_CASES=$CASES
run() {
    echo "== $*"
    local output
    if ! output=$(cargo test --release -q "$@" 2>&1); then
        echo "$output" | tail -60
        exit 1
    fi
    echo "$output" | grep "test result" | grep -v " 0 passed" || true
}
run -p tessera-wire -- never_panic arbitrary
run -p tessera-protocol -- messages_round_trip_and_cut_ones_are_errors garbage records_round_trip
run -p tessera-cluster -- survives_whatever
