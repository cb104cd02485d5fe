#!/usr/bin/env bash
# Throughput of a 6-node Tessera cluster with 3 replicas per shard, MS+SC (chain
# replication) and MS+EC (primary–backup), against a 3-member etcd cluster, on
# this machine, with one tool for all: go-ycsb v1.0.1 (its redis binding in
# cluster mode, its etcd binding over gRPC; etcd's reads are linearizable by
# default). Workloads: YCSB A (50% reads, 50% updates, zipfian) and W (100%
# updates), 10 fields of 100 bytes per record.
#
#   scripts/bench-cluster-vs-etcd.sh [records=20000] [operations=60000] [threads=32] [repeats=3]
#
# Prints one line per run and the medians, and leaves the go-ycsb outputs in
# the work directory it names.
set -euo pipefail
cd "$(dirname "$0")/.."
RECORDS=${1:-20000}
OPERATIONS=${2:-60000}
THREADS=${3:-32}
REPEATS=${4:-3}

if ! command -v etcd >/dev/null || ! command -v etcdctl >/dev/null; then
    sudo_if_needed=""
    [ "$(id -u)" = 0 ] || sudo_if_needed=sudo
    $sudo_if_needed apt-get install -y -q etcd-server etcd-client >/dev/null
fi
scripts/build-go-ycsb.sh
cargo build --release -q -p tessera-cli
YCSB="$PWD/target/tools/go-ycsb"
WORKLOADS="$PWD/target/tools/go-ycsb-src/workloads"
TESSERA="$PWD/target/release/tessera"
WORK=$(mktemp -d /tmp/tessera-vs-etcd.XXXXXX)
echo "work directory: $WORK"

ETCD_PIDS=()
cleanup() {
    for pid in "${ETCD_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    "$TESSERA" cluster down --dir "$WORK/tessera" >/dev/null 2>&1 || true
}
trap cleanup EXIT

start_etcd() {
    local members="e1=http://127.0.0.1:12380,e2=http://127.0.0.1:22380,e3=http://127.0.0.1:32380"
    local token="bench-$RANDOM$RANDOM"
    for i in 1 2 3; do
        etcd --name "e$i" --data-dir "$WORK/etcd-data-$token/e$i" \
            --listen-client-urls "http://127.0.0.1:${i}2379" --advertise-client-urls "http://127.0.0.1:${i}2379" \
            --listen-peer-urls "http://127.0.0.1:${i}2380" --initial-advertise-peer-urls "http://127.0.0.1:${i}2380" \
            --initial-cluster "$members" --initial-cluster-state new --initial-cluster-token "$token" \
            >"$WORK/etcd-$i.log" 2>&1 &
        ETCD_PIDS+=($!)
    done
    for _ in $(seq 100); do
        ETCDCTL_API=3 etcdctl --endpoints=127.0.0.1:12379 put ready 1 >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    echo "etcd did not start; see $WORK/etcd-*.log" >&2
    exit 1
}

stop_etcd() {
    for pid in "${ETCD_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${ETCD_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    ETCD_PIDS=()
}

# ycsb NAME DB PROPERTIES...: load, then run A and W; prints "NAME A ops/s" lines.
ycsb() {
    local name=$1 db=$2
    shift 2
    local common=(-P "$WORKLOADS/workloada" -p recordcount="$RECORDS" -p threadcount="$THREADS" "$@")
    "$YCSB" load "$db" "${common[@]}" >"$WORK/$name-load.txt" 2>&1
    for workload in A W; do
        local mix=()
        [ "$workload" = W ] && mix=(-p readproportion=0 -p updateproportion=1)
        "$YCSB" run "$db" "${common[@]}" -p operationcount="$OPERATIONS" "${mix[@]}" \
            >"$WORK/$name-$workload.txt" 2>&1
        local ops
        ops=$(grep -E '^(TOTAL|Run finished)' "$WORK/$name-$workload.txt" | grep -oE 'OPS: [0-9.]+' | tail -1 | cut -d' ' -f2)
        local errors
        errors=$(grep -cE '_ERROR' "$WORK/$name-$workload.txt" || true)
        echo "$name $workload ${ops:-0} errors-lines=$errors"
    done
}

RESULTS="$WORK/results.txt"
for repeat in $(seq "$REPEATS"); do
    start_etcd
    ycsb etcd etcd -p etcd.endpoints=127.0.0.1:12379,127.0.0.1:22379,127.0.0.1:32379 | tee -a "$RESULTS"
    stop_etcd
    for consistency in strong eventual; do
        rm -rf "$WORK/tessera"
        "$TESSERA" cluster up --dir "$WORK/tessera" --nodes 6 --groups 6 --replicas 3 --consistency "$consistency" \
            --base-port 17000 --no-demo >/dev/null
        addresses=$(seq -s';' 17001 17006 | sed 's/\([0-9]*\)/127.0.0.1:\1/g')
        # go-ycsb separates cluster addresses with semicolons.
        ycsb "tessera-$consistency" redis -p redis.mode=cluster -p redis.addr="$addresses" | tee -a "$RESULTS"
        "$TESSERA" cluster down --dir "$WORK/tessera" >/dev/null
    done
    echo "-- repeat $repeat done"
done

echo
echo "medians over $REPEATS runs (ops/s; records $RECORDS, operations $OPERATIONS, threads $THREADS):"
python3 - "$RESULTS" <<'EOF'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    name, workload, ops, _ = line.split()
    runs[(name, workload)].append(float(ops))
for workload in "AW":
    etcd = statistics.median(runs[("etcd", workload)])
    for name in ("etcd", "tessera-strong", "tessera-eventual"):
        median = statistics.median(runs[(name, workload)])
        print(f"  {workload}  {name:<17} {median:>9.0f}   {median / etcd:5.2f}x etcd")
EOF
