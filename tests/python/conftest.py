"""Starts real `tessera serve` processes for the redis-py tests."""

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parents[2]
BINARY = Path(os.environ.get("TESSERA_BIN", ROOT / "target" / "release" / "tessera"))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Node:
    """One tessera node process on a free loopback port."""

    def __init__(self, data_dir, *args):
        self.data_dir = data_dir
        self.args = list(args)
        self.port = free_port()
        self.process = None

    def start(self):
        assert BINARY.exists(), f"build the binary first: {BINARY}"
        self.log = open(Path(self.data_dir) / f"node-{self.port}.log", "ab")
        self.process = subprocess.Popen(
            [str(BINARY), "serve", "--port", str(self.port), "--dir", str(self.data_dir), *self.args],
            stdout=self.log,
            stderr=self.log,
        )
        deadline = time.time() + 15
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tessera exited with {self.process.returncode}: {self.read_log()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("tessera did not start listening")

    def read_log(self):
        return (Path(self.data_dir) / f"node-{self.port}.log").read_text(errors="replace")

    def stop(self, sig=signal.SIGTERM):
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=30)
        return self.process.returncode

    def client(self, **kwargs):
        kwargs.setdefault("protocol", 2)
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=30, **kwargs)


def wait_for_ping(port, timeout=10):
    """Until a server on `port` answers PING."""
    deadline = time.time() + timeout
    while True:
        try:
            redis.Redis(port=port).ping()
            return
        except redis.ConnectionError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def redis_server(data_dir):
    """A real redis-server, for the `redis` engine."""
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", data_dir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "LC_ALL": "C"},  # SORT ... ALPHA collates bytes, as Tessera does
    )
    wait_for_ping(port)
    yield port
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def data_dir():
    with tempfile.TemporaryDirectory() as path:
        yield path


@pytest.fixture
def node(data_dir):
    node = Node(data_dir).start()
    yield node
    node.stop()
    assert node.process.returncode == 0, node.read_log()


@pytest.fixture
def r(node):
    client = node.client()
    yield client
    client.close()


def evict_from_page_cache(directory):
    """Drops the hybrid logs' pages under `directory` from the OS's cache:
    reading them then waits for the disk."""
    for path in Path(directory).rglob("hybrid-*.log"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def table_info(client, name):
    """TABLE.INFO of table `name` as a dict (bytes keys), over RESP2 or RESP3."""
    reply = client.execute_command("TABLE.INFO", name)
    return reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2]))


def resp_command(*args):
    """A command as a client writes it: a RESP array of bulk strings (each
    argument bytes or str)."""
    encoded = [arg.encode() if isinstance(arg, str) else arg for arg in args]
    return b"*%d\r\n" % len(encoded) + b"".join(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in encoded)


def send_in_pieces(sock, payload, rng, sizes, pause_chance):
    """Sends `payload` in pieces of sizes drawn from `sizes`, splitting frames
    anywhere, now and then pausing so that the server reads a piece alone."""
    at = 0
    while at < len(payload):
        size = rng.choice(sizes)
        sock.sendall(payload[at:at + size])
        at += size
        if rng.random() < pause_chance:
            time.sleep(0.002)
