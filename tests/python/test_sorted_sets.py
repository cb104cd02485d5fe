"""Sorted sets: the same random commands against a real Redis and a Tessera
node must get the same replies, on every local engine."""

import random

import pytest
import redis

from conftest import Node


def random_command(rng, members):
    member = rng.choice(members)
    score = rng.choice([rng.randint(-20, 20), rng.randint(-20, 20) + 0.5, "-inf", "+inf"])
    low, high = sorted([rng.randint(-25, 25), rng.randint(-25, 25)])
    low = rng.choice([str(low), f"({low}", "-inf"])
    high = rng.choice([str(high), f"({high}", "+inf"])
    kind = rng.random()
    if kind < 0.35:
        pairs = []
        for _ in range(rng.randint(1, 6)):
            pairs += [rng.randint(-20, 20), rng.choice(members)]
        flags = rng.choice([[], [], ["NX"], ["XX"], ["GT"], ["LT", "CH"], ["CH"], ["XX", "GT", "CH"]])
        return ["ZADD", "z", *flags, *pairs]
    if kind < 0.40:
        return ["ZADD", "z", rng.choice([[], ["XX"], ["NX"]]), "INCR", 0.5, member]
    if kind < 0.45:
        return ["ZINCRBY", "z", rng.choice([1, -2, 0.5]), member]
    if kind < 0.60:
        return ["ZREM", "z", *rng.sample(members, rng.randint(1, 4))]
    if kind < 0.65:
        return ["ZSCORE", "z", member]
    if kind < 0.68:
        return ["ZMSCORE", "z", member, rng.choice(members)]
    if kind < 0.70:
        return ["ZCARD", "z"]
    if kind < 0.74:
        return ["ZCOUNT", "z", low, high]
    if kind < 0.78:
        # (WITHSCORE is Redis 7.2; the Redis these tests start may be older.)
        return [rng.choice(["ZRANK", "ZREVRANK"]), "z", member]
    if kind < 0.86:
        options = rng.choice([[], ["WITHSCORES"], ["LIMIT", rng.randint(0, 5), rng.randint(-1, 10)]])
        if rng.random() < 0.5:
            return ["ZRANGEBYSCORE", "z", low, high, *options]
        return ["ZREVRANGEBYSCORE", "z", high, low, *options]
    start, stop = rng.randint(-30, 30), rng.randint(-30, 30)
    options = rng.choice([[], ["WITHSCORES"], ["REV"], ["REV", "WITHSCORES"]])
    if rng.random() < 0.3:
        return ["ZRANGE", "z", low, high, "BYSCORE", *options, "LIMIT", rng.randint(0, 3), rng.randint(-1, 20)]
    return ["ZRANGE", "z", start, stop, *options]


def reply_of(client, command):
    flat = []
    for arg in command:
        flat += arg if isinstance(arg, list) else [arg]
    try:
        return client.execute_command(*flat)
    except redis.ResponseError as error:
        return ("error", str(error).split()[0])


@pytest.mark.parametrize("engine", ["memory", "log", "lsm"])
def test_replies_match_redis(data_dir, redis_server, engine):
    node = Node(data_dir, "--engine", engine).start()
    ours, theirs = node.client(), redis.Redis(port=redis_server, protocol=2)
    for client in (ours, theirs):
        client.response_callbacks.clear()  # compare the raw replies
    rng = random.Random(11)
    # Enough members to span many pages, few enough that commands collide.
    members = [f"member:{i}" for i in range(600)]
    for step in range(4000):
        command = random_command(rng, members)
        assert reply_of(ours, command) == reply_of(theirs, command), (step, command)
    assert ours.execute_command("ZRANGE", "z", 0, -1, "WITHSCORES") == theirs.execute_command(
        "ZRANGE", "z", 0, -1, "WITHSCORES")
    node.stop()


def test_resp3_replies_match_redis(node, redis_server):
    ours, theirs = node.client(protocol=3), redis.Redis(port=redis_server, protocol=3)
    for client in (ours, theirs):
        client.zadd("z", {"a": 1, "b": 2.5, "c": float("inf")})
    for command in (["ZRANGE", "z", 0, -1, "WITHSCORES"], ["ZSCORE", "z", "b"], ["ZRANK", "z", "c"],
                    ["ZMSCORE", "z", "a", "nope"], ["ZRANGEBYSCORE", "z", "-inf", "+inf", "WITHSCORES"]):
        assert ours.execute_command(*command) == theirs.execute_command(*command), command


def test_a_large_set_persists_and_hides_its_entries(data_dir):
    node = Node(data_dir, "--engine", "lsm").start()
    r = node.client()
    pipe = r.pipeline(transaction=False)
    for i in range(5000):
        pipe.zadd("index", {f"user{i}": i % 977})
    pipe.set("plain", "x")
    pipe.execute()
    assert r.zcard("index") == 5000
    assert r.dbsize() == 2
    assert sorted(r.keys("*")) == [b"index", b"plain"]
    assert sorted(r.scan_iter(count=100)) == [b"index", b"plain"]
    assert list(r.scan_iter(_type="zset")) == [b"index"]
    assert r.type("index") == b"zset"
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        r.get("index")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        r.zadd("plain", {"a": 1})
    assert r.execute_command("ZREVRANK", "index", "user0", "WITHSCORE") == [4999, b"0"]
    with pytest.raises(redis.ResponseError, match="reserved"):
        r.set(b"\xff\xff#anything", "x")
    node.stop()

    node = Node(data_dir, "--engine", "lsm").start()
    r = node.client()
    assert r.zcard("index") == 5000
    assert r.dbsize() == 2
    assert r.zrangebyscore("index", 976, "+inf", start=0, num=3) == [b"user1953", b"user2930", b"user3907"]
    assert r.zscore("index", "user4999") == 4999 % 977
    # Overwriting the set leaves its entries to the background sweep.
    r.set("index", "now a string")
    assert r.dbsize() == 2
    assert r.get("index") == b"now a string"
    node.stop()


def test_ycsb_style_index_use(r):
    """What the Java YCSB Redis binding sends: ZADD on insert, ZRANGEBYSCORE
    with LIMIT for scans, ZREM on delete."""
    for i in range(300):
        r.hset(f"user{i}", mapping={"field0": "v"})
        r.zadd("_indices", {f"user{i}": float(i * 7919 % 1000)})
    start = r.zscore("_indices", "user7")
    keys = r.zrangebyscore("_indices", start, "+inf", start=0, num=10)
    expected = sorted((i * 7919 % 1000, f"user{i}") for i in range(300) if i * 7919 % 1000 >= start)
    assert keys == [member.encode() for _, member in expected[:10]]
    assert r.zrem("_indices", "user7") == 1
    assert r.zcard("_indices") == 299
