"""Causal consistency across datacenters with real processes: `tessera
cluster up --datacenters 2` (two datacenters of three nodes, a one-way delay
injected between them), redis-py clients in each datacenter keeping causal
sessions (CONSISTENCY CAUSAL) and writing chains of causally related keys (a
post, a comment on it, a reply to the comment). The recorded history goes to
the simulator's causal checker (`tessera check-causal`), which the simulator
shows catching each protocol's broken variant (`tessera sim --protocol
broken-cops-no-dependency-checks`, crates/tessera-sim/src/geo.rs)."""

import json
import os
import random
import signal
import subprocess
import threading
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from conftest import BINARY
from test_cluster import LocalCluster, cluster_factory, now_us  # noqa: F401 - cluster_factory is a fixture

DATACENTERS = 2
NODES = 6
DELAY_MS = 40
CHAINS = 4


@pytest.fixture
def geo_cluster(tmp_path):
    clusters = []

    def make(protocol, delay_ms=DELAY_MS):
        cluster = LocalCluster(tmp_path / protocol, protocol, topology="aa", options=[
            "--datacenters", str(DATACENTERS), "--datacenter-delay-ms", str(delay_ms)])
        clusters.append(cluster)
        return cluster.up(NODES)

    yield make
    for cluster in clusters:
        cluster.down()


def datacenter_of(node):
    return node // (NODES // DATACENTERS)


def session(cluster, node):
    """A plain client on `node`, in a causal session; it never sends a
    command twice (an unknown outcome is recorded as such)."""
    client = redis.Redis(port=cluster.port(node), socket_timeout=5, protocol=2, retry=Retry(NoBackoff(), 0))
    assert client.execute_command("CONSISTENCY", "CAUSAL") == b"OK"
    return client


class Chains(threading.Thread):
    """One session: reads a chain's keys and writes the next one in the chain
    (a comment once it has read a post, a reply once it has read a comment),
    or starts a new post in a chain of its datacenter; every value is unique.
    Records what it did."""

    def __init__(self, cluster, number, node, stop):
        super().__init__(daemon=True)
        self.client = session(cluster, node)
        self.number, self.datacenter, self.stop_event = number, datacenter_of(node), stop
        self.history, self.errors = [], []

    def record(self, key, call, invoked, **fields):
        self.history.append({"session": self.number, "datacenter": self.datacenter, "key": key, "call": call,
                             "invoked": invoked, "completed": now_us(), **fields})

    def put(self, key, value):
        invoked = now_us()
        try:
            self.client.set(key, value)
            self.record(key, "put", invoked, value=value, acknowledged=True)
        except (redis.ConnectionError, redis.TimeoutError) as error:
            self.errors.append(repr(error))
            self.record(key, "put", invoked, value=value, acknowledged=False)

    def get(self, key):
        invoked = now_us()
        value = self.client.get(key)
        read = None if value is None else value.decode()
        self.record(key, "get", invoked, read=read)
        return read

    def run(self):
        rng = random.Random(self.number)
        sequence = 0
        while not self.stop_event.is_set():
            chain = rng.randrange(CHAINS)
            post, comment, reply = (f"{kind}:{chain}" for kind in ("post", "comment", "reply"))
            sequence += 1
            value = f"s{self.number}-{sequence}"
            step = rng.random()
            if step < 0.2:
                # Each chain's posts come from one datacenter, so that the
                # other one's sessions read remote values whatever the load:
                # a key every session rewrites every few milliseconds shows
                # nothing older than the delay between datacenters.
                if chain % DATACENTERS == self.datacenter:
                    self.put(post, value)
                else:
                    self.get(post)
            elif step < 0.5:
                if self.get(post) is not None:
                    self.put(comment, value)
            else:
                # Newest first: a reply read shows its comment and post.
                self.get(reply)
                if self.get(comment) is not None:
                    self.put(reply, value)
                self.get(post)


def check_causal(tmp_path, history, datacenters):
    path = tmp_path / "causal-history.jsonl"
    path.write_text("".join(json.dumps(operation) + "\n" for operation in history))
    args = [str(BINARY), "check-causal", str(path)] + (["--datacenters"] if datacenters else [])
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


def run_sessions(cluster, seconds=4, round_number=0):
    """One session per node for `seconds`; the history they recorded."""
    stop = threading.Event()
    sessions = [Chains(cluster, round_number * NODES + node, node, stop) for node in range(NODES)]
    for each in sessions:
        each.start()
    time.sleep(seconds)
    stop.set()
    for each in sessions:
        each.join(timeout=30)
    history = [operation for each in sessions for operation in each.history]
    puts = [operation for operation in history if operation["call"] == "put"]
    # Values are "s<session>-<n>", and session s runs on node s % NODES.
    seen_remote = [operation for operation in history if operation["call"] == "get" and operation["read"]
                   and datacenter_of(int(operation["read"].split("-")[0][1:]) % NODES) != operation["datacenter"]]
    assert len(puts) > 200 and seen_remote, (len(puts), len(seen_remote))
    assert all(not each.errors for each in sessions), [each.errors for each in sessions]
    return history


@pytest.mark.parametrize("protocol", ["cops", "gentle-rain", "causal-spartan", "geo-eventual"])
def test_causal_sessions_in_two_datacenters_see_each_chain_in_order(geo_cluster, tmp_path, protocol):
    """Sessions in both datacenters write posts, comments on posts they read
    and replies to comments they read, each session on its own node: the
    history is causal (COPS: per datacenter too), and once writes stop every
    key reads the same in both datacenters. The eventual baseline, whose
    writes from elsewhere show as they arrive, converges but is caught: the
    injected delay differs by sender, so one partition's writes overtake
    another's, and a reply shows before the comment it answers. Whether a
    session reads in that window is up to timing, so the baseline gets up to
    three rounds to be caught (a run usually shows a dozen violations)."""
    cluster = geo_cluster(protocol)
    if protocol == "geo-eventual":
        # Later rounds read what earlier ones wrote: the checker sees them all.
        history, verdicts = [], []
        for round_number in range(3):
            history += run_sessions(cluster, round_number=round_number)
            verdicts.append(check_causal(tmp_path, history, datacenters=False))
            if verdicts[-1].returncode != 0:
                break
        assert "NOT causal" in verdicts[-1].stderr, [verdict.stdout + verdict.stderr for verdict in verdicts]
    else:
        verdict = check_causal(tmp_path, run_sessions(cluster), datacenters=protocol == "cops")
        assert verdict.returncode == 0, verdict.stdout + verdict.stderr

    # Converged: each key alike in both datacenters.
    keys = [f"{kind}:{chain}" for kind in ("post", "comment", "reply") for chain in range(CHAINS)]
    readers = [redis.Redis(port=cluster.port(node), protocol=2) for node in (0, NODES - 1)]

    def shown():
        return [[reader.get(key) for key in keys] for reader in readers]

    deadline = time.time() + 10
    while (copies := shown())[0] != copies[1]:
        assert time.time() < deadline, copies
        time.sleep(0.05)


def test_tokens_carry_a_session_to_another_connection_and_refuse_forgeries(geo_cluster):
    """CAUSAL.TOKEN hands a session's context to another connection of the
    same datacenter, which then reads what the first session wrote; a token
    from another datacenter, or altered, is refused; causal levels are
    refused where nothing replicates causally; a causal session runs single
    commands and says the level it got."""
    cluster = geo_cluster("causal-spartan")
    first, second = session(cluster, 0), session(cluster, 1)
    first.set("post:token", "hello")
    token = first.execute_command("CAUSAL.TOKEN")
    assert second.execute_command("CAUSAL.TOKEN", "SET", token) == b"OK"
    assert second.get("post:token") == b"hello"
    assert second.execute_command("CONSISTENCY") == [b"causal", b"causal"]
    assert second.execute_command("CONSISTENCY.READ", "causal", "GET", "post:token") == [b"causal", b"hello"]

    elsewhere = session(cluster, NODES - 1)
    with pytest.raises(redis.ResponseError, match="another datacenter|datacenter 0"):
        elsewhere.execute_command("CAUSAL.TOKEN", "SET", token)
    forged = token[:-2] + (b"00" if token[-2:] != b"00" else b"11")
    with pytest.raises(redis.ResponseError, match="did not make"):
        second.execute_command("CAUSAL.TOKEN", "SET", forged)
    with pytest.raises(redis.ResponseError, match="not a causal token"):
        second.execute_command("CAUSAL.TOKEN", "SET", "xyz")
    with pytest.raises(redis.ResponseError, match="single commands"):
        second.eval("return 1", 0)
    # Reads in a causal session come through the protocol; eventual ones
    # read the datacenter's copy.
    plain = redis.Redis(port=cluster.port(NODES - 1), protocol=2)
    deadline = time.time() + 5
    while plain.get("post:token") != b"hello":
        assert time.time() < deadline
        time.sleep(0.02)
    assert plain.execute_command("CONSISTENCY.READ", "eventual", "GET", "post:token") == [b"eventual", b"hello"]


@pytest.mark.parametrize("protocol", ["cops", "gentle-rain", "causal-spartan", "geo-eventual"])
def test_a_key_set_again_in_another_datacenter_as_it_expires_keeps_the_new_value(geo_cluster, protocol):
    """Datacenter 0 writes keys with a time to live; once datacenter 1 shows
    them, and just before they expire, datacenter 1 sets them again with no
    time to live. Datacenter 0 expires its copies before those writes reach
    it (the one-way delay is longer than the time left). Its sweep retires
    the record it judged expired and no later one, so the new values win in
    both datacenters; a delete stamped when it swept would have outranked
    them and lost them everywhere."""
    delay_ms, ttl_ms = 500, 6000
    cluster = geo_cluster(protocol, delay_ms=delay_ms)
    here = redis.Redis(port=cluster.port(0), protocol=2, socket_timeout=5)
    copy = NODES // DATACENTERS
    there = redis.Redis(port=cluster.port(copy), protocol=2, socket_timeout=5)
    tag = next(tag for tag in "abcdefghij" if here.cluster("keyslot", f"{{{tag}}}") < 16384 // 3)
    keys = [f"{{{tag}}}session:{index}" for index in range(200)]

    written = time.time()
    pipe = here.pipeline(transaction=False)
    for key in keys:
        pipe.set(key, "old", px=ttl_ms)
    pipe.execute()
    while [there.get(key) for key in keys] != [b"old"] * len(keys):
        assert time.time() < written + (ttl_ms - 1000) / 1000, "datacenter 1 did not show the first values in time"
        time.sleep(0.05)
    # The new values leave datacenter 1 before the old ones expire, and
    # reach datacenter 0 (at least `delay_ms` later) after its sweep.
    time.sleep(max(0.0, written + (ttl_ms - 300) / 1000 - time.time()))
    pipe = there.pipeline(transaction=False)
    for key in keys:
        pipe.set(key, "new")
    pipe.execute()
    assert time.time() < written + ttl_ms / 1000, "the second writes were not all taken before the expiry"

    deadline = time.time() + 15
    while (shown := [[client.get(key) for key in keys] for client in (here, there)]) != [[b"new"] * len(keys)] * 2:
        assert time.time() < deadline, [sum(value == b"new" for value in copy) for copy in shown]
        time.sleep(0.1)
    assert int(here.info("stats")["expired_keys"]) > 0, "datacenter 0 expired nothing: the race was not run"


def test_causal_levels_are_refused_without_datacenters(cluster_factory):
    cluster = cluster_factory("eventual", nodes=3, topology="aa")
    client = redis.Redis(port=cluster.port(0), protocol=2)
    for command in (("CONSISTENCY", "CAUSAL"), ("CONSISTENCY.READ", "causal", "GET", "k"), ("CAUSAL.TOKEN",)):
        with pytest.raises(redis.ResponseError, match="across datacenters"):
            client.execute_command(*command)


def wait_until_shown(port, keys, timeout=20):
    """Until the node on `port`, perhaps still starting, shows key i of
    `keys` holding i."""
    client = redis.Redis(port=port, protocol=2, socket_timeout=5)
    expected = [str(index).encode() for index in range(len(keys))]
    deadline = time.time() + timeout
    while True:
        try:
            shown = [client.get(key) for key in keys]
        except (redis.ConnectionError, redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError):
            # Starting: not listening yet, without its map, or catching up.
            shown = None
        if shown == expected:
            return
        assert time.time() < deadline, shown
        time.sleep(0.1)


def test_writes_a_copy_held_unseen_when_killed_are_sent_again(tmp_path):
    """GentleRain keeps a write from elsewhere in memory until every
    partition of its datacenter has received up to its time. With one
    datacenter-1 partition stopped (SIGSTOP), that time stalls there, so
    datacenter-1's copy of partition 0 holds what datacenter 0 writes to
    it, unseen. Killed with kill -9 and started again over its data, it gets
    those writes once more: its sender kept them, since the copy had
    acknowledged them as delivered, not as stored."""
    cluster = LocalCluster(tmp_path, "gentle-rain", topology="aa", options=[
        "--datacenters", str(DATACENTERS), "--engine", "log"])
    cluster.up(NODES)
    stopped = None
    try:
        writer = redis.Redis(port=cluster.port(0), protocol=2)
        tag = next(tag for tag in "abcdefghij" if writer.cluster("keyslot", f"{{{tag}}}") < 16384 // 3)
        copy, stalling = NODES // DATACENTERS, NODES // DATACENTERS + 1
        writer.set(f"{{{tag}}}before", "b")
        copy_client = redis.Redis(port=cluster.port(copy), protocol=2, socket_timeout=5)
        deadline = time.time() + 10
        while copy_client.get(f"{{{tag}}}before") != b"b":
            assert time.time() < deadline
            time.sleep(0.05)

        stopped = cluster.pid(f"node-{stalling}")
        os.kill(stopped, signal.SIGSTOP)
        time.sleep(0.5)  # past the stable time's last gossip
        for index in range(20):
            writer.set(f"{{{tag}}}held-{index}", index)
        time.sleep(1)
        assert copy_client.get(f"{{{tag}}}held-19") is None, "the copy's stable time did not stall: nothing is held"

        cluster.cli("kill", str(copy))
        cluster.cli("restart", str(copy))
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        wait_until_shown(cluster.port(copy), [f"{{{tag}}}held-{index}" for index in range(20)])
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        cluster.down()


def test_writes_a_killed_partition_had_not_shipped_reach_the_other_datacenter(tmp_path):
    """With datacenter 1's copy of partition 0 down, datacenter 0's
    partition 0 takes writes it cannot ship; killed with kill -9 before the
    copy is back, it finds them in its engine when it starts again (past the
    horizon it keeps: what every copy has stored) and ships them, so the
    copy gets them once both are back."""
    cluster = LocalCluster(tmp_path, "cops", topology="aa", options=[
        "--datacenters", str(DATACENTERS), "--engine", "log"])
    cluster.up(NODES)
    try:
        writer = redis.Redis(port=cluster.port(0), protocol=2, socket_timeout=5)
        tag = next(tag for tag in "abcdefghij" if writer.cluster("keyslot", f"{{{tag}}}") < 16384 // 3)
        copy = NODES // DATACENTERS
        cluster.cli("kill", str(copy))
        for index in range(20):
            writer.set(f"{{{tag}}}unshipped-{index}", index)
        cluster.cli("kill", "0")
        cluster.cli("restart", "0")
        cluster.cli("restart", str(copy))
        wait_until_shown(cluster.port(copy), [f"{{{tag}}}unshipped-{index}" for index in range(20)])
        assert "ships again the writes it took past its horizon" in cluster.log("node-0")
    finally:
        cluster.down()


def test_a_copy_restarted_over_its_data_catches_up_and_is_caught_up_with(tmp_path):
    """On the log engine, a datacenter-1 copy killed with kill -9 misses the
    writes datacenter 0 takes meanwhile, gets them once it is back, and its
    own writes after the restart (a new stream, numbered from the start
    again) reach datacenter 0 rather than being taken for repeats."""
    cluster = LocalCluster(tmp_path, "causal-spartan", topology="aa", options=[
        "--datacenters", str(DATACENTERS), "--engine", "log"])
    cluster.up(NODES)
    try:
        first = redis.Redis(port=cluster.port(0), protocol=2)
        tag = next(tag for tag in "abcdefghij" if first.cluster("keyslot", f"{{{tag}}}") < 16384 // 3)
        copy = NODES // DATACENTERS  # datacenter 1's copy of partition 0
        restarted = redis.Redis(port=cluster.port(copy), protocol=2, socket_timeout=5)

        def eventually(check):
            """Until `check` holds; TRYAGAIN while the restarted copy takes its lease back."""
            deadline = time.time() + 10
            while True:
                try:
                    if check():
                        return
                except redis.exceptions.TryAgainError:
                    pass
                assert time.time() < deadline
                time.sleep(0.05)

        restarted.set(f"{{{tag}}}before", "b")
        eventually(lambda: first.get(f"{{{tag}}}before") == b"b")
        cluster.cli("kill", str(copy))
        for index in range(20):
            first.set(f"{{{tag}}}while-down-{index}", index)
        cluster.cli("restart", str(copy))
        eventually(lambda: restarted.get(f"{{{tag}}}while-down-19") == b"19")
        assert [restarted.get(f"{{{tag}}}while-down-{index}") for index in range(20)] == [
            str(index).encode() for index in range(20)]
        eventually(lambda: restarted.set(f"{{{tag}}}after", "a"))
        eventually(lambda: first.get(f"{{{tag}}}after") == b"a")
    finally:
        cluster.down()
