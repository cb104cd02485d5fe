#!/usr/bin/env python3
"""A data set four times the hybrid engine's memory budget: a node whose
default table is `hybrid` with memory-bytes BUDGET is loaded with strings
(100-byte values) until the log holds four budgets, then `tessera bench`
runs YCSB workload C (reads only) against it for a while, with a zipfian
and then a uniform choice of keys. Printed per distribution: throughput,
p99 latency, and the share of reads the in-memory regions served (from
TABLE.INFO's reads-in-memory and reads-from-disk). The same load and reads
over the `memory` engine, which holds everything in memory, give the
reference throughput.

    scripts/measure-larger-than-memory.py [--budget-mb 64] [--duration 20]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from importlib import import_module
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
latency = import_module("measure-collection-latency")
BINARY, free_port, wait_listening = latency.BINARY, latency.free_port, latency.wait_listening
# A record of a key "user<n>" and a 100-byte string: 16 + 112 bytes in the log.
RECORD_BYTES = 128


def table_stats(client):
    reply = client.execute_command("TABLE.INFO", "default")
    fields = reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2]))
    return {key.decode() if isinstance(key, bytes) else key: value for key, value in fields.items()}


def bench(port, records, phase, distribution, duration, report):
    command = [str(BINARY), "bench", "--target", f"127.0.0.1:{port}", "--workload", "C", "--record", "string",
               "--field-bytes", "100", "--records", str(records), "--phase", phase, "--connections", "16",
               "--threads", "1", "--quiet", "--distribution", distribution]
    if phase == "run":
        command += ["--duration", str(duration), "--json", str(report)]
    subprocess.run(command, check=True, capture_output=True)
    return json.loads(report.read_text()) if phase == "run" else None


def measure(engine, args, directory):
    port = free_port()
    options = ["--engine", engine]
    if engine == "hybrid":
        options += ["--engine-option", f"memory-bytes={args.budget_mb}mb", "--engine-option", "fsync=no"]
    process = subprocess.Popen([str(BINARY), "serve", "--port", str(port), "--dir", str(directory / engine),
                                "--log", "warn", "--threads", "1", *options],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port)
        client = redis.Redis(port=port)
        records = 4 * (args.budget_mb << 20) // RECORD_BYTES
        bench(port, records, "load", "uniform", 0, None)
        rows = []
        for distribution in ("zipfian", "uniform"):
            before = table_stats(client)
            report = bench(port, records, "run", distribution, args.duration, directory / f"{engine}.json")
            after = table_stats(client)
            row = {"engine": engine, "distribution": distribution, "records": records,
                   "ops": round(report["throughput_ops_per_s"]),
                   "p99_us": report["latency"]["read"]["p99_us"], "errors": sum(report["errors"].values())}
            if engine == "hybrid":
                memory = after["reads-in-memory"] - before["reads-in-memory"]
                disk = after["reads-from-disk"] - before["reads-from-disk"]
                row["hit_rate"] = memory / max(memory + disk, 1)
                row["log_bytes"] = after["log-bytes"]
                row["in_memory_bytes"] = after["log-bytes-in-memory"]
            rows.append(row)
        return rows
    finally:
        process.terminate()
        process.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mb", type=int, default=64)
    parser.add_argument("--duration", type=int, default=20)
    args = parser.parse_args()
    if not BINARY.exists():
        sys.exit(f"build first: cargo build --release ({BINARY})")
    directory = Path(tempfile.mkdtemp(prefix="tessera-larger-than-memory-"))
    rows = measure("hybrid", args, directory) + measure("memory", args, directory)
    print(json.dumps(rows))
    print("| engine | distribution | records | reads/s | p99 µs | errors | in-memory hit rate |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        hit = f"{row['hit_rate']:.1%}" if "hit_rate" in row else "(all in memory)"
        print(f"| {row['engine']} | {row['distribution']} | {row['records']:,} | {row['ops']:,} | {row['p99_us']} "
              f"| {row['errors']} | {hit} |")


if __name__ == "__main__":
    main()
