#!/usr/bin/env python3
"""Throughput second by second while a cluster grows and shrinks under load
(`tessera cluster add-node`, `rebalance`, `remove-node`), on a local cluster
of real processes.

`tessera bench` runs YCSB against the cluster (cluster-client routing) for the
whole run. After a few seconds, `--add` nodes are started and the cluster is
rebalanced (replicas, then heads, move onto them); a few seconds later
`--remove` of the original nodes are removed one after another. Prints the
per-second series with the phases marked and, for each phase: how long it
took, the median of the three seconds before it, its lowest second and the
median of the three seconds after it. Errors are the bench's, over the whole
run.

    scripts/measure-scale-out.py [--nodes 3] [--groups 6] [--add 3] [--remove 2] [--workload A] [--svg PATH]
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from importlib import import_module

failover = import_module("measure-failover")
migration = import_module("measure-migration")
transition = import_module("measure-transition")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--add", type=int, default=3)
    parser.add_argument("--remove", type=int, default=2)
    parser.add_argument("--workload", default="A")
    parser.add_argument("--records", type=int, default=100000)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds before and between the phases")
    parser.add_argument("--duration", type=int, default=60, help="seconds the bench runs (past the last phase)")
    parser.add_argument("--mode", default="ms+sc", choices=["ms+sc", "ms+ec", "aa+sc", "aa+ec"])
    parser.add_argument("--svg", help="draw the series, the phases marked, here")
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="tessera-scale-out-"))
    base = failover.free_base_port(args.nodes + args.add + 1)

    cli = failover.cluster_cli(directory / "cluster")
    cli("up", "--nodes", str(args.nodes), "--groups", str(args.groups), "--replicas", "3",
        *failover.mode_flags(args.mode), "--base-port", str(base), "--no-demo")
    # Seeds for the bench's cluster client: the nodes that stay.
    targets = ",".join(f"127.0.0.1:{base + 1 + node}" for node in range(args.remove, args.nodes))
    bench = [str(failover.BINARY), "bench", "--cluster", "--target", targets, "--workload", args.workload,
             "--distribution", "zipfian", "--records", str(args.records), "--connections", str(args.connections),
             "--threads", "1", "--quiet"]
    report = directory / "bench.json"
    phases = []
    try:
        subprocess.run([*bench, "--phase", "load"], check=True, capture_output=True)
        runner = subprocess.Popen([*bench, "--phase", "run", "--duration", str(args.duration), "--json", str(report)])
        started = time.time()

        def phase(name, *commands):
            time.sleep(args.settle)
            asked = time.time() - started
            for command in commands:
                # Each step's line, stamped with the bench's second, to set
                # beside the series.
                step = subprocess.Popen([str(failover.BINARY), "cluster", *command, "--dir",
                                         str(directory / "cluster")], stdout=subprocess.PIPE, text=True)
                for line in step.stdout:
                    print(f"{time.time() - started:6.1f} s  {line.rstrip()}", flush=True)
                if step.wait() != 0:
                    sys.exit(f"tessera cluster {' '.join(command)} failed")
            phases.append((name, asked, time.time() - started - asked))

        phase(f"add {args.add} nodes and rebalance", ("add-node", "--count", str(args.add)), ("rebalance",))
        for node in range(args.remove):
            phase(f"remove n{node}", ("remove-node", str(node)))
        runner.wait()
    finally:
        cli("down")
    result = json.loads(report.read_text())
    migration.print_phases(result, phases)
    if args.svg:
        transition.draw(result["per_second"], phases, args.svg)

if __name__ == "__main__":
    main()
