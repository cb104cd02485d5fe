#!/usr/bin/env bash
# Builds go-ycsb (PingCAP's Go port of YCSB) from the Go module proxy into
# target/tools/go-ycsb, for the test that drives Tessera with it. The module is
# built inside its own source tree because its go.mod has replace directives,
# which `go install module@version` refuses.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=v1.0.1
OUT="$PWD/target/tools"
if [ -x "$OUT/go-ycsb" ] && [ "$(cat "$OUT/go-ycsb.version" 2>/dev/null)" = "$VERSION" ]; then
    exit 0
fi
mkdir -p "$OUT"
module_dir=$(cd "$OUT" && GOFLAGS=-mod=mod go mod download -json "github.com/pingcap/go-ycsb@$VERSION" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
rm -rf "$OUT/go-ycsb-src"
cp -r "$module_dir" "$OUT/go-ycsb-src"
chmod -R u+w "$OUT/go-ycsb-src"
(cd "$OUT/go-ycsb-src" && go build -o "$OUT/go-ycsb" ./cmd/go-ycsb)
echo "$VERSION" > "$OUT/go-ycsb.version"
