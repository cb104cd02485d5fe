"""Redis Cluster's resharding interface on a Tessera cluster (docs/ARCHITECTURE.md,
"Redis Cluster's interface"): CLUSTER SETSLOT, GETKEYSINSLOT, COUNTKEYSINSLOT
and MIGRATE answer as a real Redis Cluster does for the same commands on the
same data, and Debian's `redis-cli --cluster reshard`, `rebalance` and
`check` move slots while clients run, linearizably in the strong modes and
without losing an acknowledged write in the eventual ones."""

import re
import subprocess
import time

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from conftest import wait_for_ping
from test_cluster import (
    assert_acknowledged_writes_kept,
    assert_replicas_converge,
    assert_served_and_linearizable,
    cluster_factory,  # noqa: F401  (a fixture)
    free_base_port,
    run_with_faults,
    write_during,
)

MOVED_SLOTS = 24  # redis-cli moves a source's lowest slots first: 0-23
# A head replaced mid-reshard makes redis-cli stop, as against Redis when a
# master fails over; on a loaded machine the tests' usual 0.7 s failure
# timeout replaces heads now and then, so these clusters suspect later.
FAILURE_TIMEOUT_MS = 5000


def tagged_keys(prefix, count, below=MOVED_SLOTS):
    """`count` keys whose slots are below `below` (found through hash tags)."""
    keys, tag = [], 0
    while len(keys) < count:
        tag += 1
        if key_slot(str(tag).encode()) < below:
            keys.append(f"{prefix}{{{tag}}}")
    return keys


def redis_cli(*args, timeout=600):
    result = subprocess.run(["redis-cli", *args], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def node_ids(ports):
    return [redis.Redis(port=port).execute_command("CLUSTER", "MYID").decode() for port in ports]


def slot_owners(port):
    """Slot -> the port of the node CLUSTER NODES names as its master."""
    owners = {}
    for line in redis.Redis(port=port).execute_command("CLUSTER", "NODES").decode().splitlines():
        fields = line.split()
        node_port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
        for part in fields[8:]:
            if part.startswith("["):
                continue
            first, _, last = part.partition("-")
            for slot in range(int(first), int(last or first) + 1):
                owners[slot] = node_port
    return owners


@pytest.fixture
def redis_cluster(tmp_path):
    """Three real redis-server masters, created as a cluster by redis-cli."""
    base = free_base_port(3)  # each with its bus port (+10000) free
    ports = [base + 1 + index for index in range(3)]
    processes = [
        subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", f"nodes-{port}.conf", "--save", "", "--appendonly", "no",
             "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for port in ports
    ]
    try:
        for port in ports:
            wait_for_ping(port)
        redis_cli("--cluster", "create", *[f"127.0.0.1:{port}" for port in ports], "--cluster-replicas", "0",
                  "--cluster-yes")
        deadline = time.time() + 30
        while not all(b"cluster_state:ok" in redis.Redis(port=port).execute_command("CLUSTER", "INFO")
                      for port in ports):
            assert time.time() < deadline, "the Redis cluster did not come up"
            time.sleep(0.1)
        yield ports
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=10)


def run_script(ports, data):
    """The same resharding commands against a cluster on `ports`; replies
    with node names and ports written as N0..N2 and P0..P2."""
    ids = node_ids(ports)
    connections = [redis.Redis(port=port, socket_timeout=120) for port in ports]
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", ports[0])])
    for start in range(0, len(data), 1000):
        pipe = client.pipeline()
        for key in list(data)[start:start + 1000]:
            pipe.set(key, data[key])
        pipe.execute()

    def normal(reply):
        if isinstance(reply, (list, tuple)):
            return [normal(item) for item in reply]
        text = reply.decode() if isinstance(reply, bytes) else str(reply)
        for index, (node_id, port) in enumerate(zip(ids, ports)):
            text = text.replace(node_id, f"N{index}").replace(str(port), f"P{index}")
        return text

    def run(node, *command):
        try:
            return normal(connections[node].execute_command(*command))
        except redis.ResponseError as error:
            return "error: " + normal(str(error))

    def open_marks(node):
        line = next(line for line in run(node, "CLUSTER", "NODES").splitlines() if "myself" in line)
        return re.findall(r"\[[^\]]*\]", line)

    p1 = str(ports[1])
    b_slot = key_slot(b"b")  # 3300: the first node's in both layouts
    replies = [
        run(0, "CLUSTER", "SETSLOT", "100"),
        run(0, "CLUSTER", "SETSLOT", "100", "NODE", "abcdef"),
        run(0, "CLUSTER", "SETSLOT", "100", "IMPORTING", "abcdef"),
        run(1, "CLUSTER", "SETSLOT", "100", "IMPORTING", "abcdef"),
        run(1, "CLUSTER", "SETSLOT", "100", "MIGRATING", ids[0]),
        run(0, "CLUSTER", "SETSLOT", "100000", "STABLE"),
        run(0, "CLUSTER", "SETSLOT", "abc", "STABLE"),
        run(0, "CLUSTER", "SETSLOT", "100", "FOO"),
        run(0, "CLUSTER", "GETKEYSINSLOT", "100", "-1"),
        run(0, "CLUSTER", "GETKEYSINSLOT", "x", "1"),
        run(0, "CLUSTER", "GETKEYSINSLOT", "100"),
        run(0, "CLUSTER", "COUNTKEYSINSLOT", "16384"),
        run(0, "CLUSTER", "COUNTKEYSINSLOT", "x"),
        run(0, "MIGRATE", "127.0.0.1", p1, "k", "0", "1000", "KEYS", "a"),
        run(0, "MIGRATE", "127.0.0.1", p1, "", "0", "1000", "KEYS", "a", "b"),
        run(0, "MIGRATE", "127.0.0.1", p1, "", "0", "1000", "KEYS"),
        run(0, "MIGRATE", "127.0.0.1", p1, "", "x", "1000", "KEYS", "a"),
        run(0, "MIGRATE", "127.0.0.1", p1, "", "0", "1000", "KEYS", "x"),
        run(0, "MIGRATE", "127.0.0.1", p1, "", "0", "1000", "FOO"),
        run(0, "MIGRATE", "127.0.0.1", p1, "", "1", "1000", "KEYS", "b"),
        run(0, "MIGRATE", "127.0.0.1", p1, "", "0", "1000", "KEYS", "b"),
        run(0, "MIGRATE", "127.0.0.1", p1, "nothing-here", "0", "1000"),
        [run(0, "CLUSTER", "COUNTKEYSINSLOT", str(slot)) for slot in range(0, 5000, 97)],
        sorted(run(0, "CLUSTER", "GETKEYSINSLOT", str(b_slot), "1000")),
        # A slot moved by hand, as redis-cli moves one.
        run(1, "CLUSTER", "SETSLOT", str(b_slot), "IMPORTING", ids[0]),
        run(0, "CLUSTER", "SETSLOT", str(b_slot), "MIGRATING", ids[1]),
        open_marks(0),
        open_marks(1),
        run(0, "MIGRATE", "127.0.0.1", p1, "", "0", "5000", "REPLACE", "KEYS",
            *connections[0].execute_command("CLUSTER", "GETKEYSINSLOT", b_slot, 1000)),
        run(0, "CLUSTER", "GETKEYSINSLOT", str(b_slot), "10"),
        [run(node, "CLUSTER", "SETSLOT", str(b_slot), "NODE", ids[1]) for node in range(3)],
        open_marks(0),
        open_marks(1),
        run(1, "CLUSTER", "COUNTKEYSINSLOT", str(b_slot)),
        run(0, "CLUSTER", "COUNTKEYSINSLOT", str(b_slot)),
        # A slot opened and closed again: nothing moves.
        run(1, "CLUSTER", "SETSLOT", "200", "IMPORTING", ids[0]),
        run(0, "CLUSTER", "SETSLOT", "200", "MIGRATING", ids[1]),
        run(0, "CLUSTER", "SETSLOT", "200", "STABLE"),
        run(1, "CLUSTER", "SETSLOT", "200", "STABLE"),
        open_marks(0),
        open_marks(1),
        run(0, "CLUSTER", "COUNTKEYSINSLOT", "200"),
    ]
    # redis-cli's own resharding of the first node's lowest slots.
    redis_cli("--cluster", "reshard", f"127.0.0.1:{ports[0]}", "--cluster-from", ids[0], "--cluster-to", ids[1],
              "--cluster-slots", str(MOVED_SLOTS), "--cluster-yes")
    owners = slot_owners(ports[2])
    replies.append([owners[slot] == ports[1] for slot in list(range(MOVED_SLOTS)) + [b_slot]])
    replies.append([run(1, "CLUSTER", "COUNTKEYSINSLOT", str(slot)) for slot in range(MOVED_SLOTS)])
    check = redis_cli("--cluster", "check", f"127.0.0.1:{ports[2]}")
    replies.append(["[OK] All nodes agree" in check, "[OK] All 16384 slots covered" in check])
    values = client.mget_nonatomic(list(data))
    replies.append([value.decode() if value else None for value in values] == list(data.values()))
    client.close()
    return replies


def test_resharding_commands_answer_as_redis_cluster_does(cluster_factory, redis_cluster):
    """The same commands, on the same keys, to a Redis Cluster of three
    masters and a Tessera cluster of three groups (one headed by each node):
    the same replies, the same slots moved and the same keys in them."""
    data = {f"key:{index}": f"value-{index}" for index in range(20000)} | {"b": "bee"}
    tessera = cluster_factory("strong", nodes=3, failure_timeout_ms=FAILURE_TIMEOUT_MS, options=("--groups", "3"))
    expected = run_script(redis_cluster, data)
    got = run_script([tessera.port(node) for node in range(3)], data)
    differences = [(index, want, have) for index, (want, have) in enumerate(zip(expected, got)) if want != have]
    assert not differences, "\n".join(f"step {index}: redis {want!r}, tessera {have!r}"
                                      for index, want, have in differences)
    assert expected[-4] == [True] * (MOVED_SLOTS + 1) and expected[-1] is True


@pytest.mark.parametrize("topology", ["ms", "aa"])
def test_redis_cli_reshards_and_rebalances_a_strong_cluster_under_load(cluster_factory, tmp_path, topology):
    """redis-cli moves slots out of the first node and rebalances them back
    while cluster and plain clients read and write keys of those slots: no
    request fails for good and the history is linearizable."""
    cluster = cluster_factory("strong", nodes=3, topology=topology, failure_timeout_ms=FAILURE_TIMEOUT_MS,
                              options=("--groups", "6"))
    ports = [cluster.port(node) for node in range(3)]
    ids = node_ids(ports)
    moved = tagged_keys("reg:", 12)
    keys = moved + [f"reg:{index}" for index in range(12)]

    def reshard():
        redis_cli("--cluster", "reshard", f"127.0.0.1:{ports[0]}", "--cluster-from", ids[0],
                  "--cluster-to", ids[1], "--cluster-slots", str(MOVED_SLOTS), "--cluster-yes")
        owners = slot_owners(ports[2])
        assert all(owners[slot] == ports[1] for slot in range(MOVED_SLOTS)), "the slots are the second node's"
        time.sleep(1.0)

    def rebalance():
        output = redis_cli("--cluster", "rebalance", f"127.0.0.1:{ports[1]}", "--cluster-threshold", "0.1")
        assert "Moving" in output, output
        time.sleep(1.0)

    recorders, keys, marks = run_with_faults(cluster, [reshard, rebalance], clients=3, plain_clients=2,
                                             key_names=keys)
    assert_served_and_linearizable(cluster, tmp_path, recorders, keys, marks)
    check = redis_cli("--cluster", "check", f"127.0.0.1:{ports[0]}")
    assert "[OK] All nodes agree" in check and "[OK] All 16384 slots covered" in check, check
    counts = [sum(1 for owner in slot_owners(ports[0]).values() if owner == port) for port in ports]
    assert max(counts) - min(counts) <= 20, counts
    cluster_map = cluster.map()
    assert not cluster_map.get("open_slots") and not cluster_map.get("migrations")
    assert_replicas_converge(cluster, keys)


@pytest.mark.parametrize("topology", ["ms", "aa"])
def test_redis_cli_reshards_an_eventual_cluster_without_losing_an_acknowledged_write(cluster_factory, topology):
    """MS+EC and AA+EC: writers on every node write keys of the slots
    redis-cli moves; every acknowledged write is there after."""
    cluster = cluster_factory("eventual", nodes=3, topology=topology, failure_timeout_ms=FAILURE_TIMEOUT_MS,
                              options=("--groups", "3"))
    ports = [cluster.port(node) for node in range(3)]
    ids = node_ids(ports)
    tags = tagged_keys("", 40)

    def reshard():
        redis_cli("--cluster", "reshard", f"127.0.0.1:{ports[0]}", "--cluster-from", ids[0], "--cluster-to", ids[1],
                  "--cluster-slots", str(MOVED_SLOTS), "--cluster-yes")

    acknowledged, _ = write_during(cluster, reshard, lambda node, sequence: f"{tags[sequence % len(tags)]}:w{node}:{sequence}")
    assert all(owner == ports[1] for slot, owner in slot_owners(ports[2]).items() if slot < MOVED_SLOTS)
    assert len(acknowledged) > 300, f"a real test: {len(acknowledged)} acknowledged writes in the moved slots"
    assert_acknowledged_writes_kept(cluster, acknowledged)


def test_redis_cli_imports_a_redis_server_into_the_cluster(cluster_factory, redis_server):
    """`redis-cli --cluster import` moves a Redis server's keys into a
    Tessera cluster with MIGRATE from the Redis side, which sends each key to
    its slot's node as RESTORE: every type arrives, deadlines included, and
    the cluster's replicas hold them."""
    cluster = cluster_factory("strong", nodes=3)
    source = redis.Redis(port=redis_server)
    strings = {f"string:{n}": str(n * 7) for n in range(300)}
    source.mset(strings)
    source.rpush("list", *[f"element-{n}" for n in range(1000)])
    source.sadd("intset", *range(50))
    source.sadd("set", *[f"member-{n}" for n in range(300)])
    source.hset("hash", mapping={f"field-{n}": n for n in range(300)})
    source.zadd("zset", {f"member-{n}": n / 4 for n in range(300)})
    source.set("expiring", "soon", ex=1000)
    output = redis_cli("--cluster", "import", f"127.0.0.1:{cluster.port(0)}",
                       "--cluster-from", f"127.0.0.1:{redis_server}", "--cluster-copy")
    plain = re.sub(r"\x1b\[[0-9;]*m", "", output)  # redis-cli colours its report
    assert len(re.findall(r"^Migrating .*: OK$", plain, re.MULTILINE)) == len(strings) + 6, plain[-2000:]
    client = cluster.client(socket_timeout=10)
    assert [client.get(key) for key in strings] == [value.encode() for value in strings.values()]
    assert client.lrange("list", 0, -1) == source.lrange("list", 0, -1)
    assert client.smembers("intset") == source.smembers("intset")
    assert client.smembers("set") == source.smembers("set")
    assert client.hgetall("hash") == source.hgetall("hash")
    assert client.zrange("zset", 0, -1, withscores=True) == source.zrange("zset", 0, -1, withscores=True)
    assert 990 <= client.ttl("expiring") <= 1000
    assert_replicas_converge(cluster, list(strings)[:20] + ["expiring"])
