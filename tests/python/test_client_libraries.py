"""The cluster clients people use against a real Tessera cluster: go-redis v9,
ioredis, node-redis, Jedis, Lettuce and redis-rs (redis-py has tests of its
own throughout) each run tests/clients' workload, which checks every reply as
it goes and reads everything back at the end, while the cluster loses a node
and its table switches from master–slave to active–active. Built by
scripts/build-client-workloads.sh (the test command runs it)."""

import json
import os
import subprocess
import threading
import time

import pytest
import redis

from conftest import ROOT
from test_cluster import cluster_factory  # noqa: F401 - a fixture

BUILT = ROOT / "target" / "clients"
SECONDS = 12


def workload_commands(nodes):
    java_classpath = f"{ROOT / 'tests/clients/java/target/classes'}:{(BUILT / 'java-classpath.txt').read_text().strip()}"
    node_script = str(ROOT / "tests/clients/node/workload.mjs")
    java = ["java", "-cp", java_classpath, "tessera.Workload"]
    return {
        "go-redis": [str(BUILT / "go-redis-workload"), "--nodes", nodes, "--seconds", str(SECONDS)],
        "ioredis": ["node", node_script, "ioredis", nodes, str(SECONDS)],
        "node-redis": ["node", node_script, "node-redis", nodes, str(SECONDS)],
        "jedis": [*java, "jedis", nodes, str(SECONDS)],
        "lettuce": [*java, "lettuce", nodes, str(SECONDS)],
        "redis-rs": [str(BUILT / "redis-rs-workload"), nodes, str(SECONDS)],
    }


def test_the_popular_cluster_clients_keep_their_data_through_a_failover_and_a_mode_switch(cluster_factory, tmp_path):
    if not (BUILT / "java-classpath.txt").exists():
        if os.environ.get("TESSERA_REQUIRE_EXTERNAL") == "1":
            pytest.fail("the client workloads are not built; run scripts/build-client-workloads.sh")
        pytest.skip("the client workloads are not built (scripts/build-client-workloads.sh)")
    cluster = cluster_factory("strong", nodes=3)
    nodes = ",".join(f"127.0.0.1:{cluster.port(node)}" for node in range(3))
    # Output to files: a client that logs much (Lettuce does, at each
    # reconnection) must not wait for a pipe nobody is reading yet.
    outputs = {name: (tmp_path / f"{name}.out", tmp_path / f"{name}.err") for name in workload_commands(nodes)}
    runs = {
        name: subprocess.Popen(command, stdout=outputs[name][0].open("w"), stderr=outputs[name][1].open("w"))
        for name, command in workload_commands(nodes).items()
    }

    # Once every client is well under way: a node killed (its groups fail
    # over), then the table switched to active–active while they write.
    time.sleep(4)
    cluster.cli("kill", "1")
    time.sleep(3)
    switched = []
    node = redis.Redis(port=cluster.port(0), socket_timeout=60)
    switch = threading.Thread(target=lambda: switched.append(
        node.execute_command("TABLE.ALTER", "default", "TOPOLOGY", "aa", "CONSISTENCY", "strong")))
    switch.start()

    deadline = time.time() + SECONDS + 90
    for name, run in runs.items():
        try:
            run.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for other in runs.values():
                other.kill()
            pytest.fail(f"{name} did not finish: {outputs[name][1].read_text()[-3000:]}")
    switch.join(timeout=60)
    assert switched == [b"OK"], "TABLE.ALTER did not finish"
    for name, run in runs.items():
        stdout, stderr = (path.read_text() for path in outputs[name])
        assert run.returncode == 0, f"{name} exited with {run.returncode}: {stderr[-3000:]}"
        summary = json.loads(stdout.strip().splitlines()[-1])
        assert summary["client"] == name
        assert summary["ops"] >= 200, f"{name} did too little: {summary}"
    shard_modes = {shard["mode"] for shard in cluster.map()["shards"]}
    assert shard_modes == {"quorum"}, f"the table did not end active–active: {shard_modes}"
