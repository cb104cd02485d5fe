"""Tables, engines and restarts of a real node."""

import random
import signal
import socket
import threading
import time

import pytest
import redis

from conftest import Node, evict_from_page_cache, resp_command, send_in_pieces, table_info

PERSISTENT_ENGINES = ["log", "lsm", "hybrid"]


def test_tables_route_by_longest_prefix(node, r):
    assert r.execute_command("TABLE.CREATE", "users", "PREFIX", "user:", "ENGINE", "ordered")
    assert r.execute_command("TABLE.CREATE", "admins", "PREFIX", "user:admin:", "ENGINE", "memory")
    r.set("user:1", "a")
    r.set("user:admin:1", "b")
    r.set("other", "c")
    info = r.execute_command("TABLE.INFO", "users")
    assert dict(zip(info[::2], info[1::2]))[b"keys"] == 1
    info = node.client(protocol=3).execute_command("TABLE.INFO", "admins")
    assert info[b"keys"] == 1 and info[b"engine"] == b"memory"
    assert sorted(r.execute_command("TABLE.LIST")) == [b"admins", b"default", b"users"]
    assert set(r.scan_iter()) == {b"user:1", b"user:admin:1", b"other"}
    assert r.dbsize() == 3
    with pytest.raises(redis.ResponseError, match="already exists"):
        r.execute_command("TABLE.CREATE", "users", "PREFIX", "x:", "ENGINE", "memory")
    with pytest.raises(redis.ResponseError, match="already owned"):
        r.execute_command("TABLE.CREATE", "again", "PREFIX", "user:", "ENGINE", "memory")
    with pytest.raises(redis.ResponseError, match="unknown engine"):
        r.execute_command("TABLE.CREATE", "bad", "PREFIX", "b:", "ENGINE", "nosuch")
    with pytest.raises(redis.ResponseError, match="has no option"):
        r.execute_command("TABLE.CREATE", "bad", "PREFIX", "b:", "ENGINE", "log", "color", "red")
    with pytest.raises(redis.ResponseError, match="keys with prefix"):
        r.execute_command("TABLE.CREATE", "shadow", "PREFIX", "oth", "ENGINE", "memory")
    with pytest.raises(redis.ResponseError, match="cannot be dropped"):
        r.execute_command("TABLE.DROP", "default")
    assert r.execute_command("TABLE.DROP", "admins")
    assert r.get("user:admin:1") is None, "a dropped table's data is gone"
    assert r.get("user:1") == b"a"


@pytest.mark.parametrize("engine", ["ordered", "lsm"])
def test_table_range_walks_keys_in_order(node, r, engine):
    r.execute_command("TABLE.CREATE", "index", "PREFIX", "ix:", "ENGINE", engine)
    keys = [f"ix:{i:04d}" for i in range(0, 2000, 7)]
    pipe = r.pipeline(transaction=False)
    for key in reversed(keys):
        pipe.set(key, "v")
    pipe.execute()
    r.set("ix:gone", "v", px=1)
    r.zadd("ix:zset", {"member": 1})
    time.sleep(0.01)
    everything = r.execute_command("TABLE.RANGE", "index", "-", "+")
    assert everything == sorted([k.encode() for k in keys] + [b"ix:zset"]), "expired keys and zset internals hidden"
    middle = r.execute_command("TABLE.RANGE", "index", "[ix:0014", "(ix:0035")
    assert middle == [b"ix:0014", b"ix:0021", b"ix:0028"]
    assert r.execute_command("TABLE.RANGE", "index", "(ix:0014", "[ix:0028") == [b"ix:0021", b"ix:0028"]
    assert r.execute_command("TABLE.RANGE", "index", "[ix:1", "+", "COUNT", "3") == [b"ix:1001", b"ix:1008", b"ix:1015"]
    assert r.execute_command("TABLE.RANGE", "index", "[ix:9", "[ix:1") == []
    for bad, why in [
        (["index", "ix:1", "+"], "start with"),
        (["index", "-", "+", "COUNT", "0"], "syntax"),
        (["index", "-", "+", "LIMIT", "3"], "syntax"),
        (["nosuch", "-", "+"], "no such table"),
        (["default", "-", "+"], "ordered engine"),
    ]:
        with pytest.raises(redis.ResponseError, match=why):
            r.execute_command("TABLE.RANGE", *bad)
    with pytest.raises(redis.ResponseError, match="single node holds all of it"):
        r.execute_command("TABLE.CREATE", "ranged", "PREFIX", "rg:", "ENGINE", "ordered", "PARTITION", "RANGE")
    with pytest.raises(redis.ResponseError, match="need PARTITION RANGE"):
        r.execute_command("TABLE.CREATE", "ranged", "PREFIX", "rg:", "ENGINE", "ordered", "SPLIT", "rg:m")


@pytest.mark.parametrize("engine", PERSISTENT_ENGINES)
def test_data_survives_a_restart(data_dir, engine):
    node = Node(data_dir, "--engine", engine).start()
    r = node.client()
    pipe = r.pipeline(transaction=False)
    for i in range(3000):
        pipe.set(f"key:{i}", f"value:{i}")
    pipe.hset("h", mapping={"a": "1", "b": "2"})
    pipe.set("ttl", "v", ex=1000)
    pipe.execute()
    r.delete("key:7")
    r.execute_command("TABLE.CREATE", "events", "PREFIX", "ev:", "ENGINE", "log", "fsync", "always")
    r.set("ev:1", "launch")
    assert node.stop() == 0, node.read_log()

    node = Node(data_dir, "--engine", engine).start()
    r = node.client()
    assert r.dbsize() == 3002
    assert r.get("key:2999") == b"value:2999"
    assert r.get("key:7") is None
    assert r.hgetall("h") == {b"a": b"1", b"b": b"2"}
    assert 990 < r.ttl("ttl") <= 1000
    assert r.get("ev:1") == b"launch"
    assert b"events" in r.execute_command("TABLE.LIST")
    node.stop()


@pytest.mark.parametrize("engine", ["log", "hybrid"])
def test_fsync_always_survives_kill_9(data_dir, engine):
    """With fsync=always, every acknowledged write is on disk the moment it is acknowledged."""
    node = Node(data_dir, "--engine", engine, "--engine-option", "fsync=always").start()
    r = node.client()
    for i in range(300):
        r.set(f"k{i}", i)
        r.incr("counter")
    node.stop(signal.SIGKILL)
    node = Node(data_dir, "--engine", engine).start()
    r = node.client()
    assert [r.get(f"k{i}") for i in range(300)] == [str(i).encode() for i in range(300)]
    assert r.get("counter") == b"300"
    node.stop()


def test_a_hybrid_table_larger_than_its_memory_serves_and_survives_kill_9(data_dir):
    """A table four times its memory budget: old keys are read from disk and
    then copied back to memory; everything survives kill -9 after a flush."""
    node = Node(data_dir).start()
    r = node.client()
    r.execute_command("TABLE.CREATE", "big", "PREFIX", "big:", "ENGINE", "hybrid", "memory-bytes", "1mb")
    value = b"x" * 500
    pipe = r.pipeline(transaction=False)
    for i in range(8000):
        pipe.set(f"big:{i}", value + str(i).encode())
    pipe.execute()
    def info():
        return table_info(r, "big")

    assert info()[b"log-bytes"] > 4 * (1 << 20) > info()[b"log-bytes-in-memory"]
    before = info()
    assert r.get("big:0") == value + b"0"
    assert info()[b"reads-from-disk"] == before[b"reads-from-disk"] + 1
    assert r.get("big:0") == value + b"0"
    assert info()[b"reads-in-memory"] == before[b"reads-in-memory"] + 1, "a read from disk is copied to memory"
    assert r.incr("big:counter") == 1
    deadline = time.time() + 10  # fsync everysec: wait for the fold-over that takes the counter
    while info()[b"log-bytes-durable"] < info()[b"log-bytes"] and time.time() < deadline:
        time.sleep(0.05)
    assert info()[b"log-bytes-durable"] == info()[b"log-bytes"]
    node.stop(signal.SIGKILL)
    node = Node(data_dir).start()
    r = node.client()
    assert [r.get(f"big:{i}") for i in range(0, 8000, 97)] == [value + str(i).encode() for i in range(0, 8000, 97)]
    assert r.get("big:counter") == b"1"
    assert info()[b"keys"] == 8001
    node.stop()


def test_reads_that_would_wait_for_the_disk_are_fetched_off_the_serving_thread(data_dir):
    """One worker thread, eight clients reading keys whose records are on disk
    and out of the page cache: each such read is fetched ahead of its command
    on an I/O thread, and every value comes back right."""
    node = Node(data_dir, "--threads", "1", "--disk-reads-in-flight", "4").start()
    r = node.client()
    r.execute_command("TABLE.CREATE", "big", "PREFIX", "big:", "ENGINE", "hybrid", "memory-bytes", "1mb")
    pipe = r.pipeline(transaction=False)
    for i in range(8000):
        pipe.set(f"big:{i}", f"{i}:".encode() + b"v" * 500)
    pipe.execute()
    evict_from_page_cache(data_dir)

    def read_share(share, errors):
        client = node.client()
        for i in range(share, 8000, 8):
            if client.get(f"big:{i}") != f"{i}:".encode() + b"v" * 500:
                errors.append(i)

    errors = []
    readers = [threading.Thread(target=read_share, args=(share, errors)) for share in range(8)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    assert errors == []
    stats = r.info("stats")
    assert stats["disk_reads_fetched"] > 0 and stats["disk_reads_in_flight"] == 0
    assert table_info(r, "big")[b"disk-fetches"] == stats["disk_reads_fetched"]
    node.stop()


def test_a_pipeline_on_a_prefetching_engine_answers_as_on_memory_however_it_arrives(data_dir):
    """The node parses ahead of a pipeline to prefetch its keys on a hybrid
    table. The same pipeline of mixed commands, sent in pieces that split
    frames anywhere, gets the same replies from a hybrid table as from a
    memory one, and the hybrid engine was shown the keys."""
    node = Node(data_dir, "--threads", "1").start()
    r = node.client()
    r.execute_command("TABLE.CREATE", "hot", "PREFIX", "h:", "ENGINE", "hybrid", "memory-bytes", "64mb")
    r.execute_command("TABLE.CREATE", "plain", "PREFIX", "m:", "ENGINE", "memory")
    rng = random.Random(7)
    commands = []
    for i in range(3000):
        key = f"k{rng.randrange(40)}"
        commands.append(rng.choice([
            ["SET", key, f"v{i}"], ["GET", key], ["INCR", f"n{rng.randrange(8)}"], ["APPEND", key, "x"],
            ["MGET", key, f"k{rng.randrange(40)}", "k-none"], ["DEL", key], ["PING"], ["EXISTS", key, "k0"],
        ]))

    def replies_for(prefix):
        def with_prefix(command):
            name, args = command[0], command[1:]
            if name == "PING":
                return command
            return [name] + [prefix + arg if not arg.startswith("v") and arg != "x" else arg for arg in args]
        wire = b"".join(resp_command(*with_prefix(command)) for command in commands)
        sock = socket.create_connection(("127.0.0.1", node.port))
        send_in_pieces(sock, wire, rng, [1, 2, 7, 30, 500, 4000], 0.05)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        sock.close()
        return received

    assert replies_for("h:") == replies_for("m:")
    assert table_info(r, "hot")[b"prefetched-keys"] > 0
    node.stop()


def test_engine_mismatch_is_a_clear_startup_error(data_dir):
    node = Node(data_dir, "--engine", "log").start()
    node.stop()
    node = Node(data_dir, "--engine", "lsm")
    with pytest.raises(RuntimeError, match="created with engine 'log'"):
        node.start()


def test_bad_config_is_a_clear_startup_error(data_dir):
    from pathlib import Path

    config = Path(data_dir) / "bad.toml"
    config.write_text("prot = 7379\n")
    node = Node(data_dir, "--config", str(config))
    with pytest.raises(RuntimeError, match="unknown field"):
        node.start()


def test_redis_server_as_the_engine(data_dir, redis_server):
    """A real Redis behind Tessera: data lives there and outlives the node."""
    address = f"127.0.0.1:{redis_server}"
    node = Node(data_dir, "--engine", "redis", "--engine-option", f"addr={address}").start()
    r = node.client()
    r.set("k", "v")
    r.hset("h", mapping={"f": "1"})
    assert r.incr("n") == 1
    assert r.get("k") == b"v"
    r.execute_command("TABLE.CREATE", "cache", "PREFIX", "c:", "ENGINE", "redis", "addr", address, "db", "1")
    r.set("c:1", "cached")
    with pytest.raises(redis.ResponseError, match="already backs table"):
        r.execute_command("TABLE.CREATE", "again", "PREFIX", "a:", "ENGINE", "redis", "addr", address, "db", "1")
    assert node.stop() == 0
    backing = redis.Redis(port=redis_server)
    assert backing.dbsize() == 3, "the default table's keys live in the remote server"
    assert redis.Redis(port=redis_server, db=1).dbsize() == 1
    node = Node(data_dir, "--engine", "redis", "--engine-option", f"addr={address}").start()
    r = node.client()
    assert r.get("k") == b"v" and r.hgetall("h") == {b"f": b"1"} and r.get("c:1") == b"cached"
    assert sorted(r.scan_iter()) == [b"c:1", b"h", b"k", b"n"]

    # A client cannot point the node at a server the operator did not allow.
    with pytest.raises(redis.ResponseError, match="redis-engine-allow"):
        r.execute_command("TABLE.CREATE", "elsewhere", "PREFIX", "e:", "ENGINE", "redis", "addr", "127.0.0.1:1")
    # Dropping a table leaves a database it does not own alone; one it owns is emptied.
    r.execute_command("TABLE.DROP", "cache")
    assert redis.Redis(port=redis_server, db=1).dbsize() == 1, "db 1 is not the table's to empty"
    with pytest.raises(redis.ResponseError, match="not this table's to empty"):
        r.flushall()
    r.execute_command(
        "TABLE.CREATE", "owned", "PREFIX", "o:", "ENGINE", "redis", "addr", address, "db", "2", "owns-database", "yes"
    )
    r.set("o:1", "mine")
    assert redis.Redis(port=redis_server, db=2).dbsize() == 1
    r.execute_command("TABLE.DROP", "owned")
    assert redis.Redis(port=redis_server, db=2).dbsize() == 0, "an owned database is emptied with its table"
    node.stop()


def test_unreachable_redis_engine_is_a_clear_error(data_dir):
    from conftest import free_port

    node = Node(data_dir, "--engine", "redis", "--engine-option", f"addr=127.0.0.1:{free_port()}")
    with pytest.raises(RuntimeError, match="connecting to"):
        node.start()
