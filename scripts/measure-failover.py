#!/usr/bin/env python3
"""Time from a node's death to its shard serving writes again, on a local
cluster of real processes (`tessera cluster up`).

A writer sets a key of shard 0 every millisecond or so; the head of shard 0 is
killed with kill -9; the time from the kill to the next acknowledged write is one
sample. The node is restarted, the shard refilled to full replication, and the
next kill taken. Prints every sample and the median.

    scripts/measure-failover.py [--kills 7] [--consistency strong] [--lease-ms 1000] [--failure-timeout-ms 1500]
"""

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
BINARY = Path(os.environ.get("TESSERA_BIN", ROOT / "target" / "release" / "tessera"))


def free_base_port(count):
    def free(port):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False

    for _ in range(200):
        base = random.randrange(10000, 22000)  # peers (+10000) below the ephemeral range
        if all(free(port) and free(port + 10000) for port in range(base, base + count + 1)):
            return base
    raise RuntimeError("no free port range")


def cluster_cli(directory):
    """A function that runs `tessera cluster COMMAND... --dir directory` and
    fails on any error."""
    def cli(*command):
        return subprocess.run([str(BINARY), "cluster", *command, "--dir", str(directory)], check=True,
                              capture_output=True, text=True)
    return cli


def mode_flags(mode):
    """`cluster up`'s flags for a mode named as the tables name them (ms+sc,
    aa+ec, ...)."""
    topology, consistency = mode.split("+")
    return ["--topology", topology, "--consistency", "strong" if consistency == "sc" else "eventual"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=7)
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--consistency", default="strong")
    parser.add_argument("--lease-ms", type=int, default=1000)
    parser.add_argument("--failure-timeout-ms", type=int, default=1500)
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="tessera-failover-")) / "cluster"
    base = free_base_port(args.nodes + 1)

    cli = cluster_cli(directory)
    cli("up", "--nodes", str(args.nodes), "--groups", str(args.nodes), "--replicas", "3",
        "--consistency", args.consistency, "--base-port", str(base), "--lease-ms", str(args.lease_ms),
        "--failure-timeout-ms", str(args.failure_timeout_ms), "--no-demo")
    coordinator = redis.Redis(port=base, protocol=2)

    def shard_zero():
        return next(shard for shard in json.loads(coordinator.execute_command("COORD.MAP"))["shards"]
                    if shard["id"] == 0)

    def full():
        shards = json.loads(coordinator.execute_command("COORD.MAP"))["shards"]
        return all(len(shard["members"]) == 3 and not shard["learners"] for shard in shards)

    # A key of shard 0: its slot is in shard 0's ranges.
    probe = redis.Redis(port=base + 1, protocol=2)
    first, last = shard_zero()["slots"][0]
    key = next(f"failover:{index}" for index in range(100000)
               if first <= probe.execute_command("CLUSTER", "KEYSLOT", f"failover:{index}") <= last)

    samples = []
    try:
        for kill in range(args.kills):
            while not full():
                time.sleep(0.1)
            head = shard_zero()["members"][0]
            # Plain clients on every node: a node forwards to the head it knows.
            clients = [redis.Redis(port=base + 1 + node, protocol=2, socket_timeout=0.5)
                       for node in range(args.nodes) if node != head]
            pid = int((directory / "run" / f"node-{head}.pid").read_text())
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            served = None
            value = 0
            while served is None and time.monotonic() - killed < 30:
                for client in clients:
                    value += 1
                    try:
                        client.set(key, value)
                        served = time.monotonic()
                        break
                    except redis.RedisError:
                        pass
                time.sleep(0.001)
            if served is None:
                print(f"kill {kill + 1}: n{head} — shard 0 did not serve within 30 s", file=sys.stderr)
                sys.exit(1)
            samples.append((served - killed) * 1000)
            print(f"kill {kill + 1}: n{head} (head of shard 0) → writes again after {samples[-1]:.0f} ms")
            cli("restart", str(head))
    finally:
        subprocess.run([str(BINARY), "cluster", "down", "--dir", str(directory)], capture_output=True)
    print(f"median {statistics.median(samples):.0f} ms over {len(samples)} kills "
          f"(lease {args.lease_ms} ms, failure timeout {args.failure_timeout_ms} ms, "
          f"{args.consistency}, {args.nodes} nodes)")


if __name__ == "__main__":
    main()
