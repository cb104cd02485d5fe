#!/usr/bin/env python3
"""The causal protocols on real processes: DKVF's Figure 3 (Roohitavaf and
Kulkarni, ASE 2018) on this machine, and visibility against clock skew.

Each run lays a cluster out across two datacenters of three nodes (`tessera
cluster up --datacenters 2 --consistency PROTOCOL`), optionally with a one-way
delay injected between them, and drives it with `tessera bench --causal`: one
bench process per datacenter, each connection a causal session kept on one
node of its datacenter (DKVF's clients, each holding one context, attached to
their replica). Values are 64 bytes, as in DKVF's evaluation.

  workload    throughput, PUT and GET response time (mean) as GET:PUT goes
              5:95 -> 95:5 (Figure 3a-c)
  amplify     requests of N inserts each, N = 20 -> 100: request throughput
              and response time (Figure 3d-e)
  visibility  a session in datacenter 0 reads a key, then writes one; a
              reader in datacenter 1 polls for the write: the time from the
              write's acknowledgement to its sight there, while the odd nodes'
              clocks run SKEW ms ahead (`cluster up --clock-skew-ms`) and a
              background load runs in both datacenters

Prints a markdown table per experiment, keeps every bench report in the work
directory it names, and with --svg-dir draws the figures there.

    scripts/measure-causal.py [--only workload,amplify,visibility] [--delays 0,50] [--seconds 6]
                              [--svg-dir docs/img]
"""

import argparse
import contextlib
import json
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

PROTOCOLS = {"geo-eventual": "eventual", "cops": "COPS", "gentle-rain": "GentleRain",
             "causal-spartan": "CausalSpartan"}
DATACENTERS = 2
NODES_PER_DATACENTER = 3
VALUE_BYTES = "64"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="workload,amplify,visibility")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--delays", default="0,50", help="one-way delays between datacenters, ms")
    parser.add_argument("--ratios", default="0.05,0.25,0.5,0.75,0.95", help="GET shares")
    parser.add_argument("--amplify", default="20,40,60,80,100")
    parser.add_argument("--skews", default="0,2,5,10", help="clock skews for the visibility runs, ms")
    parser.add_argument("--visibility-delay", type=int, default=50)
    parser.add_argument("--probes", type=int, default=300)
    parser.add_argument("--records", type=int, default=10000)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--connections", type=int, default=8, help="sessions per datacenter")
    parser.add_argument("--svg-dir")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tessera-causal-"))
    print(f"work directory: {work}", flush=True)
    protocols = args.protocols.split(",")
    delays = [int(delay) for delay in args.delays.split(",")]
    results = {}
    experiments = args.only.split(",")
    if "workload" in experiments:
        results["workload"] = workload(args, work, protocols, delays)
    if "amplify" in experiments:
        results["amplify"] = amplify(args, work, protocols, delays)
    if "visibility" in experiments:
        results["visibility"] = visibility(args, work, protocols)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    if args.svg_dir:
        draw_all(results, Path(args.svg_dir))


@contextlib.contextmanager
def geo_cluster(work, name, protocol, delay_ms=0, skew_ms=0):
    """A cluster of two datacenters running `protocol`; yields its base port."""
    base = failover.free_base_port(DATACENTERS * NODES_PER_DATACENTER + 1)
    cli = failover.cluster_cli(work / name)
    cli("up", "--nodes", str(DATACENTERS * NODES_PER_DATACENTER), "--datacenters", str(DATACENTERS),
        "--consistency", protocol, "--datacenter-delay-ms", str(delay_ms), "--clock-skew-ms", str(skew_ms),
        "--base-port", str(base), "--no-demo")
    try:
        yield base
    finally:
        cli("down")


def node_ports(base, datacenter):
    first = datacenter * NODES_PER_DATACENTER
    return [base + 1 + node for node in range(first, first + NODES_PER_DATACENTER)]


def bench(base, args, *options, datacenter=None, **popen):
    """`tessera bench` with string records of 64 bytes against one datacenter
    (causal sessions on its nodes) or, without one, the cluster's slot map."""
    if datacenter is None:
        route = ["--cluster", "--target", f"127.0.0.1:{base + 1}"]
    else:
        route = ["--causal", "--target", ",".join(f"127.0.0.1:{port}" for port in node_ports(base, datacenter))]
    command = [str(failover.BINARY), "bench", *route, "--record", "string", "--field-bytes", VALUE_BYTES,
               "--records", str(args.records), "--connections", str(args.connections), "--threads", "1", "--quiet",
               *options]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, **popen)


def load(base, args):
    loader = bench(base, args, "--phase", "load")
    if loader.wait() != 0:
        raise RuntimeError("loading the records failed")


def run_both(base, args, work, name, *options):
    """Both datacenters' clients at once; their reports, combined: requests
    per second summed, each operation's mean response time weighted by count."""
    paths = [work / f"{name}-dc{datacenter}.json" for datacenter in range(DATACENTERS)]
    runs = [bench(base, args, "--phase", "run", "--duration", str(args.seconds), "--json", str(path), *options,
                  datacenter=datacenter)
            for datacenter, path in enumerate(paths)]
    if any(run.wait() != 0 for run in runs):
        raise RuntimeError(f"a bench run of {name} failed")
    reports = [json.loads(path.read_text()) for path in paths]
    combined = {"throughput": sum(report["throughput_ops_per_s"] for report in reports),
                "errors": sum(sum(report["errors"].values()) for report in reports)}
    for operation in ("read", "update", "insert"):
        counted = [(report["latency"][operation]["count"], report["latency"][operation]["mean_us"])
                   for report in reports if operation in report["latency"]]
        if counted:
            total = sum(count for count, _ in counted)
            combined[f"{operation}_mean_ms"] = sum(count * mean for count, mean in counted) / total / 1000
    return combined


def workload(args, work, protocols, delays):
    shares = [float(share) for share in args.ratios.split(",")]
    return sweep(args, work, protocols, delays, "workload", shares,
                 options=lambda share: ["--mix", f"read={share},update={round(1 - share, 6)}"],
                 cell=lambda row: f"{row['throughput']:.0f} / {row.get('update_mean_ms', 0):.2f} / "
                                  f"{row.get('read_mean_ms', 0):.2f}",
                 caption="(ops/s / PUT mean ms / GET mean ms; columns: the GET share)")


def amplify(args, work, protocols, delays):
    factors = [int(factor) for factor in args.amplify.split(",")]
    return sweep(args, work, protocols, delays, "amplify", factors,
                 options=lambda factor: ["--mix", "insert=1", "--amplify", str(factor)],
                 cell=lambda row: f"{row['throughput']:.0f} / {row['insert_mean_ms']:.1f}",
                 caption="(requests/s / request mean ms; columns: inserts per request)")


def sweep(args, work, protocols, delays, name, points, options, cell, caption):
    """Each protocol at each delay on a cluster of its own (records loaded
    first), both datacenters' clients run at each point with `options(point)`;
    the rows, each with its `point`, printed as they come and as a table of
    `cell(row)`."""
    rows = []
    for delay in delays:
        for protocol in protocols:
            with geo_cluster(work, f"{name}-{protocol}-{delay}", protocol, delay_ms=delay) as base:
                load(base, args)
                for point in points:
                    row = run_both(base, args, work, f"{name}-{protocol}-{delay}-{point}", *options(point))
                    row.update(protocol=protocol, delay=delay, point=point)
                    rows.append(row)
                    print(f"{PROTOCOLS[protocol]:>13} delay {delay:3d} ms at {point}: {cell(row)}, "
                          f"errors {row['errors']}", flush=True)
    print_table(["delay", "protocol", *map(str, points)],
                [[f"{delay} ms", PROTOCOLS[protocol],
                  *(cell(row) for row in rows if row["protocol"] == protocol and row["delay"] == delay)]
                 for delay in delays for protocol in protocols],
                caption)
    return rows


def visibility(args, work, protocols):
    rows = []
    skews = [int(skew) for skew in args.skews.split(",")]
    for skew in skews:
        for protocol in protocols:
            name = f"visibility-{protocol}-{skew}"
            with geo_cluster(work, name, protocol, delay_ms=args.visibility_delay, skew_ms=skew) as base:
                load(base, args)
                # A steady background load in both datacenters, well below
                # what the machine serves, so that clocks and dependencies move.
                background = [bench(base, args, "--phase", "run", "--duration", "600", "--rate", "1000",
                                    "--mix", "read=0.5,update=0.5", datacenter=datacenter)
                              for datacenter in range(DATACENTERS)]
                try:
                    samples = probe(base, args.probes)
                finally:
                    for process in background:
                        process.terminate()
                        process.wait()
            samples.sort()
            row = {"protocol": protocol, "skew": skew, "median_ms": statistics.median(samples),
                   "p90_ms": samples[int(0.9 * (len(samples) - 1))], "p99_ms": samples[int(0.99 * (len(samples) - 1))]}
            rows.append(row)
            print(f"{PROTOCOLS[protocol]:>13} skew {skew:2d} ms: visible after {row['median_ms']:.1f} / "
                  f"{row['p90_ms']:.1f} / {row['p99_ms']:.1f} ms", flush=True)
    print_table(["protocol", *(f"skew {skew} ms" for skew in skews)],
                [[PROTOCOLS[protocol], *(f"{row['median_ms']:.0f} / {row['p90_ms']:.0f} / {row['p99_ms']:.0f}"
                                         for row in rows if row["protocol"] == protocol)]
                 for protocol in protocols],
                f"(median / p90 / p99 ms from acknowledgement in datacenter 0 to sight in datacenter 1, "
                f"{args.visibility_delay} ms one way)")
    return rows


def print_table(columns, lines, caption):
    """A markdown table, and its caption under it."""
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for line in lines:
        print("| " + " | ".join(line) + " |")
    print(caption + "\n", flush=True)


def probe(base, count):
    """A causal session in datacenter 0 reads a key and writes a probe key,
    `count` times, 20 ms apart; a plain connection in datacenter 1 polls each
    probe until it shows the value written. Milliseconds per probe."""
    writer = redis.Redis(port=node_ports(base, 0)[0], protocol=2, socket_timeout=10)
    writer.execute_command("CONSISTENCY", "CAUSAL")
    reader = redis.Redis(port=node_ports(base, 1)[1], protocol=2, socket_timeout=10)
    pending, samples, done = {}, [], threading.Event()
    lock = threading.Lock()

    def poll():
        while not done.is_set() or pending:
            with lock:
                waiting = list(pending.items())
            for key, (value, acknowledged) in waiting:
                if reader.get(key) == value:
                    seen = time.monotonic()
                    with lock:
                        del pending[key]
                    samples.append((seen - acknowledged) * 1000)
                elif time.monotonic() - acknowledged > 30:
                    raise RuntimeError(f"{key} not visible in datacenter 1 after 30 s")
            time.sleep(0.0005)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for number in range(count):
            writer.get(f"user{number * 7919 % 1000}")
            key, value = f"probe:{number}", f"v{number}".encode()
            writer.set(key, value)
            with lock:
                pending[key] = (value, time.monotonic())
            time.sleep(0.02)
    finally:
        done.set()
        poller.join()
    if len(samples) != count:
        raise RuntimeError(f"{count - len(samples)} probes were never seen in datacenter 1")
    return samples


COLORS = {"geo-eventual": "#1f77b4", "cops": "#d62728", "gentle-rain": "#2ca02c", "causal-spartan": "#ff7f0e"}


def draw_all(results, directory):
    directory.mkdir(parents=True, exist_ok=True)
    for experiment, x_label, figures in [
        ("workload", "GET share of requests",
         [("throughput", "operations per second", "a"), ("update_mean_ms", "PUT response time, mean ms", "b"),
          ("read_mean_ms", "GET response time, mean ms", "c")]),
        ("amplify", "amplification factor (inserts per request)",
         [("throughput", "requests per second", "d"), ("insert_mean_ms", "request response time, mean ms", "e")]),
    ]:
        rows = results.get(experiment)
        if not rows:
            continue
        for field, y_label, letter in figures:
            series = []
            for delay in sorted({row["delay"] for row in rows}):
                for protocol in PROTOCOLS:
                    points = [(row["point"], row[field]) for row in rows
                              if row["protocol"] == protocol and row["delay"] == delay and field in row]
                    if points:
                        series.append((f"{PROTOCOLS[protocol]}, {delay} ms", COLORS[protocol], delay > 0, points))
            path = directory / f"causal-figure-3{letter}.svg"
            path.write_text(line_chart(f"Figure 3{letter}: {y_label}", x_label, y_label, series))
            print(f"drew {path}")
    rows = results.get("visibility")
    if rows:
        series = [(PROTOCOLS[protocol], COLORS[protocol], False,
                   [(row["skew"], row["median_ms"]) for row in rows if row["protocol"] == protocol])
                  for protocol in PROTOCOLS if any(row["protocol"] == protocol for row in rows)]
        path = directory / "causal-visibility-skew.svg"
        path.write_text(line_chart("Visibility in the other datacenter against clock skew", "clock skew, ms",
                                   "median visibility, ms", series))
        print(f"drew {path}")


def line_chart(title, x_label, y_label, series):
    """An SVG of lines (name, color, dashed, points) on linear axes from zero."""
    width, height, left, right, top, bottom = 760, 400, 70, 200, 36, 50
    xs = [x for *_, points in series for x, _ in points]
    ys = [y for *_, points in series for _, y in points]
    x_low, x_high = min(xs), max(xs)
    y_high = max(ys) * 1.1 or 1
    to_x = lambda x: left + (x - x_low) / ((x_high - x_low) or 1) * (width - left - right)
    to_y = lambda y: height - bottom - y / y_high * (height - top - bottom)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">', '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="{(left + width - right) / 2}" y="20" font-size="14" text-anchor="middle">{title}</text>',
             f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>',
             f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">{x_label}</text>',
             f'<text x="16" y="{(top + height - bottom) / 2}" text-anchor="middle" '
             f'transform="rotate(-90 16 {(top + height - bottom) / 2})">{y_label}</text>']
    for x in sorted(set(xs)):
        parts.append(f'<text x="{to_x(x):.1f}" y="{height - bottom + 15}" text-anchor="middle">{x:g}</text>')
    for step in range(6):
        y = y_high * step / 5
        parts.append(f'<line x1="{left - 4}" y1="{to_y(y):.1f}" x2="{width - right}" y2="{to_y(y):.1f}" '
                     f'stroke="#ddd"/><text x="{left - 6}" y="{to_y(y) + 4:.1f}" text-anchor="end">{y:.3g}</text>')
    for index, (name, color, dashed, points) in enumerate(series):
        path = " ".join(f"{to_x(x):.1f},{to_y(y):.1f}" for x, y in points)
        dash = ' stroke-dasharray="5,3"' if dashed else ""
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        legend_y = top + 16 * index
        parts.append(f'<line x1="{width - right + 12}" y1="{legend_y}" x2="{width - right + 36}" y2="{legend_y}" '
                     f'stroke="{color}" stroke-width="2"{dash}/>'
                     f'<text x="{width - right + 42}" y="{legend_y + 4}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


if __name__ == "__main__":
    main()
