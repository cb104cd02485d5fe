#!/usr/bin/env bash
# Builds the client workload of tests/clients in every client library the
# tests prove (go-redis v9 from the Go module proxy; ioredis and node-redis
# from npm; Jedis and Lettuce from Maven Central; redis-rs from crates.io)
# into target/clients, installing Node.js, npm, a JDK and Maven with apt-get
# where they are missing. tests/python/test_client_libraries.py runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
command -v javac >/dev/null || missing+=(default-jdk-headless)
command -v mvn >/dev/null || missing+=(maven)
if [ ${#missing[@]} -gt 0 ]; then
    echo "== installing ${missing[*]}"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
fi

OUT="$PWD/target/clients"
mkdir -p "$OUT"
(cd tests/clients/go && go build -o "$OUT/go-redis-workload" .)
(cd tests/clients/node && npm ci --no-audit --no-fund --loglevel=error)
(cd tests/clients/java && mvn -q -B compile dependency:build-classpath -Dmdep.outputFile="$OUT/java-classpath.txt")
(cd tests/clients/rust && CARGO_TARGET_DIR="$PWD/../../../target/clients-rust" cargo build -q --release --locked)
cp target/clients-rust/release/redis-rs-workload "$OUT/"
