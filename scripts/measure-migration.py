#!/usr/bin/env python3
"""Throughput second by second while slots move between groups (`tessera
cluster move-slots`), on a local cluster of real processes.

`tessera bench` runs YCSB against the cluster (cluster-client routing) for the
whole run; every few seconds one group's slots move to another group. Prints
the per-second series with the moves marked and, for each move: how long it
took, the median of the three seconds before it, the lowest second of the
move and the median of the seconds after it. Errors are the bench's, over the
whole run.

    scripts/measure-migration.py [--nodes 3] [--workload A] [--records 100000] [--every 5] [--moves 3]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from importlib import import_module

failover = import_module("measure-failover")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--workload", default="A")
    parser.add_argument("--records", type=int, default=100000)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--every", type=float, default=5.0, help="seconds between the starts of moves")
    parser.add_argument("--moves", type=int, default=3)
    parser.add_argument("--mode", default="ms+sc", choices=["ms+sc", "ms+ec", "aa+sc", "aa+ec"])
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="tessera-migration-"))
    base = failover.free_base_port(args.nodes + 1)
    groups = 2 * args.nodes

    cli = failover.cluster_cli(directory / "cluster")
    cli("up", "--nodes", str(args.nodes), "--groups", str(groups), "--replicas", "3", *failover.mode_flags(args.mode),
        "--base-port", str(base), "--no-demo")
    targets = ",".join(f"127.0.0.1:{base + 1 + node}" for node in range(args.nodes))
    bench = [str(failover.BINARY), "bench", "--cluster", "--target", targets, "--workload", args.workload,
             "--distribution", "zipfian", "--records", str(args.records), "--connections", str(args.connections),
             "--threads", "1", "--quiet"]
    report = directory / "bench.json"
    slots_per_group = 16384 // groups
    moves = []
    try:
        subprocess.run([*bench, "--phase", "load"], check=True, capture_output=True)
        duration = int(args.every * (args.moves + 1)) + 1
        runner = subprocess.Popen([*bench, "--phase", "run", "--duration", str(duration), "--json", str(report)])
        started = time.time()
        for index in range(args.moves):
            time.sleep(max(0.0, started + args.every * (index + 1) - time.time()))
            # Group 2i gives its first half to group 2i+1 (another head).
            source, target = (2 * index) % groups, (2 * index + 1) % groups
            first = source * 16384 // groups
            slots = f"{first}-{first + slots_per_group // 2 - 1}"
            asked = time.time() - started
            cli("move-slots", str(source), str(target), slots)
            moves.append((f"{source}->{target} {slots}", asked, time.time() - started - asked))
        runner.wait()
    finally:
        cli("down")
    print_phases(json.loads(report.read_text()), moves)


def print_phases(result, phases):
    """The bench's per-second series with each phase `(name, started at,
    took)` marked, then per phase: the median of the three seconds before
    it, its lowest second, the median of its seconds and of the three after
    it; and the bench's errors."""
    series = result["per_second"]
    marks = {int(asked): name for name, asked, _ in phases}
    print("second  ops/s")
    for second, count in enumerate(series):
        print(f"{second:6d}  {count:6d}  {'<- ' + marks[second] if second in marks else ''}")
    print()
    for name, asked, took in phases:
        first, last = int(asked), int(asked + took)
        before = statistics.median(series[max(0, first - 3):first])
        during = series[first:last + 1]
        after = statistics.median(series[last + 1:last + 4] or during)
        print(f"{name}: {took:.1f} s; {before:.0f} ops/s before, lowest second {min(during)} "
              f"({min(during) / before:.2f} of before), median during {statistics.median(during):.0f} "
              f"({statistics.median(during) / before:.2f}), {after:.0f} after ({after / before:.2f})")
    print(f"errors: {result.get('errors') or 'none'}")

if __name__ == "__main__":
    main()
