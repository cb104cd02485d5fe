#!/usr/bin/env bash
# The four replication modes side by side on one cluster size: 6 nodes, 3
# replicas per shard, the memory engine, YCSB A (50% updates) and B (5%
# updates) with zipfian keys, hash records of 10 x 100 bytes, measured with
# `tessera bench` in two routings:
#   cluster  a Redis Cluster client: every request to its shard's first member
#   spread   plain connections to all six nodes, keys sharded over them by the
#            client: a node serves what it may (in active–active modes, any
#            member) and forwards the rest to a node that may
#
#   scripts/bench-modes.sh [records=20000] [seconds=8] [connections=16] [repeats=3]
#   BASELINE=/path/to/an/older/tessera scripts/bench-modes.sh ...
#
# Prints one line per run, then the medians and the ratios BespoKV (Anwar et al., SC 2018) reports
# (MS+SC / AA+SC on both workloads; AA+EC / MS+EC on A). With BASELINE, every
# repeat also runs that binary, interleaved with this build (the machine's
# noise falls on both alike), and the ratios of this build to it are printed.
# Leaves the reports in the work directory it names.
set -euo pipefail
cd "$(dirname "$0")/.."
RECORDS=${1:-20000}
SECONDS_PER_RUN=${2:-8}
CONNECTIONS=${3:-16}
REPEATS=${4:-3}
# Peers listen on port + 10000: keep them below the ephemeral range (32768+).
BASE_PORT=20000

cargo build --release -q -p tessera-cli
TESSERA="$PWD/target/release/tessera"
WORK=$(mktemp -d /tmp/tessera-modes.XXXXXX)
echo "work directory: $WORK"
cleanup() { "$TESSERA" cluster down --dir "$WORK/cluster" >/dev/null 2>&1 || true; }
trap cleanup EXIT

ALL_NODES=$(for i in 1 2 3 4 5 6; do printf '127.0.0.1:%d,' $((BASE_PORT + i)); done)
ALL_NODES=${ALL_NODES%,}
FIRST_NODE="127.0.0.1:$((BASE_PORT + 1))"
RESULTS="$WORK/results.txt"
: >"$RESULTS"

BUILDS=("current:$TESSERA")
if [ -n "${BASELINE:-}" ]; then
    BUILDS+=("baseline:$BASELINE")
fi

for mode in "ms strong ms+sc" "ms eventual ms+ec" "aa strong aa+sc" "aa eventual aa+ec"; do
    read -r topology consistency name <<<"$mode"
    for repeat in $(seq "$REPEATS"); do
      for build in "${BUILDS[@]}"; do
        label=${build%%:*}
        binary=${build#*:}
        cleanup
        rm -rf "$WORK/cluster"
        "$binary" cluster up --dir "$WORK/cluster" --nodes 6 --groups 6 --replicas 3 --topology "$topology" \
            --consistency "$consistency" --base-port "$BASE_PORT" --no-demo >/dev/null
        "$TESSERA" bench --target "$FIRST_NODE" --cluster --phase load --records "$RECORDS" \
            --connections "$CONNECTIONS" --threads 1 --quiet >/dev/null
        for workload in A B; do
            for routing in cluster spread; do
                if [ "$routing" = cluster ]; then
                    route=(--target "$FIRST_NODE" --cluster)
                else
                    route=(--target "$ALL_NODES")
                fi
                report="$WORK/$label-$name-$workload-$routing-$repeat.json"
                "$TESSERA" bench "${route[@]}" --phase run --workload "$workload" --distribution zipfian \
                    --records "$RECORDS" --duration "$SECONDS_PER_RUN" --connections "$CONNECTIONS" \
                    --threads 1 --quiet --json "$report" >/dev/null
                python3 - "$report" "$label" "$name" "$workload" "$routing" >>"$RESULTS" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
errors = sum(report["errors"].values())
print(f"{sys.argv[2]} {sys.argv[3]} {sys.argv[4]} {sys.argv[5]} {report['throughput_ops_per_s']:.0f} {errors}")
EOF
                tail -1 "$RESULTS"
            done
        done
      done
    done
done

python3 - "$RESULTS" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    build, mode, workload, routing, ops, errors = line.split()
    runs.setdefault((build, mode, workload, routing), []).append((float(ops), int(errors)))
median = {key: statistics.median(ops for ops, _ in values) for key, values in runs.items()}
builds = sorted({key[0] for key in runs}, key=lambda build: build != "current")
modes = ["ms+sc", "ms+ec", "aa+sc", "aa+ec"]
for build in builds:
    print(f"\n{build}: medians (ops/s; errors summed over repeats)")
    print(f"{'mode':<7} {'workload':<9} {'cluster':>9} {'spread':>9}")
    for mode in modes:
        for workload in ["A", "B"]:
            cells = []
            for routing in ["cluster", "spread"]:
                errors = sum(e for _, e in runs[(build, mode, workload, routing)])
                cells.append(f"{median[(build, mode, workload, routing)]:>9.0f}" + (f" ({errors} errors)" if errors else ""))
            print(f"{mode:<7} {workload:<9} " + " ".join(cells))
    print(f"\n{build}: ratios (as BespoKV reports them)")
    for routing in ["cluster", "spread"]:
        for workload in ["A", "B"]:
            ratio = median[(build, "ms+sc", workload, routing)] / median[(build, "aa+sc", workload, routing)]
            print(f"MS+SC / AA+SC, workload {workload}, {routing}: {ratio:.2f}x")
        ratio = median[(build, "aa+ec", "A", routing)] / median[(build, "ms+ec", "A", routing)]
        print(f"AA+EC / MS+EC, workload A, {routing}: {ratio:.2f}x")
if "baseline" in builds:
    print("\ncurrent / baseline (medians)")
    print(f"{'mode':<7} {'workload':<9} {'cluster':>9} {'spread':>9}")
    for mode in modes:
        for workload in ["A", "B"]:
            cells = [
                f"{median[('current', mode, workload, routing)] / median[('baseline', mode, workload, routing)]:>8.2f}x"
                for routing in ["cluster", "spread"]
            ]
            print(f"{mode:<7} {workload:<9} " + " ".join(cells))
EOF
