#!/usr/bin/env bash
# Builds the Debian package (cargo-deb) from the release binary, installs it
# with dpkg on this machine, and checks what it installed: the binary, the
# `tessera` user, the config and the systemd units; then runs the installed
# node as that user with the packaged config, writes, restarts it and reads
# the write back; and purges the package. Needs root (or sudo) and a built
# target/release/tessera. test-all.sh runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
fail() { echo "test-deb: $*" >&2; exit 1; }

command -v cargo-deb >/dev/null || cargo install cargo-deb --version 3.8.0 --locked --quiet
[ -x target/release/tessera ] || fail "build the release binary first"
rm -rf target/debian
cargo deb -p tessera-cli --no-build --strip --quiet >/dev/null
package=$(ls target/debian/tessera_*.deb)

# A package left by an earlier run would hide what this one installs.
as_root dpkg --purge tessera >/dev/null 2>&1 || true
as_root rm -rf /var/lib/tessera
as_root dpkg -i "$package" >/dev/null

installed_version=$(/usr/bin/tessera --version)
expected_version=$(target/release/tessera --version)
[ "$installed_version" = "$expected_version" ] || fail "installed $installed_version, built $expected_version"
getent passwd tessera >/dev/null || fail "no tessera user"
[ "$(stat -c %U /var/lib/tessera)" = tessera ] || fail "/var/lib/tessera is not the tessera user's"
for file in /etc/tessera/tessera.toml /etc/default/tessera-coordinator \
    /lib/systemd/system/tessera.service /lib/systemd/system/tessera-coordinator.service; do
    [ -f "$file" ] || fail "$file was not installed"
done
grep -q '^ExecStart=/usr/bin/tessera serve --config /etc/tessera/tessera.toml$' /lib/systemd/system/tessera.service \
    || fail "the node's unit does not run the packaged config"
# The units as systemd reads them: an unknown key, a bad value or a command
# that is not there is a failure. (A machine without systemd running lacks
# its own targets; only that is let pass.)
if command -v systemd-analyze >/dev/null; then
    problems=$(systemd-analyze verify /lib/systemd/system/tessera.service \
        /lib/systemd/system/tessera-coordinator.service 2>&1 | grep -v 'sysinit.target not found' || true)
    [ -z "$problems" ] || fail "systemd-analyze verify: $problems"
else
    echo "test-deb: systemd-analyze is not installed; the units' syntax is not checked"
fi

# The installed node, as systemd would run it (this machine may have no
# systemd): the packaged config, as user tessera, on a free port.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp)
start_node() {
    as_root runuser -u tessera -- /usr/bin/tessera serve --config /etc/tessera/tessera.toml --port "$port" \
        >>"$log" 2>&1 &
    node_pid=$!
    for _ in $(seq 100); do
        [ "$(redis-cli -p "$port" ping 2>/dev/null)" = PONG ] && return 0
        sleep 0.1
    done
    cat "$log" >&2
    fail "the installed node did not answer PING"
}
stop_node() {
    as_root pkill -TERM -f "tessera serve --config /etc/tessera/tessera.toml --port $port" || true
    wait "$node_pid" || true
}
start_node
[ "$(redis-cli -p "$port" set packaged yes)" = OK ] || fail "SET failed"
stop_node
start_node
[ "$(redis-cli -p "$port" get packaged)" = yes ] || fail "the write did not survive a restart (engine log in /var/lib/tessera)"
stop_node
as_root find /var/lib/tessera -mindepth 1 -not -user tessera | grep -q . && fail "files in /var/lib/tessera not owned by tessera"

as_root dpkg --purge tessera >/dev/null
[ ! -e /usr/bin/tessera ] || fail "purge left /usr/bin/tessera"
as_root rm -rf /var/lib/tessera
rm -f "$log"
echo "test-deb: $(basename "$package") installs, runs as tessera, keeps data across a restart, and purges"
