#!/usr/bin/env python3
"""Memory per key over the wire, Tessera against Redis in the same run: for
each value size, a fresh redis-server and fresh Tessera nodes (the `memory`
engine, and the `hybrid` engine with a budget that holds every record in
memory) get the same KEYS SETs of 16-byte keys through pipelined redis-py;
the figure is the growth of INFO's used_memory divided by KEYS, and the
ratio is Tessera's over Redis's.

    scripts/measure-memory-per-key.py [--keys 1000000] [--sizes 8,32,100]
"""

import argparse
import subprocess
import sys
import tempfile
import time
from importlib import import_module
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
latency = import_module("measure-collection-latency")
BINARY, free_port, wait_for = latency.BINARY, latency.free_port, latency.wait_listening


def start(server, directory):
    port = free_port()
    if server == "redis":
        command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    else:
        command = [str(BINARY), "serve", "--port", str(port), "--dir", str(directory / f"{server}-{port}"),
                   "--log", "warn", "--threads", "1"]
        if server == "tessera hybrid":
            command += ["--engine", "hybrid", "--engine-option", "memory-bytes=2gb", "--engine-option", "fsync=no"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(port)
    return process, port


def bytes_per_key(server, keys, value_size, directory):
    process, port = start(server, directory)
    try:
        client = redis.Redis(port=port)
        before = client.info("memory")["used_memory"]
        value = b"v" * value_size
        pipe = client.pipeline(transaction=False)
        for i in range(keys):
            pipe.set(b"key:%012d" % i, value)  # 16 bytes
            if len(pipe) == 1000:
                pipe.execute()
        pipe.execute()
        time.sleep(0.5)  # the hybrid engine's index may be finishing a doubling
        assert client.dbsize() == keys
        return (client.info("memory")["used_memory"] - before) / keys
    finally:
        process.terminate()
        process.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--sizes", default="8,32,100")
    args = parser.parse_args()
    if not BINARY.exists():
        sys.exit(f"build first: cargo build --release ({BINARY})")
    directory = Path(tempfile.mkdtemp(prefix="tessera-memory-"))
    servers = ["redis", "tessera memory", "tessera hybrid"]
    print("| value bytes | " + " | ".join(f"{server} B/key" for server in servers)
          + " | memory / Redis | hybrid / Redis |")
    print("|---:|" + "---:|" * (len(servers) + 2))
    for size in [int(size) for size in args.sizes.split(",")]:
        figures = {server: bytes_per_key(server, args.keys, size, directory) for server in servers}
        redis_figure = figures["redis"]
        print(f"| {size} | " + " | ".join(f"{figures[server]:.0f}" for server in servers)
              + f" | {figures['tessera memory'] / redis_figure:.2f}x | {figures['tessera hybrid'] / redis_figure:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
