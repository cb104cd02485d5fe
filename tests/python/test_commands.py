"""The command list against a real node, through redis-py (RESP2 and RESP3)."""

import json
import random
import socket
import threading
import time

import pytest
import redis

from conftest import Node, resp_command, send_in_pieces


def test_strings(r):
    assert r.ping()
    assert r.echo("hi") == b"hi"
    assert r.set("k", "v")
    assert r.get("k") == b"v"
    assert r.get("missing") is None
    assert r.set("k", "w", nx=True) is None
    assert r.set("k", "w", xx=True)
    assert r.set("new", "x", xx=True) is None
    assert r.set("k", "z", get=True) == b"w"
    assert r.getset("k", "y") == b"z"
    assert r.setnx("k", "q") is False
    assert r.mset({"a": "1", "b": "2"})
    assert r.mget("a", "b", "nope") == [b"1", b"2", None]
    assert r.append("a", "23") == 3
    assert r.strlen("a") == 3
    assert r.getdel("a") == b"123"
    assert r.exists("a", "b", "b") == 2
    assert r.delete("b", "k", "missing") == 2
    assert r.set("", "empty key")
    assert r.get("") == b"empty key"
    binary = bytes(range(256))
    assert r.set(binary, binary)
    assert r.get(binary) == binary


def test_counters_are_atomic_under_concurrency(node):
    def work():
        client = node.client()
        for _ in range(500):
            client.incr("counter")
        client.close()

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    r = node.client()
    assert int(r.get("counter")) == 4000
    assert r.incrby("counter", -4000) == 0
    assert r.decr("counter") == -1
    assert r.decrby("counter", 9) == -10
    r.set("text", "abc")
    with pytest.raises(redis.ResponseError, match="not an integer"):
        r.incr("text")
    r.set("big", str(2**63 - 1))
    with pytest.raises(redis.ResponseError, match="overflow"):
        r.incr("big")


def test_a_read_of_several_keys_sees_all_of_a_transaction_or_none(node):
    """Transactions set two keys (and two set members) to one value while
    other clients read both with one command (MGET, SUNION): a read never
    sees one key changed and the other not, as in Redis, where commands run
    one at a time."""
    stop, torn = threading.Event(), []

    def write():
        client = node.client()
        for value in range(1, 100_000):
            if stop.is_set():
                break
            with client.pipeline(transaction=True) as pipe:
                # Commands between the two halves hold them apart in time.
                pipe.set("{t}a", value).append("{t}pad", "x" * 8).set("{t}b", value)
                for _ in range(100):
                    pipe.append("{t}pad", "x")
                pipe.delete("{t}s1", "{t}s2").sadd("{t}s1", value)
                for _ in range(100):
                    pipe.append("{t}pad", "x")
                pipe.sadd("{t}s2", value).delete("{t}pad")
                pipe.execute()

    def read():
        client = node.client()
        while not stop.is_set():
            a, _, b = client.mget("{t}a", "{t}pad", "{t}b")
            if a != b:
                torn.append((a, b))
            members = client.sunion("{t}s1", "{t}s2")
            if len(members) > 1:
                torn.append(members)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(4)
    stop.set()
    for thread in threads:
        thread.join()
    assert not torn, f"{len(torn)} reads saw half a transaction, first {torn[0]}"
    assert int(node.client().get("{t}a")) > 100


def test_expiry(r):
    assert r.set("e", "v", ex=100)
    assert 98 <= r.ttl("e") <= 100
    assert r.pttl("e") > 98000
    assert r.persist("e")
    assert r.ttl("e") == -1
    assert r.ttl("missing") == -2
    assert r.expire("e", 1)
    assert r.set("p", "v", px=50)
    assert r.incr("n") == 1 and r.expire("n", 100)
    assert r.incr("n") == 2 and r.ttl("n") > 0, "INCR keeps the TTL"
    time.sleep(1.2)
    assert r.get("e") is None
    assert r.get("p") is None
    assert r.exists("e") == 0
    with pytest.raises(redis.ResponseError, match="invalid expire"):
        r.set("bad", "v", ex=0)
    assert r.expire("n", 200, gt=True)
    assert not r.expire("n", 100, gt=True)
    assert r.set("k", "v", keepttl=True) and r.ttl("k") == -1


def test_hashes_and_wrongtype(r):
    assert r.hset("h", mapping={"f1": "v1", "f2": "v2"}) == 2
    assert r.hset("h", "f1", "v1b") == 0
    assert r.hsetnx("h", "f1", "x") == 0
    assert r.hsetnx("h", "f3", "v3") == 1
    assert r.hget("h", "f1") == b"v1b"
    assert r.hmget("h", "f1", "nope", "f3") == [b"v1b", None, b"v3"]
    assert r.hgetall("h") == {b"f1": b"v1b", b"f2": b"v2", b"f3": b"v3"}
    assert r.hlen("h") == 3
    assert r.hexists("h", "f2") and not r.hexists("h", "zz")
    assert r.hkeys("h") == [b"f1", b"f2", b"f3"]
    assert r.hvals("h") == [b"v1b", b"v2", b"v3"]
    assert r.hstrlen("h", "f1") == 3
    assert r.hincrby("h", "count", 5) == 5
    assert r.hincrby("h", "count", -2) == 3
    with pytest.raises(redis.ResponseError, match="hash value is not an integer"):
        r.hincrby("h", "f1", 1)
    assert r.execute_command("HMSET", "h", "f4", "v4")
    assert r.hdel("h", "f1", "f2", "nope") == 2
    assert r.type("h") == b"hash"
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        r.get("h")
    r.set("s", "v")
    assert r.type("s") == b"string"
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        r.hget("s", "f")
    assert r.mget("s", "h") == [b"v", None]
    assert r.hdel("h", "f3", "count", "f4") == 3
    assert r.exists("h") == 0, "an emptied hash is deleted"


def test_scan_keys_dbsize_flush(r):
    pipe = r.pipeline(transaction=False)
    for i in range(2500):
        pipe.set(f"user:{i}", i)
    for i in range(50):
        pipe.hset(f"hash:{i}", "f", i)
    pipe.execute()
    assert r.dbsize() == 2550
    seen = set(r.scan_iter(count=100))
    assert len(seen) == 2550
    assert set(r.scan_iter(match="hash:*")) == {f"hash:{i}".encode() for i in range(50)}
    assert len(list(r.scan_iter(_type="HASH"))) == 50
    assert len(r.keys("user:1*")) == 1111
    with pytest.raises(redis.ResponseError, match="invalid cursor"):
        r.scan(cursor=987654321)
    assert r.flushdb()
    assert r.dbsize() == 0


def test_per_request_consistency_states_what_a_read_got(r):
    r.set("k", "v")
    assert r.execute_command("CONSISTENCY") == [b"strong", b"strong"]
    assert r.execute_command("CONSISTENCY", "eventual") == b"OK"
    # One node holds the only copy: every read is strong, whatever it asks.
    assert r.execute_command("CONSISTENCY") == [b"eventual", b"strong"]
    assert r.get("k") == b"v"
    assert r.execute_command("CONSISTENCY.READ", "eventual", "GET", "k") == [b"strong", b"v"]
    assert r.execute_command("CONSISTENCY.READ", "strong", "MGET", "k", "nosuch") == [b"strong", [b"v", None]]
    for bad, why in [
        (["CONSISTENCY", "causal"], "needs a cluster across datacenters"),
        (["CONSISTENCY", "sometimes"], "strong, eventual or causal"),
        (["CONSISTENCY.READ", "strong", "SET", "k", "x"], "runs reads of keys"),
        (["CONSISTENCY.READ", "strong", "DBSIZE"], "runs reads of keys"),
        (["CONSISTENCY.READ", "strong", "GET"], "wrong number of arguments"),
        (["CONSISTENCY.READ", "strong", "NOSUCH", "k"], "unknown command"),
        (["CONSISTENCY.READ", "strong"], "wrong number of arguments"),
    ]:
        with pytest.raises(redis.ResponseError, match=why):
            r.execute_command(*bad)
    assert r.get("k") == b"v", "refused requests changed nothing"


def test_pipelining_keeps_order(r):
    pipe = r.pipeline(transaction=False)
    for i in range(10000):
        pipe.set(f"k{i}", i)
        pipe.get(f"k{i}")
    replies = pipe.execute()
    assert replies[1::2] == [str(i).encode() for i in range(10000)]


def test_a_pipeline_that_arrives_in_pieces_is_answered_whole_and_in_order(node):
    """The node reads ahead of a pipeline for the keys to prefetch, and stops
    reading ahead for a while when the look finds one key again and again;
    commands split anywhere across reads, while it does either, are each
    answered once, in order."""
    commands = []
    for round_ in range(6):
        commands += [resp_command("SET", f"k{i}", str(round_ * 100 + i)) for i in range(40)]
        commands += [resp_command("RPUSH", "queue", str(i)) for i in range(40)]
        commands += [resp_command("GET", f"k{i}") for i in range(40)]
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as sock:
        send_in_pieces(sock, b"".join(commands), random.Random(7), [1, 2, 7, 30, 200, 1500], 0.2)
        reader = sock.makefile("rb")
        replies = []
        for _ in commands:
            reply = reader.readline()
            replies.append(reply + reader.readline() if reply.startswith(b"$") else reply)
    expected = []
    for round_ in range(6):
        expected += [b"+OK\r\n"] * 40
        expected += [b":%d\r\n" % (round_ * 40 + i + 1) for i in range(40)]
        values = [b"%d" % (round_ * 100 + i) for i in range(40)]
        expected += [b"$%d\r\n%s\r\n" % (len(value), value) for value in values]
    assert replies == expected


def test_resp3(node):
    r = node.client(protocol=3)
    assert r.ping()
    r.hset("h", mapping={"a": "1"})
    assert r.hgetall("h") == {b"a": b"1"}
    assert r.get("nothing") is None
    info = r.execute_command("HELLO", "3")
    assert info[b"proto"] == 3
    assert r.client_setname("worker-1")
    assert r.client_getname() == b"worker-1"
    assert isinstance(r.client_id(), int)


def test_info_command_and_config(r):
    r.set("x", "y")
    info = r.info()
    assert info["redis_version"]
    assert info["connected_clients"] >= 1
    assert info["total_commands_processed"] >= 1
    assert r.info("keyspace")["db0"]["keys"] == 1
    assert r.command_count() > 40
    get_info = r.execute_command("COMMAND", "INFO", "get")["get"]
    assert (get_info["arity"], get_info["first_key_pos"], get_info["last_key_pos"], get_info["step_count"]) == (2, 1, 1, 1)
    assert "mset" in r.command() and r.command()["mset"]["step_count"] == 2
    assert r.config_get("maxclients") == {"maxclients": "10000"}
    assert r.select(0)
    with pytest.raises(redis.ResponseError, match="out of range"):
        r.select(1)


def test_errors_are_clear_and_the_connection_survives(r):
    with pytest.raises(redis.ResponseError, match="unknown command"):
        r.execute_command("NOSUCHCOMMAND", "a")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments"):
        r.execute_command("GET")
    with pytest.raises(redis.ResponseError, match="wrong number of arguments"):
        r.execute_command("HSET", "h", "f")
    with pytest.raises(redis.ResponseError, match="syntax error"):
        r.execute_command("SET", "k", "v", "BOGUS")
    with pytest.raises(redis.ResponseError, match="no such table"):
        r.execute_command("TABLE.INFO", "nope")
    assert r.ping()


def raw_exchange(port, payload, read_until_close=True):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(payload)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            chunks.append(chunk)
            if not read_until_close:
                break
        return b"".join(chunks)


def test_malformed_protocol_gets_an_error_and_a_close(node):
    cases = {
        b"*1\r\n$-5\r\n": b"invalid bulk length",
        b"*abc\r\n": b"invalid multibulk length",
        b"*1\r\n+PING\r\n": b"expected '$'",
        b"*1\r\n$999999999999\r\n": b"invalid bulk length",
        b"*2\r\n$3\r\nGET\r\n$1\r\nabc\r\n": b"not terminated",
    }
    for payload, message in cases.items():
        reply = raw_exchange(node.port, payload)
        assert reply.startswith(b"-ERR Protocol error") and message in reply, (payload, reply)
    reply = raw_exchange(node.port, b"PING\r\nset k \"two words\"\r\nget k\r\nQUIT\r\n")
    assert reply == b"+PONG\r\n+OK\r\n$9\r\ntwo words\r\n+OK\r\n"
    assert node.client().ping(), "other clients are unaffected"


def test_oversized_values_are_refused(data_dir):
    from conftest import Node

    node = Node(data_dir, "--bulk-bytes-max", "1024").start()
    try:
        r = node.client()
        assert r.set("small", "x" * 1024)
        with pytest.raises(redis.ResponseError, match="invalid bulk length"):
            r.set("big", "x" * 1025)
        r = node.client()
        r.set("grow", "x" * 1000)
        with pytest.raises(redis.ResponseError, match="maximum allowed size"):
            r.append("grow", "y" * 100)
        assert r.strlen("grow") == 1000
    finally:
        node.stop()


def test_large_values_round_trip(r):
    value = bytes(range(256)) * (64 * 1024 * 4)  # 64 MiB
    assert r.set("big", value)
    assert r.get("big") == value
    assert r.strlen("big") == len(value)


def test_auth(data_dir):
    from conftest import Node

    node = Node(data_dir, "--password", "s3cret").start()
    try:
        with pytest.raises(redis.AuthenticationError):
            node.client().get("k")
        with pytest.raises(redis.AuthenticationError):
            node.client(password="wrong").get("k")
        r = node.client(password="s3cret")
        assert r.set("k", "v") and r.get("k") == b"v"
        assert node.client(password="s3cret", username="default", protocol=3).get("k") == b"v"

        # Guessing costs time: four wrong passwords pipelined on one connection
        # take 100 + 200 + 400 + 800 ms, and the other connections are served meanwhile.
        guesser = socket.create_connection(("127.0.0.1", node.port), timeout=10)
        replies = []

        def guess():
            guesser.sendall(b"".join(b"AUTH guess-%d\r\n" % attempt for attempt in range(4)))
            received = b""
            while received.count(b"\r\n") < 4:
                received += guesser.recv(4096)
            replies.extend(received.split(b"\r\n")[:4])

        thread = threading.Thread(target=guess)
        started = time.monotonic()
        thread.start()
        time.sleep(0.2)
        assert r.get("k") == b"v", "another connection is served while one is paused"
        thread.join(timeout=30)
        assert time.monotonic() - started >= 1.4, "four failures paused the guesser 1.5 s"
        assert len(replies) == 4 and all(reply.startswith(b"-WRONGPASS") for reply in replies), replies
        guesser.close()
    finally:
        node.stop()


def test_output_buffer_limit_and_idle_timeout_disconnect_clients(data_dir):
    from conftest import Node

    node = Node(data_dir, "--client-output-buffer-limit", str(1 << 20), "--timeout", "1").start()

    def rss_bytes():
        status = open(f"/proc/{node.process.pid}/status").read()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) * 1024

    try:
        r = node.client()
        r.set("k", "x" * 1024)
        assert len(r.mget(["k"] * 100)) == 100, "a reply under the limit is served"
        before = rss_bytes()
        greedy = socket.create_connection(("127.0.0.1", node.port), timeout=10)
        keys = 100_000  # a 100 MB reply
        greedy.sendall(b"*%d\r\n$4\r\nMGET\r\n" % (keys + 1) + b"$1\r\nk\r\n" * keys)
        received = b""
        while chunk := greedy.recv(1 << 16):
            received += chunk
        assert len(received) < 1 << 20, "closed, its reply dropped"
        assert rss_bytes() - before < 32 << 20, "the reply was never built past the limit"
        assert r.get("k") == b"x" * 1024, "other clients are served"

        idle = socket.create_connection(("127.0.0.1", node.port), timeout=10)
        idle.sendall(b"PING\r\n")
        assert idle.recv(64) == b"+PONG\r\n"
        time.sleep(2.5)
        assert idle.recv(64) == b"", "an idle client is closed after the timeout"
    finally:
        node.stop()


def test_max_clients(data_dir):
    from conftest import Node

    node = Node(data_dir, "--max-clients", "2").start()
    try:
        first, second = node.client(), node.client()
        assert first.ping() and second.ping()
        reply = raw_exchange(node.port, b"PING\r\n")
        assert reply.startswith(b"-ERR max number of clients reached")
        first.close()
        time.sleep(0.2)
        assert node.client().ping()
    finally:
        node.stop()


def test_client_list_shows_every_connection_and_client_kill_closes_them(node):
    """CLIENT LIST as redis-py parses it (names, library, last command,
    subscriber flags), CLIENT INFO for the connection itself, and CLIENT
    KILL by id, by address (the old form) and by type."""
    admin = node.client(client_name="admin")
    worker = socket.create_connection(("127.0.0.1", node.port), timeout=5)
    worker.sendall(b"CLIENT SETNAME worker\r\nCLIENT SETINFO LIB-NAME jobs\r\nCLIENT SETINFO LIB-VER 1.2\r\nSET k v\r\n")
    received = b""
    while received.count(b"+OK") < 4:
        received += worker.recv(1024)
    subscriber = node.client().pubsub()
    subscriber.subscribe("news")
    assert subscriber.get_message(timeout=5)["type"] == "subscribe"
    listed = {client["name"]: client for client in admin.client_list()}
    assert set(listed) >= {"admin", "worker"}
    assert listed["worker"]["lib-name"] == "jobs" and listed["worker"]["lib-ver"] == "1.2"
    assert listed["worker"]["cmd"] == "set" and listed["admin"]["cmd"] == "client|list"
    assert listed["worker"]["user"] == "default" and listed["worker"]["flags"] == "N"
    pubsub_clients = admin.client_list(_type="pubsub")
    assert len(pubsub_clients) == 1 and pubsub_clients[0]["sub"] == "1" and "P" in pubsub_clients[0]["flags"]
    assert admin.client_info()["name"] == "admin"
    assert admin.client_kill_filter(_type="pubsub") == 1
    worker_id = int(listed["worker"]["id"])
    assert admin.client_kill_filter(_id=worker_id) == 1
    assert worker.recv(1024) == b"", "a killed client's connection is closed"
    assert worker_id not in [int(client["id"]) for client in admin.client_list()]
    other = node.client(client_name="other")
    other.ping()
    address = next(client["addr"] for client in admin.client_list() if client["name"] == "other")
    assert admin.client_kill(address) is True
    with pytest.raises(redis.ResponseError, match="No such client"):
        admin.client_kill("127.0.0.1:1")
    assert admin.client_kill_filter(_id=int(admin.client_id()), skipme=True) == 0
    with pytest.raises(redis.ResponseError, match="Unknown client type"):
        admin.execute_command("CLIENT", "LIST", "TYPE", "nonsense")


def test_config_set_changes_what_it_can_while_serving_and_answers_as_redis(node, redis_server):
    ours, theirs = node.client(), redis.Redis(port=redis_server, protocol=2)
    for command in [
        ["CONFIG", "SET", "maxmemory", "lots"],
        ["CONFIG", "SET", "no-such-parameter", "1"],
        ["CONFIG", "SET", "maxmemory"],
        ["CONFIG", "SET", "maxmemory", "1mb", "maxmemory", "2mb"],
        ["CONFIG", "SET", "maxmemory-samples", "0"],
        ["CONFIG", "SET", "timeout", "-1"],
        ["CONFIG", "SET", "maxmemory", "64mb", "timeout", "x"],
        ["CONFIG", "GET", "maxmemory"],
        ["CONFIG", "SET", "maxmemory", "0", "maxmemory-policy", "noeviction", "timeout", "0"],
        ["CONFIG", "GET", "maxmemory-policy"],
        ["CONFIG", "SET", "lua-time-limit", "5000"],
        ["CONFIG", "GET", "lua-time-limit"],
        ["CONFIG"],
        ["CONFIG", "GET"],
    ]:
        def answer(client):
            try:
                return client.execute_command(*command)
            except redis.ResponseError as error:
                return ("error", str(error))
        assert answer(ours) == answer(theirs), command
    with pytest.raises(redis.ResponseError, match="immutable"):
        ours.config_set("port", "1")
    with pytest.raises(redis.ResponseError, match="must be one of the following: volatile-lru"):
        ours.config_set("maxmemory-policy", "allkeys-lfu")  # no LFU in Tessera
    ours.config_set("save", "")  # what it is: accepted, as tools send it
    ours.config_set("maxmemory", "8mb", "maxmemory-policy", "allkeys-random")
    assert ours.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-random"}
    for n in range(4000):
        ours.set(f"key-{n}", "x" * 10_000)
    assert ours.dbsize() < 4000, "keys were evicted under the new limit"
    ours.config_set("maxmemory", "0")
    ours.config_set("timeout", "1")
    idle = node.client()
    idle.ping()
    time.sleep(2.5)
    assert idle.connection_pool._available_connections[0]._sock.recv(16) == b"", "closed after the new timeout"
    ours.config_set("timeout", "0")


def answer_of(client, command):
    try:
        return client.execute_command(*command)
    except redis.ResponseError as error:
        return ("error", str(error))


def test_slowlog_latency_and_memory_answer_as_redis(node, redis_server):
    """The slow log keeps what Redis keeps (arguments cut at 32 and 128
    bytes, passwords left out) and answers in Redis's shapes; LATENCY and
    MEMORY answer as Redis does; Redis's encoding parameters are accepted;
    errors match."""
    ours, theirs = node.client(), redis.Redis(port=redis_server, protocol=2)
    for client in (ours, theirs):
        client.response_callbacks.clear()
        client.execute_command("SLOWLOG", "RESET")
        client.execute_command("CONFIG", "SET", "slowlog-log-slower-than", "0", "slowlog-max-len", "3")
        client.execute_command("SET", "key", "x" * 200)
        client.execute_command("RPUSH", "list", *range(40))
        client.execute_command("GET", "key")

    def entries(client):
        # id, time and duration are each server's own; the rest must agree.
        return [(entry[3], entry[5]) for entry in client.execute_command("SLOWLOG", "GET", -1)]

    assert entries(ours) == entries(theirs)
    assert ours.execute_command("SLOWLOG", "LEN") == theirs.execute_command("SLOWLOG", "LEN") == 3
    first = ours.execute_command("SLOWLOG", "GET", 1)[0]
    assert len(first) == 6 and first[2] >= 0 and isinstance(first[4], bytes)
    for command in [["SLOWLOG", "GET", -2], ["SLOWLOG", "GET", "x"], ["SLOWLOG", "GET", 1, 2], ["SLOWLOG", "NOPE"],
                    ["SLOWLOG", "LEN", "x"], ["CONFIG", "SET", "slowlog-log-slower-than", "-5"],
                    ["CONFIG", "SET", "slowlog-max-len", "x"], ["CONFIG", "SET", "latency-monitor-threshold", "-1"],
                    ["CONFIG", "SET", "hash-max-listpack-entries", "512", "activerehashing", "no"],
                    ["CONFIG", "GET", "hash-max-listpack-entries"], ["CONFIG", "SET", "activerehashing", "maybe"],
                    ["CONFIG", "SET", "zset-max-listpack-value", "x"],
                    ["LATENCY", "LATEST"], ["LATENCY", "HISTORY", "command"], ["LATENCY", "RESET"],
                    ["LATENCY", "NOPE"], ["LATENCY", "HISTORY"],
                    ["MEMORY", "USAGE", "missing"], ["MEMORY", "USAGE", "key", "SAMPLES", -1],
                    ["MEMORY", "USAGE", "key", "BAD", 1], ["MEMORY", "USAGE"], ["MEMORY", "NOPE"],
                    ["MEMORY", "PURGE"], ["CONFIG", "RESETSTAT"], ["CONFIG", "RESETSTAT", "x"]]:
        assert answer_of(ours, command) == answer_of(theirs, command), command
    ours.execute_command("SLOWLOG", "RESET")
    ours.execute_command("MSET", *[f"k{n}" for n in range(80)])
    logged = ours.execute_command("SLOWLOG", "GET", 1)[0][3]
    assert len(logged) == 32 and logged[-1] == b"... (50 more arguments)"
    with pytest.raises(redis.AuthenticationError):
        ours.execute_command("AUTH", "nobody", "secret-password")
    logged = [entry[3] for entry in ours.execute_command("SLOWLOG", "GET", -1) if entry[3][0] == b"AUTH"]
    assert logged == [[b"AUTH", b"(redacted)"]], "no password kept"
    ours.execute_command("CONFIG", "SET", "slowlog-log-slower-than", "10000", "slowlog-max-len", "128")
    theirs.execute_command("CONFIG", "SET", "slowlog-log-slower-than", "10000", "slowlog-max-len", "128")
    # MEMORY USAGE grows with the value, sampled or whole.
    ours.execute_command("RPUSH", "big", *[f"element-{n:05}" * 4 for n in range(5000)])
    small, large = ours.execute_command("MEMORY", "USAGE", "list"), ours.execute_command("MEMORY", "USAGE", "big")
    assert 0 < small < large and large > 5000 * 40
    assert abs(ours.execute_command("MEMORY", "USAGE", "big", "SAMPLES", 0) - large) < large * 0.2
    stats = dict(zip(*[iter(ours.execute_command("MEMORY", "STATS"))] * 2))
    assert stats[b"keys.count"] >= 3 and stats[b"total.allocated"] > 0
    # LATENCY records a command over the threshold.
    ours.execute_command("CONFIG", "SET", "latency-monitor-threshold", "1")
    ours.execute_command("EVAL", "local n = 0 for i = 1, 3000000 do n = n + i end return n", 0)
    latest = ours.execute_command("LATENCY", "LATEST")
    assert latest and latest[0][0] == b"command" and latest[0][3] >= 1, latest
    assert ours.execute_command("LATENCY", "HISTORY", "command")
    assert ours.execute_command("LATENCY", "RESET", "command") == 1
    ours.execute_command("CONFIG", "SET", "latency-monitor-threshold", "0")


def test_client_reply_and_pause_behave_as_in_redis(node, redis_server):
    """CLIENT REPLY OFF and SKIP drop replies byte for byte as Redis does,
    and RESET returns a connection to a new one's state;
    CLIENT PAUSE WRITE holds writes (not reads) until it ends or UNPAUSE,
    and CLIENT PAUSE ALL holds every command."""
    def exchange(port):
        connection = socket.create_connection(("127.0.0.1", port))
        script = [["SET", "a", "1"], ["CLIENT", "REPLY", "OFF"], ["SET", "b", "2"], ["GET", "a"],
                  ["CLIENT", "REPLY", "ON"], ["CLIENT", "REPLY", "SKIP"], ["GET", "a"], ["GET", "b"],
                  ["CLIENT", "REPLY", "MAYBE"], ["CLIENT", "NO-EVICT", "ON"], ["CLIENT", "NO-EVICT", "x"],
                  ["CLIENT", "PAUSE", "x"], ["CLIENT", "PAUSE", "10", "SOME"],
                  # RESET: a connection as new, whatever state it was in.
                  ["MULTI"], ["SET", "a", "changed"], ["RESET"], ["GET", "a"], ["CLIENT", "SETNAME", "named"],
                  ["RESET"], ["CLIENT", "GETNAME"], ["SUBSCRIBE", "channel"], ["RESET"],
                  ["GET", "a"], ["CLIENT", "REPLY", "OFF"], ["RESET"], ["RESET", "extra"], ["PING"]]
        connection.sendall(b"".join(resp_command(*command) for command in script))
        connection.settimeout(1)
        data = b""
        while not data.endswith(b"+PONG\r\n"):
            data += connection.recv(65536)
        connection.close()
        return data

    assert exchange(node.port) == exchange(redis_server)
    resp3 = socket.create_connection(("127.0.0.1", node.port))
    resp3.sendall(b"*2\r\n$5\r\nHELLO\r\n$1\r\n3\r\n*1\r\n$5\r\nRESET\r\n*2\r\n$7\r\nHGETALL\r\n$1\r\nh\r\n")
    resp3.settimeout(1)
    received = b""
    while b"RESET" not in received or not received.endswith(b"\r\n") or received.endswith(b"+RESET\r\n"):
        received += resp3.recv(65536)
    assert received.endswith(b"+RESET\r\n*0\r\n"), "RESP2 again: an empty hash is an empty array, not a map"
    resp3.close()
    ours, other = node.client(), node.client()
    ours.execute_command("CLIENT", "PAUSE", 500, "WRITE")
    started = time.monotonic()
    assert other.get("a") == b"1" and time.monotonic() - started < 0.3, "reads go on"
    other.set("a", "2")
    assert time.monotonic() - started >= 0.4, "a write waited for the pause to end"
    ours.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
    threading.Timer(0.3, lambda: node.client().execute_command("CLIENT", "UNPAUSE")).start()
    started = time.monotonic()
    other.set("a", "3")
    assert 0.2 < time.monotonic() - started < 5, "CLIENT UNPAUSE ended the pause"
    ours.execute_command("CLIENT", "PAUSE", 400, "ALL")
    started = time.monotonic()
    assert other.get("a") == b"3" and time.monotonic() - started >= 0.3, "under ALL, reads wait too"
    ours.execute_command("CLIENT", "NO-EVICT", "ON")
    assert b"flags=e" in ours.execute_command("CLIENT", "INFO")


def test_a_node_logs_json_lines_with_levels_per_module(data_dir):
    """`--log-format json` writes one JSON object per line (what log
    collectors ingest); `--log` sets levels per module."""
    node = Node(data_dir, "--log-format", "json", "--log", "warn,tessera_node::server=info").start()
    try:
        assert node.client().ping()
    finally:
        node.stop()
    lines = [line for line in node.read_log().splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]
    assert events, "nothing logged"
    for event in events:
        assert {"timestamp", "level", "message", "target"} <= set(event), event
        # Only warnings, but the server module's information too.
        assert event["level"] in ("WARN", "ERROR") or event["target"] == "tessera_node::server", event
    assert any(event["message"] == "shutdown complete" for event in events), events
