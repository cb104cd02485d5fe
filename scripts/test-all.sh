#!/usr/bin/env bash
# Installs what the tests need (redis-server, redis-cli, etcd, Prometheus and
# redis_exporter, Chromium and chromedriver, go-ycsb, cargo-deb; Node.js, a JDK
# and Maven where missing, and the client libraries the tests prove, from their
# registries; redis-py, Selenium, pytest, mypy and Tessera's Python client, from
# its wheel, in a virtual environment under target/) and runs every check:
# formatting, lints, unit and property tests, the engine conformance suite, the
# Debian package, the deployment files (Kubernetes, compose), and integration
# tests with real clients and a real browser against the real binary. CI runs
# exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v redis-cli >/dev/null || missing+=(redis-tools)
command -v go >/dev/null || missing+=(golang-go)
command -v etcd >/dev/null || missing+=(etcd-server)
command -v prometheus >/dev/null || missing+=(prometheus)
command -v prometheus-redis-exporter >/dev/null || missing+=(prometheus-redis-exporter)
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then
    echo "== installing ${missing[*]}"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
fi
echo "== installing Python test clients (in a virtual environment)"
VENV="$PWD/target/test-venv"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" || {
        as_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq python3-venv >/dev/null
        python3 -m venv "$VENV"
    }
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r tests/python/requirements.txt
echo "== the Python client (clients/python): type-checked, built as a wheel and installed from it"
(cd clients/python && "$VENV/bin/python" -m mypy src)
rm -rf target/wheels
"$VENV/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w target/wheels clients/python
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps target/wheels/tessera-*.whl

echo "== building go-ycsb from the Go module proxy"
scripts/build-go-ycsb.sh
echo "== building the client workloads: go-redis, ioredis, node-redis, Jedis, Lettuce, redis-rs"
scripts/build-client-workloads.sh
export GO_YCSB="$PWD/target/tools/go-ycsb"

# Tests that need an external program fail, rather than skip, when it is missing.
export TESSERA_REQUIRE_EXTERNAL=1

echo "== cargo fmt"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --all-targets --release -- -D warnings
echo "== cargo test"
cargo test --release --workspace
echo "== the Debian package, installed with dpkg"
scripts/test-deb.sh
echo "== deployment files (Kubernetes manifests, compose file)"
(cd deploy/validate && go vet ./... && go test ./... && go run . ..)
echo "== redis-py integration tests"
TESSERA_BIN="$PWD/target/release/tessera" "$VENV/bin/python" -m pytest -q tests/python
