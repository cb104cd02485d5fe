#!/usr/bin/env python3
"""What one element's change costs in a small and in a huge collection, on a
Tessera node and on redis-server in the same run.

For each of HSET, LPUSH, SADD and ZADD: a collection of SIZE elements is
built (pipelined, in commands of 1,000 elements), then one client times
`--ops` single changes that each add one element, one request at a time.
Prints p50 and p99 per size and server, and Tessera's p50 at the largest
size over its p50 at the smallest: near 1 means a change costs O(page), not
O(collection).

    scripts/measure-collection-latency.py [--sizes 10,1000000] [--ops 2000] [--engine memory]
"""

import argparse
import os
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


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_listening(port):
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            redis.Redis(port=port).ping()
            return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


# How each type adds elements: the command and its arguments for element numbers.
ADDERS = {
    "HSET": lambda numbers: [part for n in numbers for part in (f"field:{n}", "value")],
    "LPUSH": lambda numbers: [f"element:{n}" for n in numbers],
    "SADD": lambda numbers: [f"member:{n}" for n in numbers],
    "ZADD": lambda numbers: [part for n in numbers for part in (n, f"member:{n}")],
}


def build(client, command, key, size):
    pipe = client.pipeline(transaction=False)
    for start in range(0, size, 1000):
        pipe.execute_command(command, key, *ADDERS[command](range(start, min(start + 1000, size))))
        if len(pipe) >= 50:
            pipe.execute()
    pipe.execute()


def time_changes(client, command, key, size, ops):
    samples = []
    for n in range(size, size + ops):
        arguments = ADDERS[command]([n])
        start = time.perf_counter()
        client.execute_command(command, key, *arguments)
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2] * 1e6, samples[int(len(samples) * 0.99)] * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,1000000")
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--engine", default="memory")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as directory:
        ours_port, theirs_port = free_port(), free_port()
        ours = subprocess.Popen([str(BINARY), "serve", "--port", str(ours_port), "--dir", directory,
                                 "--engine", args.engine], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        theirs = subprocess.Popen(["redis-server", "--port", str(theirs_port), "--save", "", "--appendonly", "no"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_listening(ours_port)
            wait_listening(theirs_port)
            print(f"{'command':8} {'size':>9} {'Tessera p50/p99 us':>20} {'Redis p50/p99 us':>18}")
            for command in ADDERS:
                p50s = {}
                for size in sizes:
                    row = []
                    for name, port in (("tessera", ours_port), ("redis", theirs_port)):
                        client = redis.Redis(port=port, protocol=2)
                        client.flushall()
                        build(client, command, "collection", size)
                        p50, p99 = time_changes(client, command, "collection", size, args.ops)
                        p50s[(name, size)] = p50
                        row.append(f"{p50:8.0f} / {p99:6.0f}")
                        client.flushall()
                        client.close()
                    print(f"{command:8} {size:>9} {row[0]:>20} {row[1]:>18}", flush=True)
                ratio = p50s[("tessera", sizes[-1])] / p50s[("tessera", sizes[0])]
                print(f"{command:8} Tessera p50 at {sizes[-1]} over p50 at {sizes[0]}: {ratio:.2f}", flush=True)
        finally:
            for process in (ours, theirs):
                process.terminate()
                process.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
