"""Users and ACLs, side by side with a real redis-server: the same ACL
commands and the same requests as the same users get the same answers."""

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from conftest import Node


def outcome(call):
    """A reply, or the error's text: what is compared between the servers."""
    try:
        return call()
    except redis.RedisError as error:
        return f"{type(error).__name__}: {error}"


@pytest.fixture
def servers(data_dir, redis_server):
    node = Node(data_dir).start()
    yield {"tessera": node, "redis": redis_server}
    node.stop()


def connect(server, **kwargs):
    port = server.port if isinstance(server, Node) else server
    # No retries: a refused AUTH is an answer here, not a reason to reconnect.
    return redis.Redis(port=port, socket_timeout=10, protocol=2, retry=Retry(NoBackoff(), 0), **kwargs)


def test_acl_users_match_redis(servers):
    answers = {}
    for name, server in servers.items():
        admin = connect(server)
        seen = answers[name] = []
        seen.append(outcome(lambda: admin.execute_command(
            "ACL", "SETUSER", "alice", "on", ">pw", "~cache:*", "%R~shared:*", "+@read", "+set", "-keys")))
        seen.append(outcome(lambda: admin.execute_command("ACL", "SETUSER", "bob", "+nosuchcommand")))
        seen.append(outcome(lambda: admin.execute_command("ACL", "SETUSER", "bob", "%X~k")))
        seen.append(sorted(admin.execute_command("ACL", "USERS")))
        user = admin.execute_command("ACL", "GETUSER", "alice")
        fields = dict(zip(user[::2], user[1::2]))
        # Redis orders single commands' rules by its command table's hash order.
        commands = fields[b"commands"].split()
        seen.append([fields[b"flags"], fields[b"passwords"], commands[:2], sorted(commands[2:]), fields[b"keys"]])
        seen.append(admin.execute_command("ACL", "WHOAMI"))
        categories = set(admin.execute_command("ACL", "CAT"))
        assert {b"read", b"write", b"string", b"hash", b"keyspace", b"admin", b"dangerous", b"fast", b"slow",
                b"connection", b"sortedset"} <= categories, categories
        seen.append(b"get" in admin.execute_command("ACL", "CAT", "read"))
        seen.append(b"set" in admin.execute_command("ACL", "CAT", "read"))

        alice = connect(server, username="alice", password="pw")
        for call in (
            lambda: alice.get("cache:1"),
            lambda: alice.set("cache:1", "v"),
            lambda: alice.get("cache:1"),
            lambda: alice.set("other", "v"),
            lambda: alice.get("shared:x"),
            lambda: alice.set("shared:x", "v"),
            lambda: alice.delete("cache:1"),
            lambda: alice.keys("*"),
            lambda: alice.hget("cache:1", "f"),
            lambda: alice.mget("cache:1", "shared:y"),
            lambda: alice.mget("cache:1", "elsewhere"),
            lambda: alice.execute_command("GET"),
            lambda: alice.execute_command("MGET"),
            lambda: alice.execute_command("AUTH", "alice", "wrong"),
            lambda: alice.execute_command("AUTH", "nobody", "pw"),
            lambda: alice.execute_command("AUTH", "alice", "pw"),
        ):
            seen.append(outcome(call))
        # Switched off: no new session, the open one goes on.
        admin.execute_command("ACL", "SETUSER", "alice", "off")
        seen.append(outcome(lambda: connect(server, username="alice", password="pw").ping()))
        seen.append(outcome(lambda: alice.get("cache:1")))
        seen.append(admin.execute_command("ACL", "DELUSER", "alice", "nobody"))
        with pytest.raises(redis.RedisError):
            alice.get("cache:1")
        seen.append(outcome(lambda: admin.execute_command("ACL", "DELUSER", "default")))
    assert answers["tessera"] == answers["redis"]


def test_users_survive_a_restart_and_the_password_is_the_default_users(data_dir):
    node = Node(data_dir, "--password", "admin-pw").start()
    try:
        with pytest.raises(redis.AuthenticationError):
            connect(node).ping()
        admin = connect(node, password="admin-pw")
        assert admin.execute_command("ACL", "WHOAMI") == b"default"
        admin.execute_command("ACL", "SETUSER", "reader", "on", ">r", "~*", "+@read")
        listed = admin.execute_command("ACL", "LIST")
        assert all(b">" not in line and b"admin-pw" not in line and b" r " not in line for line in listed), listed
    finally:
        node.stop()
    node.start()
    try:
        reader = connect(node, username="reader", password="r")
        assert reader.get("k") is None
        with pytest.raises(redis.exceptions.NoPermissionError):
            reader.set("k", "v")
        assert connect(node, password="admin-pw").set("k", "v")
    finally:
        node.stop()
