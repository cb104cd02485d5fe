"""A job queue library as its users run it: Celery (from PyPI) with its Redis
broker and result backend, on a Tessera cluster. Celery's Redis transport
(kombu) speaks to one server with lists, blocking pops over several keys,
sorted sets, hashes, transactions with WATCH, Lua scripts and pub/sub; a
global key prefix with a hash tag (`{celery}:`), which kombu and Celery
support for this, puts every key in one slot, served by its group's head.
"""

import os
import subprocess
import sys
import textwrap
import time

import redis
from redis.crc import key_slot

from test_cluster import cluster_factory  # noqa: F401  (a fixture)

TASKS = textwrap.dedent("""
    import os
    from celery import Celery, chord, group

    broker = os.environ["TESSERA_BROKER"]
    app = Celery("jobs", broker=broker, backend=broker)
    prefix = {"global_keyprefix": "{celery}:"}
    app.conf.update(broker_transport_options=prefix, result_backend_transport_options=prefix,
                    task_acks_late=True, worker_prefetch_multiplier=4, broker_connection_retry_on_startup=True)

    attempts = {}

    @app.task
    def add(x, y):
        return x + y

    @app.task
    def total(numbers):
        return sum(numbers)

    @app.task(bind=True, max_retries=3, default_retry_delay=0.2)
    def flaky(self, key):
        # Fails its first run, then succeeds: a retry goes through the broker again.
        attempts[key] = attempts.get(key, 0) + 1
        if attempts[key] == 1:
            raise self.retry()
        return f"{key} after {attempts[key]} runs"
""")


def test_celery_runs_jobs_through_a_tessera_cluster(cluster_factory, tmp_path):
    cluster = cluster_factory("strong", nodes=3)
    head = cluster.client().nodes_manager.get_node_from_slot(key_slot(b"celery"))
    broker = f"redis://{head.host}:{head.port}/0"
    (tmp_path / "jobs.py").write_text(TASKS)
    environment = {**os.environ, "TESSERA_BROKER": broker, "PYTHONPATH": str(tmp_path)}
    celery = os.path.join(os.path.dirname(sys.executable), "celery")
    worker = subprocess.Popen(
        [celery, "-A", "jobs", "worker", "--pool", "threads", "--concurrency", "4", "--loglevel", "INFO",
         "--without-heartbeat"],
        cwd=tmp_path, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        sys.path.insert(0, str(tmp_path))
        os.environ["TESSERA_BROKER"] = broker
        import jobs

        results = [jobs.add.delay(n, n) for n in range(200)]
        assert [result.get(timeout=60) for result in results] == [2 * n for n in range(200)]
        assert jobs.group(jobs.add.s(n, 1) for n in range(20)).apply_async().get(timeout=60) == list(range(1, 21))
        assert jobs.chord(jobs.add.s(n, n) for n in range(10))(jobs.total.s()).get(timeout=60) == 90
        assert jobs.flaky.delay("job").get(timeout=60) == "job after 2 runs"
        # Every key Celery made is in the tag's slot, and the queue drained.
        plain = redis.Redis(host=head.host, port=head.port)
        keys = [key for key in plain.keys("*") if not key.startswith(b"tessera:")]  # the cluster's own probes
        assert keys and all(key.startswith(b"{celery}:") for key in keys), keys[:10]
        deadline = time.monotonic() + 10
        while plain.llen("{celery}:celery") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert plain.llen("{celery}:celery") == 0
    finally:
        worker.terminate()
        output, _ = worker.communicate(timeout=30)
        sys.path.remove(str(tmp_path))
        sys.modules.pop("jobs", None)
    assert "Traceback" not in output, output[-4000:]
    assert "succeeded" in output, output[-4000:]
