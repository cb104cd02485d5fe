#!/usr/bin/env bash
# YCSB workloads A, B, C and F (zipfian; records of 10 fields x 100 bytes, as
# YCSB's Redis binding stores them) against Tessera (memory engine) and Redis on
# this machine in one run, all driven by `tessera bench`. Each server runs one
# worker thread and the client one thread, so the two cores are shared alike.
# At pipeline 1 the client's single thread is close to its own ceiling, so the
# servers are also compared at pipeline 16. Rounds alternate the order of the
# servers; the table gives medians and the Tessera/Redis ratio.
# Usage: scripts/bench-ycsb-vs-redis.sh [ROUNDS] [RECORDS] [OPERATIONS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
records=${2:-100000}
operations=${3:-500000}
out=${BENCH_OUT:-bench-results}/ycsb-vs-redis
mkdir -p "$out"

command -v redis-server >/dev/null || { echo "needs redis-server (apt-get install redis-server)" >&2; exit 1; }
cargo build --release -q

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
data=$(mktemp -d)
declare -A ports=([redis]=7611 [tessera]=7612)
redis-server --port 7611 --bind 127.0.0.1 --save "" --appendonly no --logfile "" >/dev/null &
pids+=($!)
target/release/tessera serve --port 7612 --dir "$data/tessera" --log warn --threads 1 &
pids+=($!)
for port in "${ports[@]}"; do
    for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
done

bench() {
    target/release/tessera bench --target "127.0.0.1:$1" --threads 1 --quiet --connections 50 \
        --records "$records" --operations "$operations" "${@:2}"
}
servers=(redis tessera)
for server in "${servers[@]}"; do
    bench "${ports[$server]}" --workload A --phase load --json "$out/$server-load.json" >/dev/null
done
for round in $(seq "$rounds"); do
    order=("${servers[@]:$((round % 2))}" "${servers[@]:0:$((round % 2))}")
    for pipeline in 1 16; do
        for workload in A B C F; do
            for server in "${order[@]}"; do
                bench "${ports[$server]}" --workload "$workload" --phase run --pipeline "$pipeline" \
                    --json "$out/$server-$workload-P$pipeline-$round.json" >/dev/null
            done
        done
    done
done

python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def median(server, run, pick):
    return statistics.median(pick(json.load(open(f"{out}/{server}-{run}-{r}.json"))) for r in range(1, rounds + 1))
print("| workload | pipeline | Redis ops/s | Tessera ops/s | Tessera/Redis | read p99 µs Redis / Tessera |")
print("|---|---|---|---|---|---|")
for pipeline in (1, 16):
    for workload in "ABCF":
        run = f"{workload}-P{pipeline}"
        ops = {s: median(s, run, lambda r: r["throughput_ops_per_s"]) for s in ("redis", "tessera")}
        p99 = {s: median(s, run, lambda r: r["latency"]["read"]["p99_us"]) for s in ("redis", "tessera")}
        print(f"| {workload} | {pipeline} | {ops['redis']:,.0f} | {ops['tessera']:,.0f} "
              f"| {ops['tessera'] / ops['redis']:.2f}x | {p99['redis']:.0f} / {p99['tessera']:.0f} |")
PY
