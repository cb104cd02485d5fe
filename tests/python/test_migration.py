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
    reader = cluster.client(socket_timeout=30).pipeline()
    for key in bulk:
        reader.get(key)
    found = dict(zip(bulk, reader.execute()))
    missing = [key for key, value in bulk.items() if found[key] != value.encode()]
    assert not missing, f"{len(missing)} of {len(bulk)} keys lost or changed by the moves, e.g. {missing[:3]}"


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
