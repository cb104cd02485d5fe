#!/usr/bin/env bash
# Tessera (memory engine) against Redis, side by side in one run, both driven by
# Redis's own redis-benchmark:  -t $TESTS -n N -r 1000000 -c 50, at -P 1 and -P 16
# (TESTS: redis-benchmark's test names, set,get unless given).
# Each test runs on every server back to back, in an order that rotates; the
# report gives medians, and each Tessera/Redis ratio as the median of the
# rounds' ratios. It also gives each server's CPU time per request (user +
# system, from /proc, over one test's run): on a shared machine a neighbour's
# load moves requests per second far more than it moves the CPU a server spends
# on a request, and a saturated single-threaded server's throughput is one over
# that time. Usage: scripts/bench-vs-redis.sh [ROUNDS] [REQUESTS]
# TLS=1 runs every server on a TLS port only (certificates from `tessera
# tls-certs`, client certificates required) and redis-benchmark with --tls.
# ENGINES="memory hybrid" runs a pair of Tessera servers per engine (hybrid
# with memory-bytes 2gb, so that the data set stays in memory).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
requests=${2:-1000000}
out=${BENCH_OUT:-bench-results}
mkdir -p "$out"
tls=${TLS:-0}
tests=${TESTS:-set,get}
engines=${ENGINES:-memory}
# Prints $3 when $1 differs from $2 (and succeeds either way, as `set -e` needs).
unless_equal() { if [ "$1" != "$2" ]; then echo "$3"; fi; }
results="$out/vs-redis$(unless_equal "$tls" 0 -tls)$(unless_equal "$tests" set,get -many)$(unless_equal "$engines" memory -engines).csv"

command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null || {
    echo "needs redis-server and redis-benchmark (apt-get install redis-server redis-tools)" >&2
    exit 1
}
cargo build --release -q

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

data=$(mktemp -d)
# Clients speak to each server's `port`; with TLS that is its TLS port.
client_tls=()
redis_tls=()
tessera_tls=()
if [ "$tls" = 1 ]; then
    target/release/tessera tls-certs --dir "$data/certs"
    client_tls=(--tls --cacert "$data/certs/ca.crt" --cert "$data/certs/client.crt" --key "$data/certs/client.key")
    files=(--tls-cert-file "$data/certs/server.crt" --tls-key-file "$data/certs/server.key"
        --tls-ca-cert-file "$data/certs/ca.crt")
    redis_tls=(--port 0 --tls-port 7611 "${files[@]}")
    tessera_tls=("${files[@]}")
fi
plain_or_tls() { if [ "$tls" = 1 ]; then echo "$2"; else echo "$1"; fi; }

redis_port=$(plain_or_tls 7601 7611)
declare -A server_pids
redis-server --port 7601 "${redis_tls[@]}" --bind 127.0.0.1 --save "" --appendonly no --logfile "" >/dev/null &
pids+=($!)
server_pids[redis]=$!
# Two Tessera configurations per engine: one worker per core (the default), and
# one worker, which leaves the second core to redis-benchmark as Redis's single
# thread does. The memory engine's servers are "tessera" and "tessera-1thread";
# another engine's carry its name ("tessera-hybrid", "tessera-hybrid-1thread").
declare -A ports=([redis]=$redis_port)
servers=(redis)
tls_port() { if [ "$tls" = 1 ]; then echo --tls-port "$1" "${tessera_tls[@]}"; fi; }
port=7602
for engine in $engines; do
    name=tessera$(unless_equal "$engine" memory "-$engine")
    engine_args=(--engine "$engine")
    if [ "$engine" = hybrid ]; then
        engine_args+=(--engine-option memory-bytes=2gb --engine-option fsync=everysec)
    fi
    for threads in 2 1; do
        server=$name$(unless_equal "$threads" 2 -1thread)
        # shellcheck disable=SC2046
        target/release/tessera serve --port "$port" $(tls_port $((port + 10))) --dir "$data/$server" --log warn \
            --threads "$threads" "${engine_args[@]}" &
        pids+=($!)
        server_pids[$server]=$!
        ports[$server]=$(plain_or_tls "$port" $((port + 10)))
        servers+=("$server")
        port=$((port + 1))
    done
done
for port in "${ports[@]}"; do
    for _ in $(seq 100); do redis-cli -p "$port" "${client_tls[@]}" ping >/dev/null 2>&1 && break; sleep 0.1; done
done

# A process's CPU time so far, in clock ticks (user + system).
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
ticks_per_second=$(getconf CLK_TCK)

echo "round,pipeline,server,test,rps,cpu_us_per_request" >"$results"
# Runs one redis-benchmark test against one server and records its result.
run_test() {
    local round=$1 pipeline=$2 server=$3 test=$4
    before=$(cpu_ticks "${server_pids[$server]}")
    lines=$(redis-benchmark -p "${ports[$server]}" "${client_tls[@]}" -t "$test" -n "$requests" -r 1000000 -c 50 -P "$pipeline" --csv -q 2>/dev/null |
        grep -v '^"test"' | tr -d '"')
    after=$(cpu_ticks "${server_pids[$server]}")
    # A test that prints two results (LRANGE fills its list first) has no CPU time of its own.
    cpu=""
    if [ "$(echo "$lines" | wc -l)" = 1 ]; then
        cpu=$(awk -v t=$((after - before)) -v hz="$ticks_per_second" -v n="$requests" 'BEGIN {printf "%.3f", t * 1e6 / hz / n}')
    fi
    echo "$lines" | awk -F, -v r="$round" -v p="$pipeline" -v s="$server" -v c="$cpu" '{print r "," p "," s "," $1 "," $2 "," c}' >>"$results"
}
for round in $(seq "$rounds"); do
    for pipeline in 1 16; do
        for server in "${servers[@]}"; do
            redis-cli -p "${ports[$server]}" "${client_tls[@]}" flushall >/dev/null
        done
        # Each test runs on every server back to back, so that a neighbour's
        # load, which comes and goes over seconds, falls on all of them alike;
        # the order rotates from test to test and round to round so that no
        # server always runs first.
        turn=$round
        for test in ${tests//,/ }; do
            shift_by=$((turn % ${#servers[@]}))
            for server in "${servers[@]:$shift_by}" "${servers[@]:0:$shift_by}"; do
                run_test "$round" "$pipeline" "$server" "$test"
            done
            turn=$((turn + 1))
        done
        echo "round $round, -P $pipeline done" >&2
    done
done

python3 - "$results" $engines <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
engines = sys.argv[2:]
def values(pipeline, server, test, column):
    return {r["round"]: float(r[column]) for r in rows
            if (r["pipeline"], r["server"], r["test"]) == (pipeline, server, test) and r[column]}
def median(pipeline, server, test, column):
    found = values(pipeline, server, test, column)
    return statistics.median(found.values()) if found else None
# The ratio of two servers is the median of each round's ratio: the two ran
# one after the other, under the same load.
def paired_ratio(pipeline, server, against, test, column, higher_is_better=True):
    ours, theirs = values(pipeline, server, test, column), values(pipeline, against, test, column)
    ratios = [ours[r] / theirs[r] if higher_is_better else theirs[r] / ours[r]
              for r in ours if r in theirs and ours[r] and theirs[r]]
    return statistics.median(ratios) if ratios else None
tests = list(dict.fromkeys(r["test"] for r in rows))  # in redis-benchmark's order
for engine in engines:
    name = "tessera" if engine == "memory" else f"tessera-{engine}"
    single = f"{name}-1thread"
    print(f"\nEngine {engine} (ratios: the median of each round's ratio):\n")
    print("| pipeline | test | Redis ops/s | Tessera ops/s | ratio | Tessera 1 thread ops/s | ratio | CPU µs/request: Redis | Tessera 1 thread | Redis / Tessera |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for pipeline in ("1", "16"):
        for test in tests:
            redis, tessera, alone = (median(pipeline, server, test, "rps") for server in ("redis", name, single))
            ratio, single_ratio = (paired_ratio(pipeline, server, "redis", test, "rps") for server in (name, single))
            redis_cpu, single_cpu = (median(pipeline, server, test, "cpu_us_per_request") for server in ("redis", single))
            cpu_ratio = paired_ratio(pipeline, single, "redis", test, "cpu_us_per_request", higher_is_better=False)
            cpu = f"{redis_cpu:.2f} | {single_cpu:.2f} | {cpu_ratio:.2f}x" if redis_cpu and single_cpu and cpu_ratio else "– | – | –"
            print(f"| -P {pipeline} | {test} | {redis:,.0f} | {tessera:,.0f} | {ratio:.2f}x | {alone:,.0f} | {single_ratio:.2f}x | {cpu} |")
PY
