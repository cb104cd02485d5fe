#!/usr/bin/env python3
"""Throughput second by second while a table switches modes (TABLE.ALTER), on
a local cluster of real processes (`tessera cluster up`).

`tessera bench` runs YCSB against the cluster (cluster-client routing) for the
whole run; every few seconds the default table switches to the next mode.
Prints the per-second series with the switches marked, and for each switch:
how long TABLE.ALTER took, the throughput of the seconds before and after it
(medians), the lowest second, and the first second back at 90% of the lower of
the two modes' throughputs. Errors are the bench's, over the whole run.

    scripts/measure-transition.py [--nodes 3] [--workload A] [--every 4] [--svg docs/img/transitions.svg]
"""

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from importlib import import_module

failover = import_module("measure-failover")

MODES = [("aa", "strong"), ("aa", "eventual"), ("ms", "eventual"), ("ms", "strong"), ("aa", "eventual"),
         ("ms", "strong")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--workload", default="A")
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--every", type=float, default=4.0, help="seconds between switches")
    parser.add_argument("--svg", help="draw the series here")
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="tessera-transition-"))
    base = failover.free_base_port(args.nodes + 1)

    cli = failover.cluster_cli(directory / "cluster")
    cli("up", "--nodes", str(args.nodes), "--groups", str(args.nodes), "--replicas", "3", "--topology", "ms",
        "--consistency", "strong", "--base-port", str(base), "--no-demo")
    targets = ",".join(f"127.0.0.1:{base + 1 + node}" for node in range(args.nodes))
    bench = [str(failover.BINARY), "bench", "--cluster", "--target", targets, "--workload", args.workload,
             "--distribution", "zipfian", "--records", str(args.records), "--connections", str(args.connections),
             "--threads", "1", "--quiet"]
    report = directory / "bench.json"
    try:
        subprocess.run([*bench, "--phase", "load"], check=True, capture_output=True)
        duration = int(args.every * (len(MODES) + 1)) + 1
        runner = subprocess.Popen([*bench, "--phase", "run", "--duration", str(duration), "--json", str(report)])
        started = time.time()
        admin = redis.Redis(port=base + 1, protocol=2, socket_timeout=90)
        switches = []
        for topology, consistency in MODES:
            time.sleep(max(0.0, started + args.every * (len(switches) + 1) - time.time()))
            asked = time.time() - started
            admin.execute_command("TABLE.ALTER", "default", "TOPOLOGY", topology, "CONSISTENCY", consistency)
            switches.append((f"{topology}+{'sc' if consistency == 'strong' else 'ec'}", asked,
                             time.time() - started - asked))
        runner.wait()
    finally:
        cli("down")
    result = json.loads(report.read_text())
    series = result["per_second"]
    print("second  ops/s")
    marks = {int(asked): name for name, asked, _ in switches}
    for second, count in enumerate(series):
        print(f"{second:6d}  {count:6d}  {'<- ' + marks[second] if second in marks else ''}")
    print()
    previous = "ms+sc"
    for name, asked, took in switches:
        second = int(asked)
        before = statistics.median(series[max(0, second - 3):second])
        # The new mode may be slower (AA+SC): recovered is 90% of the lower
        # of the two modes' throughputs, the new one's taken two seconds on.
        settled = statistics.median(series[second + 2:second + 4] or [before])
        target = 0.9 * min(before, settled)
        after = series[second:second + 4]
        recovered = next((index for index, count in enumerate(after) if count >= target), None)
        print(f"{previous} -> {name}: TABLE.ALTER {took * 1000:.0f} ms; {before:.0f} ops/s before, {settled:.0f} "
              f"after; lowest second {min(after)}; 90% again in second "
              f"{'+' + str(recovered) if recovered is not None else 'later'} (the switch's own second is +0)")
        previous = name
    print(f"errors: {result.get('errors') or 'none'}")
    pauses = write_pauses(directory / "cluster" / "logs")
    print(f"writes held per group and switch (first node draining to last node switched, from the nodes' logs): "
          f"median {statistics.median(pauses):.0f} ms, longest {max(pauses):.0f} ms, over {len(pauses)}")
    if args.svg:
        draw(series, switches, args.svg)


def write_pauses(logs):
    """Per group and switch, from the first node that drains to the last that
    runs the new mode: the time its writes wait."""
    events = []
    pattern = re.compile(r"^\S*?(\d{4}-\d\d-\d\dT[\d:.]+)Z.*?(draining to switch modes|switched modes) shard\S*?=\S*?(\d+)")
    for log in logs.glob("node-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            plain = re.sub(r"\x1b\[[0-9;]*m", "", line)
            match = pattern.search(plain)
            if match:
                at = datetime.datetime.fromisoformat(match.group(1)).timestamp()
                events.append((at, match.group(2).startswith("draining"), int(match.group(3))))
    pauses = []
    for shard in {group for _, _, group in events}:
        opened = last_switched = None
        for at, draining, group in sorted(events):
            if group != shard:
                continue
            if draining and last_switched is not None:
                pauses.append((last_switched - opened) * 1000)
                opened = last_switched = None
            if draining and opened is None:
                opened = at
            elif not draining and opened is not None:
                last_switched = at
        if last_switched is not None:
            pauses.append((last_switched - opened) * 1000)
    return pauses or [0.0]


def draw(series, switches, path):
    """A bar per second, the switches as labelled lines."""
    width, height, left, bottom = 720, 260, 50, 30
    peak = max(series) or 1
    bar = (width - left - 10) / len(series)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">']
    for second, count in enumerate(series):
        tall = (height - bottom - 20) * count / peak
        parts.append(f'<rect x="{left + second * bar:.1f}" y="{height - bottom - tall:.1f}" width="{bar * 0.9:.1f}" '
                     f'height="{tall:.1f}" fill="#4a7bb7"/>')
    for name, asked, _ in switches:
        x = left + asked * bar
        parts.append(f'<line x1="{x:.1f}" y1="14" x2="{x:.1f}" y2="{height - bottom}" stroke="#c33" stroke-dasharray="3"/>')
        parts.append(f'<text x="{x + 2:.1f}" y="12" fill="#c33">{name}</text>')
    parts.append(f'<text x="{left}" y="{height - 8}">seconds (bar: operations completed in that second; peak {peak} ops/s)</text>')
    parts.append("</svg>")
    Path(path).write_text("\n".join(parts))


if __name__ == "__main__":
    main()
