"""YCSB as people already run it drives Tessera as it drives Redis: go-ycsb's
redis binding (built by scripts/build-go-ycsb.sh), load and run phases."""

import os
import re
import subprocess
from pathlib import Path

import pytest

GO_YCSB = os.environ.get("GO_YCSB", str(Path(__file__).resolve().parents[2] / "target/tools/go-ycsb"))


def go_ycsb(phase, workload, port, *properties):
    if not Path(GO_YCSB).exists():
        if os.environ.get("TESSERA_REQUIRE_EXTERNAL") == "1":
            pytest.fail(f"go-ycsb is missing at {GO_YCSB}; run scripts/build-go-ycsb.sh")
        pytest.skip("go-ycsb is not built (scripts/build-go-ycsb.sh)")
    workloads = Path(GO_YCSB).parent / "go-ycsb-src" / "workloads"
    command = [GO_YCSB, phase, "redis", "-P", str(workloads / workload), "-p", f"redis.addr=127.0.0.1:{port}",
               "-p", "threadcount=4"]
    for prop in properties:
        command += ["-p", prop]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def counts(output):
    """The final per-operation counts go-ycsb prints, e.g. {'READ': 2514}."""
    final = output.rsplit("Run finished", 1)[-1]
    return {name: int(count) for name, count in re.findall(r"^(\w+)\s+- Takes\(s\): [\d.]+, Count: (\d+)", final, re.M)}


@pytest.mark.parametrize("engine", ["memory", "lsm"])
def test_go_ycsb_load_and_run(data_dir, engine):
    from conftest import Node

    node = Node(data_dir, "--engine", engine).start()
    loaded = go_ycsb("load", "workloada", node.port, "recordcount=2000")
    assert "_ERROR" not in loaded, loaded
    assert counts(loaded)["INSERT"] == 2000
    ran = go_ycsb("run", "workloada", node.port, "recordcount=2000", "operationcount=10000")
    assert "_ERROR" not in ran, ran
    done = counts(ran)
    assert done["READ"] + done["UPDATE"] == 10000 and done["READ"] > 3000 and done["UPDATE"] > 3000
    ran = go_ycsb("run", "workloadf", node.port, "recordcount=2000", "operationcount=3000")
    assert "_ERROR" not in ran, ran
    assert counts(ran)["READ_MODIFY_WRITE"] > 1000
    r = node.client()
    assert r.dbsize() == 2000
    key = next(r.scan_iter(count=10))
    assert key.startswith(b"usertable/user")
    assert len(r.hgetall(key)) == 10
    node.stop()
