"""SAVE, BGSAVE and LASTSAVE on a node, and `tessera backup` / `tessera
restore` on a cluster: the files are RDB dumps that a real redis-server loads
and that hold what the source held (compared key by key), and a cluster's
backup, taken while clients write, holds each group at one point: of the
keys one client wrote one after another into one group, the backup has a
prefix, and every one acknowledged before the backup began."""

import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis

from conftest import BINARY, free_port, table_info, wait_for_ping
from test_cluster import LocalCluster
from test_import_rdb import assert_same_keys, contents, fill


class RedisWithDump:
    """A real redis-server that loaded `dump` at its start."""

    def __init__(self, dump, directory):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True)
        shutil.copy(dump, self.dir / "dump.rdb")
        self.port = free_port()
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_ping(self.port)
        self.client = redis.Redis(port=self.port)

    def close(self):
        self.client.close()
        self.process.terminate()
        self.process.wait(timeout=10)


def persistence(client):
    return client.info("persistence")


def wait_for_bgsave(client, timeout=60):
    deadline = time.time() + timeout
    while persistence(client)["rdb_bgsave_in_progress"]:
        assert time.time() < deadline, "BGSAVE did not finish"
        time.sleep(0.05)


def test_save_and_bgsave_write_a_dump_that_redis_loads_with_every_key(node, tmp_path):
    client = node.client()
    fill(client)
    started = client.lastsave()
    time.sleep(1.1)  # LASTSAVE counts seconds
    assert client.save()
    info = persistence(client)
    assert info["rdb_changes_since_last_save"] == 0
    assert info["rdb_last_bgsave_status"] == "ok"
    assert client.lastsave() > started
    dump = Path(node.data_dir) / "dump.rdb"
    loaded = RedisWithDump(dump, tmp_path / "first")
    try:
        assert_same_keys(client, loaded.client)
    finally:
        loaded.close()

    # BGSAVE answers at once and writes the keys as they are then.
    client.set("s:after", "later")
    client.delete("s:1")
    client.rpush("l:small", "d")
    assert persistence(client)["rdb_changes_since_last_save"] == 3
    assert client.bgsave()
    wait_for_bgsave(client)
    assert persistence(client)["rdb_changes_since_last_save"] == 0
    loaded = RedisWithDump(dump, tmp_path / "second")
    try:
        assert_same_keys(client, loaded.client)
    finally:
        loaded.close()


class SequenceWriter(threading.Thread):
    """Writes `{tag}:seq:N` for N = 0, 1, ... one after another (each
    acknowledged before the next), with a 1 KiB value so that the groups
    take a while to stream; remembers how far it got."""

    def __init__(self, client, tag):
        super().__init__(daemon=True)
        self.client, self.tag = client, tag
        self.acknowledged = -1
        self.stop = threading.Event()

    def run(self):
        value = "x" * 1024
        while not self.stop.is_set():
            self.client.set(f"{{{self.tag}}}:seq:{self.acknowledged + 1}", value)
            self.acknowledged += 1


def test_a_cluster_backup_holds_each_group_at_one_point_and_restores_into_another_cluster(tmp_path):
    # A slow snapshot rate, so that each group streams for a while and the
    # writes go on meanwhile: its changes must follow into the backup.
    source = LocalCluster(tmp_path / "source", "strong", options=("--snapshot-rate", "2mb"))
    target = None
    backup_dir = tmp_path / "backup"
    try:
        source.up(nodes=3)
        client = source.client()
        plain = redis.Redis(port=source.port(0))
        plain.execute_command("TABLE.CREATE", "users", "PREFIX", "u:", "ENGINE", "lsm")
        plain.execute_command("TABLE.CREATE", "events", "PREFIX", "ev:", "ENGINE", "log")
        plain.execute_command("TABLE.ALTER", "events", "TOPOLOGY", "aa", "CONSISTENCY", "eventual")
        plain.execute_command("ACL", "SETUSER", "alice", "on", ">secret", "~u:*", "+get")
        fill(client)
        pipe = client.pipeline(transaction=False)
        for index in range(2_000):
            pipe.set(f"u:{index}", "y" * 1024)
            pipe.hset(f"ev:{index % 40}", f"f{index}", index)
        pipe.execute()
        writers = [SequenceWriter(source.client(), tag) for tag in ("a", "b", "c", "d")]
        for writer in writers:
            writer.start()
        time.sleep(0.5)
        before = {writer.tag: writer.acknowledged for writer in writers}
        taken = subprocess.run([str(BINARY), "backup", "--to", str(backup_dir), "--addr",
                                f"127.0.0.1:{source.port(0)}"], capture_output=True, text=True, timeout=300)
        for writer in writers:
            writer.stop.set()
            writer.join(timeout=30)
        assert taken.returncode == 0, taken.stdout + taken.stderr
        manifest = (backup_dir / "manifest.json").read_text()
        assert '"events"' in manifest and '"aa+ec"' in manifest

        # Each group's file loads into Redis; together they hold every key
        # once, and each writer's keys as a prefix of what it wrote.
        files = sorted(backup_dir.glob("group-*.rdb"))
        assert len(files) == len(source.map()["shards"])
        seen = {}
        for index, path in enumerate(files):
            loaded = RedisWithDump(path, tmp_path / f"redis-{index}")
            try:
                for key in loaded.client.scan_iter(count=1000):
                    assert key not in seen, f"{key} in {path.name} and {seen[key]}"
                    seen[key] = path.name
            finally:
                loaded.close()
        for writer in writers:
            prefix = f"{{{writer.tag}}}:seq:".encode()
            numbers = sorted(int(key[len(prefix):]) for key in seen if key.startswith(prefix))
            assert numbers == list(range(len(numbers))), f"{writer.tag}: a gap in {numbers[:5]}...{numbers[-5:]}"
            assert len(numbers) > before[writer.tag], (writer.tag, len(numbers), before[writer.tag])
            assert len(numbers) <= writer.acknowledged + 1

        # Restored into a cluster of another shape, it holds the same keys:
        # the tables with their engines and modes, and the writers' keys as
        # the backup had them.
        target = LocalCluster(tmp_path / "target", "strong", options=("--groups", "2")).up(nodes=3)
        restored = subprocess.run([str(BINARY), "restore", "--from", str(backup_dir), "--addr",
                                   f"127.0.0.1:{target.port(1)}"], capture_output=True, text=True, timeout=300)
        assert restored.returncode == 0, restored.stdout + restored.stderr
        after = target.client()
        info = table_info(redis.Redis(port=target.port(0)), "events")
        assert info[b"mode"] == b"aa+ec" and info[b"engine"] == b"log"
        alice = redis.Redis(port=target.port(1), username="alice", password="secret")
        assert alice.get("u:7") == b"y" * 1024
        with pytest.raises(redis.exceptions.NoPermissionError):
            alice.set("u:7", "no")
        restored_keys = list(after.scan_iter(count=1000))
        assert len(restored_keys) == len(set(restored_keys)), "SCAN answers each key once"
        assert set(restored_keys) == set(seen)
        for writer in writers:
            client.delete(*[f"{{{writer.tag}}}:seq:{number}" for number in range(writer.acknowledged + 1)])
            after.delete(*[f"{{{writer.tag}}}:seq:{number}" for number in range(writer.acknowledged + 1)])
        keys = set(client.scan_iter(count=1000))
        assert set(after.scan_iter(count=1000)) == keys
        for key in keys:
            assert contents(after, key) == contents(client, key), key
            assert (after.pttl(key) < 0) == (client.pttl(key) < 0), key

        # A directory that holds a backup is not written over; one without a
        # manifest is not restored.
        again = subprocess.run([str(BINARY), "backup", "--to", str(backup_dir), "--addr",
                                f"127.0.0.1:{source.port(0)}"], capture_output=True, text=True, timeout=60)
        assert again.returncode != 0 and "holds a backup already" in again.stderr
        (backup_dir / "manifest.json").unlink()
        refused = subprocess.run([str(BINARY), "restore", "--from", str(backup_dir), "--addr",
                                  f"127.0.0.1:{target.port(0)}"], capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and "incomplete" in refused.stderr
    finally:
        source.down()
        if target:
            target.down()
