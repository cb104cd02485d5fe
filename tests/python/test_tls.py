"""TLS on a node's client port, with certificates from `tessera tls-certs`,
through redis-py (`ssl=True`) and redis-cli (`--tls`)."""

import subprocess
from pathlib import Path

import pytest
import redis

from conftest import BINARY, Node, free_port


@pytest.fixture
def certs(data_dir):
    directory = Path(data_dir) / "certs"
    subprocess.run([str(BINARY), "tls-certs", "--dir", str(directory)], check=True)
    return directory


def tls_node(data_dir, certs, *extra):
    tls_port = free_port()
    node = Node(
        data_dir, "--tls-port", str(tls_port), "--tls-cert-file", str(certs / "server.crt"),
        "--tls-key-file", str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.crt"), *extra,
    ).start()
    return node, tls_port


def tls_client(port, certs, with_certificate=True, ca=None):
    extra = {"ssl_certfile": str(certs / "client.crt"), "ssl_keyfile": str(certs / "client.key")}
    return redis.Redis(
        port=port, ssl=True, ssl_ca_certs=str(ca or certs / "ca.crt"), socket_timeout=10,
        **(extra if with_certificate else {}),
    )


def test_redis_py_and_redis_cli_speak_tls_to_the_tls_port(data_dir, certs):
    node, tls_port = tls_node(data_dir, certs)
    try:
        client = tls_client(tls_port, certs)
        assert client.set("k", "v") and client.get("k") == b"v"
        large = bytes(range(256)) * (40 << 10)  # 10 MiB, every byte value
        assert client.set("large", large) and client.get("large") == large
        pipe = client.pipeline(transaction=False)
        for index in range(1000):
            pipe.incr("counter")
        assert pipe.execute()[-1] == 1000
        # The plain port serves the same data.
        assert node.client().get("k") == b"v"
        cli = ["redis-cli", "-p", str(tls_port), "--tls", "--cacert", str(certs / "ca.crt"),
               "--cert", str(certs / "client.crt"), "--key", str(certs / "client.key")]
        assert subprocess.run(cli + ["set", "from-cli", "yes"], capture_output=True, text=True).stdout == "OK\n"
        assert subprocess.run(cli + ["get", "k"], capture_output=True, text=True).stdout == "v\n"
        # Without a client certificate, or trusting another CA, there is no session.
        with pytest.raises(redis.ConnectionError):
            tls_client(tls_port, certs, with_certificate=False).ping()
        other = Path(data_dir) / "other"
        subprocess.run([str(BINARY), "tls-certs", "--dir", str(other)], check=True)
        with pytest.raises(redis.ConnectionError):
            tls_client(tls_port, certs, ca=other / "ca.crt").ping()
        with pytest.raises(redis.ConnectionError):
            tls_client(tls_port, other).ping()
        # Plain RESP on the TLS port is not a handshake: closed.
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=tls_port, socket_timeout=5).ping()
        assert client.get("from-cli") == b"yes"
    finally:
        node.stop()
    assert node.process.returncode == 0, node.read_log()


def test_optional_client_certificates_and_a_bad_setting_refused_at_start(data_dir, certs):
    node, tls_port = tls_node(data_dir, certs, "--tls-auth-clients", "optional")
    try:
        assert tls_client(tls_port, certs, with_certificate=False).ping()
        assert tls_client(tls_port, certs).ping()
    finally:
        node.stop()
    missing = subprocess.run(
        [str(BINARY), "serve", "--port", str(free_port()), "--dir", data_dir, "--tls-port", str(free_port()),
         "--tls-cert-file", str(certs / "server.crt")],
        capture_output=True, text=True, timeout=30,
    )
    assert missing.returncode != 0 and "tls_key_file" in missing.stderr, missing.stderr
    (certs / "broken.crt").write_text("not a certificate\n")
    broken = subprocess.run(
        [str(BINARY), "serve", "--port", str(free_port()), "--dir", data_dir, "--tls-port", str(free_port()),
         "--tls-cert-file", str(certs / "broken.crt"), "--tls-key-file", str(certs / "server.key"),
         "--tls-auth-clients", "no"],
        capture_output=True, text=True, timeout=30,
    )
    assert broken.returncode != 0 and "broken.crt" in broken.stderr, broken.stderr
