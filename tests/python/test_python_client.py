"""The Python package `tessera` (clients/python), as installed from its wheel
by the test command, against real nodes and a real cluster: its README's
examples run as doctests, and its own API (tables, consistency levels,
ordered walks, sessions, status, batches) is checked against what the
servers hold and answer."""

import doctest
import time

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from conftest import ROOT
from tessera import Leveled, Tessera, TesseraCluster
from test_causal import geo_cluster  # noqa: F401 - a fixture
from test_cluster import cluster_factory  # noqa: F401 - a fixture


def test_the_readme_of_the_python_client_runs_against_a_node(node, monkeypatch):
    monkeypatch.setenv("TESSERA_ADDR", f"127.0.0.1:{node.port}")
    failed, attempted = doctest.testfile(
        str(ROOT / "clients" / "python" / "README.md"), module_relative=False, report=True
    )
    assert attempted >= 20 and failed == 0


def test_a_node_reads_strong_and_misuse_gets_clear_errors(node):
    db = Tessera(port=node.port)
    db.set("k", "v")
    db.lpush("list", "x")
    assert db.read_at("eventual", "GET", "k") == Leveled(b"v", "strong")
    with pytest.raises(ValueError, match="consistency is one of"):
        db.consistency("linearizable")
    with pytest.raises(redis.ResponseError, match="not one"):
        db.read_at("strong", "SET", "k", "w")
    assert db.get("k") == b"v", "a refused read wrote nothing"
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        db.consistency("eventual").get("list")
    with pytest.raises(redis.ResponseError, match="single node"):
        db.tables.alter("default", consistency="eventual")
    with pytest.raises(ValueError):
        db.tables.alter("default")
    with pytest.raises(redis.ResponseError, match="no such table"):
        db.tables.info("missing")
    with pytest.raises(redis.ResponseError, match="datacenters"):
        db.session("causal")
    with pytest.raises(ValueError):
        list(db.range("default", page=0))
    batch = db.pipelined([("SET", "a", 1), ("INCR", "list"), ("GET", "a")], depth=2)
    assert batch.replies[0] is True and batch.replies[2] == b"1"
    assert [type(error) for error in batch.errors] == [redis.ResponseError]

    # RESP3 maps and booleans read as RESP2's lists and integers do.
    resp3 = Tessera(port=node.port, protocol=3, decode_responses=True)
    resp3.tables.create("log", prefix="log:", engine="log", options={"fsync": "never"})
    info = resp3.tables.info("log")
    assert (info.engine, info.options, info.keys, info.ordered, info.persistent) == (
        "log", {"fsync": "never"}, 0, False, True)


def test_the_python_client_on_a_cluster_walks_ranges_reports_levels_and_sees_a_failure(cluster_factory):
    cluster = cluster_factory("strong", nodes=3)
    db = TesseraCluster(host="127.0.0.1", port=cluster.port(0), decode_responses=True)

    db.tables.create("ix", prefix="ix:", engine="ordered", partition="range", splits=["ix:q", "ix:h"])
    info = db.tables.info("ix")
    assert (info.engine, info.partition, info.mode) == ("ordered", "range", "ms+sc")
    assert [shard.holds for shard in info.shards] == ["keys - (ix:h", "keys [ix:h (ix:q", "keys [ix:q +"]
    assert all(len(shard.members) == 3 for shard in info.shards)
    keys = [f"ix:{letter}{number}" for letter in "abcdefghijklmnopqrstuvwxyz" for number in range(4)]
    batch = db.pipelined((("SET", key, key) for key in keys), depth=16)
    assert batch.errors == [] and len(batch.replies) == len(keys)
    assert list(db.range("ix", page=7)) == sorted(keys)
    assert list(db.range("ix", "ix:c1", "ix:t")) == [key for key in sorted(keys) if "ix:c1" <= key < "ix:t"]

    default = next(table for table in db.cluster_status().tables if table.name == "default")
    assert sorted(low for shard in default.shards for low, _ in shard.slots)[0] == 0
    assert sum(high - low + 1 for shard in default.shards for low, high in shard.slots) == 16384

    # Levels: what was asked, on an MS+SC table, whichever node heads the key.
    for number in range(20):
        db.set(f"user:{number}", number)
        assert db.read_at("eventual", "GET", f"user:{number}") == Leveled(str(number), "eventual")
        assert db.consistency("strong").get(f"user:{number}") == str(number)
        assert db.last_level == "strong"
    with db.consistency("eventual"):
        assert db.mget("{u}1", "{u}2") == [None, None]
        assert db.last_level == "eventual"

    # Any cluster client routes CONSISTENCY.READ by the read's keys
    # (COMMAND GETKEYS), as redis-py's own does here.
    plain = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", cluster.port(1))], decode_responses=True)
    for number in range(20):
        key = f"user:{number}"
        assert plain.determine_slot("CONSISTENCY.READ", "strong", "GET", key) == key_slot(key.encode())
        assert plain.execute_command("CONSISTENCY.READ", "strong", "GET", key) == ["strong", str(number)]

    db.tables.alter("ix", consistency="eventual")
    assert db.tables.info("ix").mode == "ms+ec"
    with db.session("eventual", key="user:3") as session:
        assert session.levels() == ("eventual", "eventual")
        assert session.get("user:3") == "3"

    hello = redis.Redis(port=cluster.port(2), protocol=3).execute_command("HELLO", "3")
    assert hello[b"mode"] == b"cluster", hello

    status = db.cluster_status()
    assert status.healthy and status.slots_ok == 16384 and len(status.nodes) == 3
    assert {table.name for table in status.tables} == {"default", "ix"}

    cluster.cli("kill", "1")
    deadline = time.time() + 20
    while not any(node.failed for node in status.nodes):
        assert time.time() < deadline, f"the killed node is not shown failed: {status.nodes}"
        time.sleep(0.2)
        status = db.cluster_status()
    assert [node.address for node in status.nodes if node.failed] == [f"127.0.0.1:{cluster.port(1)}"]
    assert status.state == "ok" and not status.healthy
    assert list(db.range("ix", page=5)) == sorted(keys), "the walk goes on after the failover"

    db.tables.drop("ix")
    assert db.tables.list() == ["default"]


def test_python_sessions_carry_a_causal_context_through_a_token_and_never_reconnect_without_it(geo_cluster):
    cluster = geo_cluster("causal-spartan")
    author = Tessera(port=cluster.port(0), decode_responses=True).session("causal")
    reader = Tessera(port=cluster.port(1), decode_responses=True).session()
    with author, reader:
        assert author.levels() == ("causal", "causal")
        author.set("post:1", "hello")
        author.set("comment:1", "hi back")
        reader.resume(author.token())
        assert reader.level == "causal" and reader.levels() == ("causal", "causal")
        assert reader.get("comment:1") == "hi back" and reader.get("post:1") == "hello"
        assert reader.read_at("causal", "GET", "post:1") == Leveled("hello", "causal")
        with pytest.raises(redis.ResponseError, match="did not make|not a causal token"):
            reader.resume("00" + author.token()[2:])

    # The server keeps a causal session's context with its connection: when
    # the connection is cut, the session says so instead of reconnecting
    # without it.
    session = Tessera(port=cluster.port(0)).session("causal")
    session.set("post:2", "again")
    redis.Redis(port=cluster.port(0)).client_kill_filter(_id=session.client_id())
    with pytest.raises(redis.ConnectionError, match="context went with it"):
        session.get("post:2")
    session.close()
