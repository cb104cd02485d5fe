#!/usr/bin/env python3
"""Moving a third of the slots, holding about 1 GB of records, from one
group to another while clients run: Tessera (`tessera cluster move-slots`)
against a Redis Cluster of three masters and three replicas (Debian's
redis-server) resharded with `redis-cli --cluster reshard`, one after the
other in one run, on the same data.

Both clusters keep two copies of every slot (Tessera: 3 nodes, 3 groups of 2
replicas; Redis: 3 masters, 1 replica each). The records (`--keys` strings of
`--value-bytes`, all in slots 0-5460, which the first master and Tessera's
first group own) are loaded with `redis-cli --pipe`; then `tessera bench
--cluster` (YCSB A over its own 10,000 records in every slot, 8 connections)
runs in 5 s rounds from before the move until after it, and the move is
timed. Prints per system: the move's time, keys/s and MB/s, the clients'
throughput and errors during the move, and whether every moved key reads
back at the target (a sample of 2,000).

    scripts/measure-reshard-vs-redis.py [--keys 1000000] [--value-bytes 1024] [--mode ms+ec] [--redis-pipeline 10]
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis
from redis.crc import key_slot

sys.path.insert(0, str(Path(__file__).resolve().parent))
from importlib import import_module

failover = import_module("measure-failover")
sys.path.insert(0, str(failover.ROOT / "tests" / "python"))
from conftest import wait_for_ping  # noqa: E402  (the tests' own wait for a server)

MOVED = range(0, 5461)  # the first master's slots in a Redis Cluster of three
BENCH_ROUND_S = 5


def moved_keys(count):
    """`count` key names whose slots are in MOVED."""
    keys, index = [], 0
    while len(keys) < count:
        key = f"mv:{index}"
        if key_slot(key.encode()) <= MOVED[-1]:
            keys.append(key)
        index += 1
    return keys


def load(port, keys, value_bytes):
    """SET every key (a value of `value_bytes`) through `redis-cli --pipe`."""
    value = (b"v" * value_bytes)
    pipe = subprocess.Popen(["redis-cli", "-p", str(port), "--pipe"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    batch = []
    for key in keys:
        name = key.encode()
        batch.append(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(name), name, len(value), value))
        if len(batch) == 1000:
            pipe.stdin.write(b"".join(batch))
            batch = []
    pipe.stdin.write(b"".join(batch))
    pipe.stdin.close()
    output = pipe.stdout.read().decode()
    if pipe.wait() != 0 or "errors: 0" not in output:
        sys.exit(f"loading failed: {output}")


def owner_port(port, slot):
    """The port of the node CLUSTER SLOTS names as `slot`'s master."""
    for first, last, master, *_ in redis.Redis(port=port).execute_command("CLUSTER", "SLOTS"):
        if first <= slot <= last:
            return int(master[1])
    raise RuntimeError(f"slot {slot} has no owner")


class BenchRounds(threading.Thread):
    """`tessera bench --cluster` in rounds of a few seconds until stopped;
    each round's report is kept."""

    def __init__(self, seed_port, directory):
        super().__init__(daemon=True)
        self.seed_port, self.directory = seed_port, directory
        self.stop = threading.Event()
        self.rounds = []  # (started, report)

    def command(self, *extra):
        return [str(failover.BINARY), "bench", "--cluster", "--target", f"127.0.0.1:{self.seed_port}",
                "--workload", "A", "--records", "10000", "--connections", "8", "--threads", "1",
                "--quiet", *extra]

    def load(self):
        subprocess.run(self.command("--phase", "load"), check=True, capture_output=True)

    def run(self):
        index = 0
        while not self.stop.is_set():
            report = self.directory / f"bench-{index}.json"
            started = time.time()
            subprocess.run(self.command("--phase", "run", "--duration", str(BENCH_ROUND_S), "--json", str(report)),
                           check=True, capture_output=True)
            self.rounds.append((started, json.loads(report.read_text())))
            index += 1

    def during(self, start, end):
        """Operations per second and errors of the rounds that overlap [start, end]."""
        overlapping = [report for started, report in self.rounds
                       if started < end and started + BENCH_ROUND_S > start]
        seconds = [count for report in overlapping for count in report["per_second"]]
        errors = sum(sum(report["errors"].values()) for report in overlapping)
        return (sum(seconds) / len(seconds) if seconds else 0.0), errors


def wait_until_in_sync(ports):
    """Until no node of `ports` is loading and every replica's link is up
    and holds everything its master sent (a fast load can outrun a Redis
    replica's output buffer and send it through a full resynchronisation)."""
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            infos = [redis.Redis(port=port).info() for port in ports]
        except redis.BusyLoadingError:
            infos = None
        if infos and not any(info.get("loading") for info in infos):
            offsets = {port: info.get("master_repl_offset", 0) for port, info in zip(ports, infos)}
            replicas = [info for info in infos if info.get("role") == "slave"]
            if all(info.get("master_link_status") == "up"
                   and info.get("slave_repl_offset", -1) >= offsets.get(info.get("master_port"), 0)
                   for info in replicas):
                return
        time.sleep(0.5)
    raise RuntimeError("the replicas did not catch up")


def measure(name, seed_port, source_port, move, keys, value_bytes, directory, settle=lambda: None):
    """Loads the keys at `source_port`, runs the clients, times `move()`;
    returns the figures."""
    started = time.time()
    load(source_port, keys, value_bytes)
    settle()
    print(f"{name}: loaded {len(keys)} keys in {time.time() - started:.1f} s", flush=True)
    bench = BenchRounds(seed_port, directory)
    bench.load()
    bench.start()
    time.sleep(BENCH_ROUND_S + 1)
    before, _ = bench.during(0, time.time())
    start = time.time()
    move()
    took = time.time() - start
    time.sleep(BENCH_ROUND_S + 1)
    bench.stop.set()
    bench.join()
    during, errors = bench.during(start, start + took)
    settle()
    client = redis.RedisCluster(host="127.0.0.1", port=seed_port)
    sample = random.Random(1).sample(keys, min(2000, len(keys)))
    values = client.mget_nonatomic(sample)
    missing = sum(1 for value in values if value is None or len(value) != value_bytes)
    target = owner_port(seed_port, 0)
    client.close()
    megabytes = len(keys) * (value_bytes + len(keys[-1])) / 1e6
    print(f"{name}: moved {len(keys)} keys ({megabytes:.0f} MB) in {took:.1f} s: {len(keys) / took:,.0f} keys/s, "
          f"{megabytes / took:.1f} MB/s; clients {before:,.0f} ops/s before, {during:,.0f} during, "
          f"{errors} errors; slot 0 now served by port {target} (was {source_port}); "
          f"{missing} of {len(sample)} sampled keys missing", flush=True)
    return {"took": took, "keys_per_s": len(keys) / took, "mb_per_s": megabytes / took, "before": before,
            "during": during, "errors": errors, "missing": missing}


def redis_cluster(directory, keys, value_bytes, pipeline):
    base = failover.free_base_port(6)
    ports = [base + 1 + index for index in range(6)]
    processes = [subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
         "--cluster-config-file", f"nodes-{port}.conf", "--save", "", "--appendonly", "no",
         "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for port in ports]
    try:
        for port in ports:
            wait_for_ping(port)
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{port}" for port in ports],
                        "--cluster-replicas", "1", "--cluster-yes"], check=True, capture_output=True)
        while not all(b"cluster_state:ok" in redis.Redis(port=port).execute_command("CLUSTER", "INFO")
                      for port in ports):
            time.sleep(0.1)
        source, target = owner_port(ports[0], 0), owner_port(ports[0], MOVED[-1] + 1)
        ids = {int(line.split()[1].split("@")[0].rsplit(":", 1)[1]): line.split()[0] for line in
               redis.Redis(port=ports[0]).execute_command("CLUSTER", "NODES").decode().splitlines()}

        def move():
            result = subprocess.run(
                ["redis-cli", "--cluster", "reshard", f"127.0.0.1:{source}", "--cluster-from", ids[source],
                 "--cluster-to", ids[target], "--cluster-slots", str(len(MOVED)), "--cluster-yes",
                 "--cluster-pipeline", str(pipeline)], capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"redis-cli --cluster reshard failed: {result.stdout[-2000:]}{result.stderr}")

        return measure(f"Redis Cluster (redis-cli reshard, pipeline {pipeline})", ports[0], source, move, keys,
                       value_bytes, directory, settle=lambda: wait_until_in_sync(ports))
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)


def tessera_cluster(directory, keys, value_bytes, mode):
    base = failover.free_base_port(4)
    cli = failover.cluster_cli(directory / "cluster")
    cli("up", "--nodes", "3", "--groups", "3", "--replicas", "2", *failover.mode_flags(mode), "--base-port", str(base),
        "--no-demo")
    try:
        seed = base + 1
        source = owner_port(seed, 0)

        def move():
            cli("move-slots", "0", "1", f"{MOVED[0]}-{MOVED[-1]}")

        return measure(f"Tessera {mode} (cluster move-slots)", seed, source, move, keys, value_bytes, directory)
    finally:
        cli("down")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--value-bytes", type=int, default=1024)
    parser.add_argument("--mode", default="ms+ec", choices=["ms+sc", "ms+ec", "aa+sc", "aa+ec"])
    parser.add_argument("--redis-pipeline", type=int, default=10, help="redis-cli's keys per MIGRATE")
    args = parser.parse_args()
    keys = moved_keys(args.keys)
    root = Path(tempfile.mkdtemp(prefix="tessera-reshard-vs-redis-"))
    (root / "redis").mkdir()
    (root / "tessera").mkdir()
    theirs = redis_cluster(root / "redis", keys, args.value_bytes, args.redis_pipeline)
    ours = tessera_cluster(root / "tessera", keys, args.value_bytes, args.mode)
    print(f"Tessera / Redis Cluster: move rate {ours['keys_per_s'] / theirs['keys_per_s']:.2f}x, "
          f"client throughput during the move {ours['during'] / max(theirs['during'], 1):.2f}x; "
          f"client errors {ours['errors']} / {theirs['errors']}")


if __name__ == "__main__":
    main()
