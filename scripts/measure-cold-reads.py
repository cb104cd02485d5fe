#!/usr/bin/env python3
"""Reads of records on disk, out of the OS's page cache, with and without
the node's reads ahead (`disk_reads_in_flight`). A node whose default table
is `hybrid` (memory-bytes BUDGET) is loaded with RECORDS strings of
VALUE bytes; then, for each setting, a node is started over a fresh copy
of that directory (so that no run inherits the copies to memory of the
one before), the log's pages are dropped from the page cache, and `tessera
bench` runs YCSB workload C (reads only, uniform) with CONNECTIONS clients
against one worker thread. Printed per setting: throughput, p50 and p99
latency, reads the node fetched ahead, and the ratio to reads on the
serving thread (disk_reads_in_flight 0).

    scripts/measure-cold-reads.py [--records 200000] [--value-bytes 1000]
        [--budget-mb 16] [--duration 10] [--connections 32]
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from importlib import import_module
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
latency = import_module("measure-collection-latency")
from conftest import evict_from_page_cache  # noqa: E402  (the tests' own helper)
BINARY, free_port, wait_listening = latency.BINARY, latency.free_port, latency.wait_listening


def bench(port, args, phase, report=None):
    command = [str(BINARY), "bench", "--target", f"127.0.0.1:{port}", "--workload", "C", "--record", "string",
               "--field-bytes", str(args.value_bytes), "--records", str(args.records), "--phase", phase,
               "--connections", str(args.connections), "--threads", "1", "--quiet",
               "--distribution", "uniform"]
    if phase == "run":
        command += ["--duration", str(args.duration), "--json", str(report)]
    subprocess.run(command, check=True, capture_output=True)
    return json.loads(report.read_text()) if report else None


def serve(directory, args, in_flight):
    port = free_port()
    process = subprocess.Popen(
        [str(BINARY), "serve", "--port", str(port), "--dir", str(directory), "--log", "warn", "--threads", "1",
         "--engine", "hybrid", "--engine-option", f"memory-bytes={args.budget_mb}mb",
         "--engine-option", "fsync=no", "--disk-reads-in-flight", str(in_flight)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_listening(port)
    return process, port


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--value-bytes", type=int, default=1000)
    parser.add_argument("--budget-mb", type=int, default=16)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--settings", default="0,64", help="disk_reads_in_flight values, the first the reference")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent.parent / "target") as scratch:
        loaded = Path(scratch) / "loaded"
        process, port = serve(loaded, args, 0)
        try:
            bench(port, args, "load")
        finally:
            process.terminate()
            process.wait()
        rows = []
        for run, in_flight in enumerate(int(setting) for setting in args.settings.split(",")):
            directory = Path(scratch) / f"run-{run}"
            shutil.copytree(loaded, directory)
            process, port = serve(directory, args, in_flight)
            try:
                evict_from_page_cache(directory)
                report = bench(port, args, "run", Path(scratch) / f"run-{run}.json")
                stats = redis.Redis(port=port).info("stats")
            finally:
                process.terminate()
                process.wait()
                shutil.rmtree(directory)
            rows.append({"disk_reads_in_flight": in_flight, "ops": round(report["throughput_ops_per_s"]),
                         "p50_us": report["latency"]["read"]["p50_us"],
                         "p99_us": report["latency"]["read"]["p99_us"],
                         "fetched": stats["disk_reads_fetched"], "errors": sum(report["errors"].values())})
    reference = rows[0]["ops"]
    print(f"hybrid, {args.records} records of {args.value_bytes} B, memory-bytes {args.budget_mb} MB, "
          f"{args.connections} connections, 1 worker thread, uniform reads for {args.duration} s, page cache dropped")
    print(f"{'in flight':>9} {'ops/s':>9} {'p50 us':>8} {'p99 us':>8} {'fetched':>9} {'ratio':>6}")
    for row in rows:
        print(f"{row['disk_reads_in_flight']:>9} {row['ops']:>9} {row['p50_us']:>8} {row['p99_us']:>8} "
              f"{row['fetched']:>9} {row['ops'] / max(reference, 1):>6.2f}")
        assert row["errors"] == 0, row


if __name__ == "__main__":
    main()
