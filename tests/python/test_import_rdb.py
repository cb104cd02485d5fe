"""`tessera import-rdb` against dumps a real redis-server writes: every key of
every type and encoding Redis picks (listpacks, intsets, quicklists, hash
tables, skiplists), with expiry times, loaded into a node and into a cluster
and compared key by key with Redis; a damaged file or one holding a type
Tessera does not keep loads nothing."""

import random
import subprocess
from pathlib import Path

import redis

from conftest import BINARY
from test_cluster import LocalCluster


def fill(client):
    """Keys of each type, small and large enough for each of Redis's encodings."""
    rng = random.Random(7)
    pipe = client.pipeline(transaction=False)
    for index in range(200):
        pipe.set(f"s:{index}", f"value-{index}" * rng.randrange(1, 5))
    pipe.set("s:int", 12345)
    pipe.set("s:negative", -9000000000)
    pipe.set(b"s:binary\x00\xff", bytes(range(256)) * 3)
    pipe.set("s:long", "x" * 100_000)  # LZF-compressed in the file
    pipe.set("s:ttl", "soon", ex=3600)
    pipe.rpush("l:small", "a", "b", "c")
    pipe.rpush("l:large", *[f"element-{index}" * 3 for index in range(5_000)])
    pipe.sadd("set:ints", *range(50))
    pipe.sadd("set:small", "x", "y", "z")
    pipe.sadd("set:large", *[f"member-{index}" for index in range(1_000)])
    pipe.hset("h:small", mapping={"f1": "v1", "f2": "2"})
    pipe.hset("h:large", mapping={f"field-{index}": f"v{index}" * 20 for index in range(1_000)})
    pipe.zadd("z:small", {"a": 1.5, "b": -2, "c": 1e300})
    pipe.zadd("z:large", {f"m{index}": rng.uniform(-1e6, 1e6) for index in range(1_000)})
    pipe.pexpire("z:small", 7_200_000)
    pipe.execute()


def contents(client, key):
    kind = client.type(key).decode()
    value = {
        "string": lambda: client.get(key),
        "list": lambda: client.lrange(key, 0, -1),
        "set": lambda: sorted(client.smembers(key)),
        "hash": lambda: sorted(client.hgetall(key).items()),
        "zset": lambda: client.zrange(key, 0, -1, withscores=True),
    }[kind]()
    return kind, value


def dump_of(redis_port, tmp_path):
    client = redis.Redis(port=redis_port)
    client.save()
    directory = client.config_get("dir")["dir"]
    path = tmp_path / "dump.rdb"
    path.write_bytes((Path(directory) / "dump.rdb").read_bytes())
    return path


def import_rdb(path, port, *options):
    return subprocess.run([str(BINARY), "import-rdb", str(path), "--addr", f"127.0.0.1:{port}", *options],
                          capture_output=True, text=True, timeout=300)


def assert_same_keys(source, target):
    keys = sorted(source.keys("*"))
    assert sorted(target.keys("*")) == keys
    for key in keys:
        assert contents(target, key) == contents(source, key), key
        expected_ttl = source.pttl(key)
        if expected_ttl < 0:
            assert target.pttl(key) == expected_ttl, key
        else:
            assert abs(target.pttl(key) - expected_ttl) < 60_000, key


def test_a_redis_dump_loads_into_a_node_with_every_type_and_expiry(redis_server, node, tmp_path):
    source = redis.Redis(port=redis_server)
    fill(source)
    redis.Redis(port=redis_server, db=1).set("in-db-1", "x")
    path = dump_of(redis_server, tmp_path)

    done = import_rdb(path, node.port)
    assert done.returncode == 0, done.stderr
    assert "1 keys in db 1 are not loaded" in done.stdout
    target = node.client()
    assert_same_keys(source, target)

    # Loading again leaves what exists and says so; --replace overwrites.
    target.set("s:1", "changed")
    again = import_rdb(path, node.port)
    assert again.returncode != 0 and "exist" in again.stderr
    assert target.get("s:1") == b"changed"
    assert import_rdb(path, node.port, "--replace").returncode == 0
    assert target.get("s:1") == source.get("s:1")

    # --db loads another database instead.
    assert import_rdb(path, node.port, "--db", "1").returncode == 0
    assert target.get("in-db-1") == b"x"


def test_a_damaged_dump_or_one_with_a_stream_loads_nothing(redis_server, node, tmp_path):
    source = redis.Redis(port=redis_server)
    fill(source)
    path = dump_of(redis_server, tmp_path)
    damaged = tmp_path / "damaged.rdb"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    damaged.write_bytes(bytes(data))
    truncated = tmp_path / "truncated.rdb"
    truncated.write_bytes(bytes(data[: len(data) // 3]))
    not_rdb = tmp_path / "not.rdb"
    not_rdb.write_bytes(b"hello world, not a dump")
    source.xadd("stream", {"a": "1"})
    (tmp_path / "stream").mkdir()
    with_stream = dump_of(redis_server, tmp_path / "stream")
    target = node.client()
    for bad, wording in [(damaged, "nothing was loaded"), (truncated, "nothing was loaded"),
                         (not_rdb, "not an RDB file"), (with_stream, "stream")]:
        done = import_rdb(bad, node.port)
        assert done.returncode != 0, bad
        assert wording in done.stderr, done.stderr
        assert target.dbsize() == 0, bad
    assert import_rdb(tmp_path / "missing.rdb", node.port).returncode != 0


def test_a_redis_dump_loads_into_a_cluster(redis_server, tmp_path):
    source = redis.Redis(port=redis_server)
    fill(source)
    path = dump_of(redis_server, tmp_path)
    cluster = LocalCluster(tmp_path, "strong")
    try:
        cluster.up()
        # Through one node: it forwards each key to its shard.
        done = import_rdb(path, cluster.port(2))
        assert done.returncode == 0, done.stderr
        client = cluster.client()
        keys = sorted(source.keys("*"))
        stored = sum(redis.Redis(port=cluster.port(node)).dbsize() for node in range(cluster.nodes))
        assert stored == len(keys)
        for key in keys:
            assert contents(client, key) == contents(source, key), key
        assert client.ttl("s:ttl") > 3000
    finally:
        cluster.down()
