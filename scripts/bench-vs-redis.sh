#!/usr/bin/env bash
# Tessera (memory engine) against Redis, side by side in one run, both driven by
# Redis's own redis-benchmark:  -t $TESTS -n N -r 1000000 -c 50, at -P 1 and -P 16
# (TESTS: redis-benchmark's test names, set,get unless given).
# Rounds alternate the order of the servers; the report gives medians and the
# Tessera/Redis ratio. Usage: scripts/bench-vs-redis.sh [ROUNDS] [REQUESTS]
# TLS=1 runs every server on a TLS port only (certificates from `tessera
# tls-certs`, client certificates required) and redis-benchmark with --tls.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
requests=${2:-1000000}
out=${BENCH_OUT:-bench-results}
mkdir -p "$out"
tls=${TLS:-0}
tests=${TESTS:-set,get}
results="$out/vs-redis$([ "$tls" = 1 ] && echo -tls)$([ "$tests" != set,get ] && echo -many).csv"

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
redis-server --port 7601 "${redis_tls[@]}" --bind 127.0.0.1 --save "" --appendonly no --logfile "" >/dev/null &
pids+=($!)
# Two Tessera configurations: one worker per core (the default), and one worker,
# which leaves the second core to redis-benchmark as Redis's single thread does.
declare -A ports=([redis]=$redis_port [tessera]=$(plain_or_tls 7602 7612) [tessera-1thread]=$(plain_or_tls 7603 7613))
tls_port() { if [ "$tls" = 1 ]; then echo --tls-port "$1" "${tessera_tls[@]}"; fi; }
# shellcheck disable=SC2046
target/release/tessera serve --port 7602 $(tls_port 7612) --dir "$data/a" --log warn &
pids+=($!)
# shellcheck disable=SC2046
target/release/tessera serve --port 7603 $(tls_port 7613) --dir "$data/b" --log warn --threads 1 &
pids+=($!)
for port in "${ports[@]}"; do
    for _ in $(seq 100); do redis-cli -p "$port" "${client_tls[@]}" ping >/dev/null 2>&1 && break; sleep 0.1; done
done

echo "round,pipeline,server,test,rps" >"$results"
servers=(redis tessera tessera-1thread)
for round in $(seq "$rounds"); do
    # Rotate the order so no server always runs first.
    order=("${servers[@]:$((round % 3))}" "${servers[@]:0:$((round % 3))}")
    for pipeline in 1 16; do
        for server in "${order[@]}"; do
            redis-cli -p "${ports[$server]}" "${client_tls[@]}" flushall >/dev/null
            redis-benchmark -p "${ports[$server]}" "${client_tls[@]}" -t "$tests" -n "$requests" -r 1000000 -c 50 -P "$pipeline" --csv -q 2>/dev/null |
                grep -v '^"test"' | tr -d '"' |
                awk -F, -v r="$round" -v p="$pipeline" -v s="$server" '{print r "," p "," s "," $1 "," $2}' >>"$results"
        done
        echo "round $round, -P $pipeline done" >&2
    done
done

python3 - "$results" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
median = {}
for key in {(r["pipeline"], r["server"], r["test"]) for r in rows}:
    median[key] = statistics.median(float(r["rps"]) for r in rows if (r["pipeline"], r["server"], r["test"]) == key)
print("| pipeline | test | Redis ops/s | Tessera ops/s | ratio | Tessera 1 thread ops/s | ratio |")
print("|---|---|---:|---:|---:|---:|---:|")
tests = list(dict.fromkeys(r["test"] for r in rows))  # in redis-benchmark's order
for pipeline in ("1", "16"):
    for test in tests:
        redis = median[(pipeline, "redis", test)]
        tessera = median[(pipeline, "tessera", test)]
        single = median[(pipeline, "tessera-1thread", test)]
        print(f"| -P {pipeline} | {test} | {redis:,.0f} | {tessera:,.0f} | {tessera / redis:.2f}x | {single:,.0f} | {single / redis:.2f}x |")
PY
