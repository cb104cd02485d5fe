"""Slots moving between groups while clients run (docs/PROTOCOLS.md, "Slot
migration"): `tessera cluster move-slots` against real node processes."""

import random
import threading
import time

import redis
from redis.crc import key_slot

from test_cluster import (
    assert_acknowledged_writes_kept,
    assert_replicas_converge,
    assert_served_and_linearizable,
    cluster_factory,  # noqa: F401  (a fixture)
    never_sent,
    run_with_faults,
    write_during,
)


def owner(cluster_map, slot):
    return next(shard["id"] for shard in cluster_map["shards"]
                if any(first <= slot <= last for first, last in shard["slots"]))


def keys_held(cluster):
    return sum(redis.Redis(port=cluster.port(node)).dbsize() for node in range(cluster.nodes))


def assert_values_kept(cluster, values):
    """Every key of `values` still reads back its value through a cluster client."""
    reader = cluster.client(socket_timeout=30).pipeline()
    for key in values:
        reader.get(key)
    found = dict(zip(values, reader.execute()))
    changed = [key for key, value in values.items() if found[key] != value.encode()]
    assert not changed, f"{len(changed)} of {len(values)} keys lost or changed, e.g. {changed[:3]}"


def move_slots(cluster, source, target, slots):
    def fault():
        result = cluster.cli("move-slots", str(source), str(target), slots)
        assert "done" in result.stdout, result.stdout + result.stderr

    fault.__name__ = f"move slots {slots} from group {source} to group {target}"
    return fault


def test_slots_move_between_groups_under_load_and_stay_linearizable(cluster_factory, tmp_path):
    """Two moves while cluster clients and plain clients read and write: no
    request fails for good, the history stays linearizable, every group's
    replicas agree, and the map and CLUSTER SLOTS name the new owners. Bulk
    data makes each copy take a while, so that owners swapped before the
    copy caught up would show in the history, and all of it is there after."""
    cluster = cluster_factory("strong", nodes=3, options=("--groups", "6"))
    bulk = {f"bulk:{index}": f"{index}:" + "x" * 1000 for index in range(40000)}
    loader = cluster.client(socket_timeout=30).pipeline()
    for key, value in bulk.items():
        loader.set(key, value)
    loader.execute()
    before = cluster.map()
    first, second = before["shards"][0]["slots"][0], before["shards"][1]["slots"][0]
    moved_ranges = [(first[0], first[1]), (second[0], (second[0] + second[1]) // 2)]
    faults = [
        move_slots(cluster, 0, 1, f"{first[0]}-{first[1]}"),
        move_slots(cluster, 1, 2, f"{moved_ranges[1][0]}-{moved_ranges[1][1]}"),
    ]
    recorders, keys, marks = run_with_faults(cluster, faults, clients=3, plain_clients=2)
    moved_keys = [key for key in keys if any(a <= key_slot(key.encode()) <= b for a, b in moved_ranges)]
    assert moved_keys, "a real test: some keys live in the slots that move"
    assert_served_and_linearizable(cluster, tmp_path, recorders, keys, marks)

    after = cluster.map()
    assert not after.get("migrations")
    assert owner(after, first[0]) == 1 and owner(after, first[1]) == 1
    assert owner(after, moved_ranges[1][0]) == 2 and owner(after, second[1]) == 1
    slots = redis.Redis(port=cluster.port(0)).execute_command("CLUSTER", "SLOTS")
    assert sum(last - first + 1 for first, last, *_ in slots) == 16384
    assert_replicas_converge(cluster, keys)
    assert_values_kept(cluster, bulk)


def test_an_eventual_active_active_cluster_keeps_every_acknowledged_write_through_a_move(cluster_factory):
    """AA+EC: any member takes writes, which reach the source's first member
    only by propagation; the cut drains them all before the slots move."""
    cluster = cluster_factory("eventual", nodes=3, topology="aa", options=("--groups", "3"))
    source_slots = cluster.map()["shards"][0]["slots"][0]
    before = keys_held(cluster)  # what `cluster up` wrote to check the slots
    acknowledged, attempted = write_during(
        cluster, move_slots(cluster, 0, 1, f"{source_slots[0]}-{source_slots[1]}"),
        lambda node, sequence: f"w{node}:{sequence}")
    cluster_map = cluster.map()
    assert owner(cluster_map, source_slots[0]) == 1
    moved = [key for key in acknowledged if source_slots[0] <= key_slot(key.encode()) <= source_slots[1]]
    assert len(moved) > 100, f"a real test: {len(moved)} acknowledged writes in the moved slots"
    assert_acknowledged_writes_kept(cluster, acknowledged)
    # The source deletes its copy of the moved keys: each node counts the
    # keys of the groups it heads, and no key twice.
    deadline = time.time() + 10
    while (held := keys_held(cluster)) > before + attempted:
        assert time.time() < deadline, f"{held} keys held for {before} + {attempted} written"
        time.sleep(0.2)


def test_a_cluster_grows_by_three_nodes_and_shrinks_by_two_while_clients_write_and_incr(
    cluster_factory, tmp_path
):
    """add-node starts three nodes; rebalance moves group replicas onto them
    (a learner catches up, then the replica it replaces leaves) and hands
    them heads (a drain, then the new head leads); remove-node moves every
    replica off a node and retires it, twice. Cluster clients and plain
    clients (on a node that stays) set, get and INCR throughout: no client
    sees an error, the history is linearizable, and every counter equals the
    INCRs acknowledged on it, each answer given once."""
    cluster = cluster_factory("strong", nodes=3, options=("--groups", "6"))
    counters = [f"counter:{index}" for index in range(6)]
    answers = {counter: [] for counter in counters}
    incr_errors = []
    stop_incrementing = threading.Event()

    def incrementer(client, seed):
        rng = random.Random(seed)
        while not stop_incrementing.is_set():
            counter = rng.choice(counters)
            try:
                answers[counter].append(client.incr(counter))
            except redis.RedisError as error:
                if not never_sent(error):  # else sent again, as by redis-py's default retry
                    incr_errors.append(f"{counter}: {error}")

    stays = 2  # plain clients connect to a node that is never removed
    incrementers = [
        threading.Thread(target=incrementer, args=(client, seed), daemon=True)
        for seed, client in enumerate([cluster.checked_client(), cluster.checked_client(),
                                       cluster.checked_client(stays), cluster.checked_client(stays)])
    ]
    for thread in incrementers:
        thread.start()

    def grow():
        result = cluster.cli("add-node", "--count", "3")
        assert result.stdout.count("added") == 3, result.stdout + result.stderr
        result = cluster.cli("rebalance")
        assert "balanced" in result.stdout, result.stdout + result.stderr
        print(result.stdout)
        time.sleep(1.0)  # service is checked in the half second before the next change

    def shrink(node):
        def fault():
            result = cluster.cli("remove-node", str(node))
            assert f"removed n{node}" in result.stdout, result.stdout + result.stderr
            time.sleep(1.0)

        fault.__name__ = f"remove n{node}"
        return fault

    recorders, keys, marks = run_with_faults(
        cluster, [grow, shrink(0), shrink(1)], clients=3, plain_clients=2, plain_on=stays,
    )
    stop_incrementing.set()
    for thread in incrementers:
        thread.join(timeout=60)
    errors = [error for recorder in recorders for error in recorder.errors] + incr_errors
    assert not errors, f"{len(errors)} client errors, e.g. {errors[:5]}"
    assert_served_and_linearizable(cluster, tmp_path, recorders, keys, marks)

    reader = cluster.client()
    for counter in counters:
        final = int(reader.get(counter) or 0)
        assert sorted(answers[counter]) == list(range(1, final + 1)), (
            f"{counter} is {final} after {len(answers[counter])} acknowledged INCRs"
        )
    assert sum(len(answered) for answered in answers.values()) > 200, "too few INCRs got through"

    cluster_map = cluster.map()
    assert [node["id"] for node in cluster_map["nodes"]] == [2, 3, 4, 5]
    for shard in cluster_map["shards"]:
        assert len(shard["members"]) == 3 and not {0, 1} & set(shard["members"]), shard
    cluster.nodes = 6  # ports of n2..n5
    assert_replicas_converge(cluster, keys + counters)


def fields_of(fields):
    """A slot's SLOT-STATS figures: a map in RESP3, pairs in RESP2."""
    return fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2]))


def slot_stats(cluster, metric):
    """Each slot's `metric` from CLUSTER SLOT-STATS on every node (a node
    answers for the groups it heads)."""
    totals = {}
    for node in range(cluster.nodes):
        for slot, fields in redis.Redis(port=cluster.port(node)).execute_command(
                "CLUSTER", "SLOT-STATS", "SLOTSRANGE", 0, 16383):
            named = fields_of(fields)
            totals[slot] = totals.get(slot, 0) + named[metric.encode()]
    return totals


def group_totals(cluster, per_slot):
    return {shard["id"]: sum(per_slot.get(slot, 0) for first, last in shard["slots"]
                             for slot in range(first, last + 1))
            for shard in cluster.map()["shards"]}


def test_rebalance_by_keys_and_by_load_evens_out_the_groups_and_keeps_every_key(cluster_factory):
    """Keys piled into one group's slots: `rebalance --by keys` moves slots
    until the groups hold within 10% of the mean, and every key keeps its
    value; then traffic on one group's keys alone: `rebalance --by load`
    moves slots away from it. CLUSTER SLOT-STATS answers as Redis 8 does."""
    cluster = cluster_factory("strong", nodes=3, options=("--groups", "3"))
    first_group = cluster.map()["shards"][0]
    slots_of_first = {slot for first, last in first_group["slots"] for slot in range(first, last + 1)}
    piled = [key for key in (f"k:{index}" for index in range(40000)) if key_slot(key.encode()) in slots_of_first]
    spread = [f"s:{index}" for index in range(3000)]
    values = {key: f"{key}=" + "v" * 64 for key in piled + spread}
    loader = cluster.client(socket_timeout=30).pipeline()
    for key, value in values.items():
        loader.set(key, value)
    loader.execute()

    node = redis.Redis(port=cluster.port(0))
    assert sum(slot_stats(cluster, "key-count").values()) == keys_held(cluster) >= len(values)
    top = node.execute_command("CLUSTER", "SLOT-STATS", "ORDERBY", "key-count", "LIMIT", 3)
    counts = [fields_of(fields)[b"key-count"] for _, fields in top]
    assert len(top) <= 3 and counts == sorted(counts, reverse=True)
    for bad in (("SLOTSRANGE", 5, 2), ("SLOTSRANGE", 0, 16384), ("ORDERBY", "bogus"), ("SLOTSRANGE", 0)):
        try:
            node.execute_command("CLUSTER", "SLOT-STATS", *bad)
            raise AssertionError(f"SLOT-STATS {bad} was accepted")
        except redis.ResponseError:
            pass

    result = cluster.cli("rebalance", "--by", "keys", "--threshold", "10")
    assert "moving" in result.stdout and "balanced" in result.stdout, result.stdout + result.stderr
    # Each node answers from its own map, which follows the coordinator's
    # a moment later: until then a moved slot may be counted twice.
    deadline = time.time() + 10
    while sum((per_slot := slot_stats(cluster, "key-count")).values()) != len(values) and time.time() < deadline:
        time.sleep(0.2)
    held = group_totals(cluster, per_slot)
    mean = len(values) / len(held)
    assert max(held.values()) - min(held.values()) <= mean * 0.1 + 50, held
    assert not cluster.map().get("migrations")
    assert_values_kept(cluster, values)
    again = cluster.cli("rebalance", "--by", "keys", "--threshold", "10")
    assert "moving" not in again.stdout, again.stdout

    # Load on the keys of one group only, while --by load measures it.
    busy_group = cluster.map()["shards"][1]
    busy_slots = {slot for first, last in busy_group["slots"] for slot in range(first, last + 1)}
    hot = [key for key in values if key_slot(key.encode()) in busy_slots][:200]
    stop = threading.Event()

    def hammer():
        client = cluster.client(socket_timeout=10)
        while not stop.is_set():
            client.get(random.choice(hot))

    worker = threading.Thread(target=hammer)
    worker.start()
    try:
        result = cluster.cli("rebalance", "--by", "load", "--window", "2", "--threshold", "20")
    finally:
        stop.set()
        worker.join()
    assert f"from group {busy_group['id']}" in result.stdout, result.stdout + result.stderr
    assert_values_kept(cluster, values)
