#!/usr/bin/env python3
"""Throughput of the same client load on clusters of different sizes: for
each node count, a fresh local cluster of real processes with the same
groups (12 by default, so that 3, 4 and 6 nodes head as many each) runs
`tessera bench --cluster` (YCSB, zipfian, 8 connections, one client thread)
for a while. Prints per cluster size the median throughput per second and
its ratio to the first size's, the p99 latency and the errors.

On one machine this shows what more processes cost, not what more machines
give: every node shares the same cores.

    scripts/measure-node-counts.py [--nodes 3,4,6] [--groups 12] [--workload A] [--duration 20]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from importlib import import_module

failover = import_module("measure-failover")


def run(nodes, args, directory):
    base = failover.free_base_port(nodes + 1)

    cli = failover.cluster_cli(directory)
    cli("up", "--nodes", str(nodes), "--groups", str(args.groups), "--replicas", "3", *failover.mode_flags(args.mode),
        "--base-port", str(base), "--no-demo")
    try:
        targets = ",".join(f"127.0.0.1:{base + 1 + node}" for node in range(nodes))
        bench = [str(failover.BINARY), "bench", "--cluster", "--target", targets, "--workload", args.workload,
                 "--distribution", "zipfian", "--records", str(args.records), "--connections", "8",
                 "--threads", "1", "--quiet"]
        report = directory / "bench.json"
        subprocess.run([*bench, "--phase", "load"], check=True, capture_output=True)
        subprocess.run([*bench, "--phase", "run", "--duration", str(args.duration), "--json", str(report)],
                       check=True, capture_output=True)
        return json.loads(report.read_text())
    finally:
        cli("down")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="3,4,6", help="node counts, comma-separated")
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--workload", default="A")
    parser.add_argument("--records", type=int, default=100000)
    parser.add_argument("--duration", type=int, default=20)
    parser.add_argument("--mode", default="ms+sc", choices=["ms+sc", "ms+ec", "aa+sc", "aa+ec"])
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tessera-node-counts-"))
    first = None
    for nodes in [int(count) for count in args.nodes.split(",")]:
        result = run(nodes, args, root / f"n{nodes}")
        median = statistics.median(result["per_second"][2:] or result["per_second"])
        first = first or median
        p99 = max(latency["p99_us"] for latency in result["latency"].values())
        print(f"{nodes} nodes, {args.groups} groups: median {median:,.0f} ops/s ({median / first:.2f} of the first), "
              f"p99 {p99 / 1000:.1f} ms, errors {sum(result['errors'].values())}", flush=True)


if __name__ == "__main__":
    main()
