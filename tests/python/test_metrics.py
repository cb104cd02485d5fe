"""A live cluster as monitoring sees it: Debian's Prometheus scrapes the
metrics endpoint of every node and of the coordinator with the configuration
`cluster up --metrics-base-port` writes, and Debian's redis_exporter reads a
node as it reads a Redis Cluster node. The series must exist, move under load
and show a failover."""

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import redis

from test_cluster import NODES, LocalCluster, free_base_port


def program(name):
    path = shutil.which(name)
    if path is None:
        if os.environ.get("TESSERA_REQUIRE_EXTERNAL") == "1":
            pytest.fail(f"{name} is missing (scripts/test-all.sh installs it)")
        pytest.skip(f"{name} is not installed")
    return path


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(url, token=None, timeout=5):
    """(status, body) of a GET."""
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


class Prometheus:
    """A Prometheus server on a free port, with its own storage."""

    def __init__(self, directory, config):
        self.port = free_port()
        config_path = directory / "prometheus.yml"
        config_path.write_text(config)
        self.log = open(directory / "prometheus.log", "wb")
        self.process = subprocess.Popen(
            [program("prometheus"), f"--config.file={config_path}", f"--storage.tsdb.path={directory / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=self.log)
        deadline = time.time() + 30
        while not (self.listening() and http_get(self.url("/-/ready"))[0] == 200):
            assert self.process.poll() is None, (directory / "prometheus.log").read_text()
            assert time.time() < deadline, "prometheus did not become ready"
            time.sleep(0.2)

    def listening(self):
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            return True
        except OSError:
            return False

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def query(self, expression):
        """The instant vector `expression` gives now, as {labels: value}."""
        status, body = http_get(self.url("/api/v1/query?" + urllib.parse.urlencode({"query": expression})))
        assert status == 200, body
        result = json.loads(body)["data"]["result"]
        return {tuple(sorted(row["metric"].items())): float(row["value"][1]) for row in result}

    def value(self, expression):
        """The single value `expression` gives, or None while it gives none."""
        values = list(self.query(expression).values())
        assert len(values) <= 1, values
        return values[0] if values else None

    def wait_for(self, expression, condition, timeout=30):
        """Until the value of `expression` satisfies `condition`; returns it."""
        deadline = time.time() + timeout
        while True:
            value = self.value(expression)
            if value is not None and condition(value):
                return value
            assert time.time() < deadline, f"{expression} stayed at {value}"
            time.sleep(0.5)

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=30)


def test_prometheus_and_redis_exporter_watch_a_cluster_through_load_and_a_failover(tmp_path):
    exporter_binary = program("prometheus-redis-exporter")
    cluster = LocalCluster(tmp_path, "strong")
    cluster_ports = {cluster.base_port + offset for offset in range(NODES + 3)}
    metrics_base = free_base_port(NODES + 2)
    while cluster_ports & set(range(metrics_base, metrics_base + NODES + 3)):
        metrics_base = free_base_port(NODES + 2)
    cluster.options = ["--metrics-base-port", str(metrics_base)]
    exporter_port = free_port()
    exporter = prometheus = None
    try:
        cluster.up()
        token = (cluster.dir / "metrics.token").read_text().strip()
        node_metrics = f"http://127.0.0.1:{metrics_base + 1}/metrics"
        assert http_get(node_metrics)[0] == 401, "a scrape without the token is refused"
        assert http_get(node_metrics, token="x" * len(token))[0] == 401
        status, page = http_get(node_metrics, token=token)
        assert status == 200 and "tessera_group_info" in page and page.endswith("# EOF\n"), page[-300:]

        # redis_exporter reads node 0 as a Redis Cluster node; Prometheus
        # scrapes it beside the cluster's own endpoints.
        exporter = subprocess.Popen(
            [exporter_binary, "--redis.addr", f"redis://127.0.0.1:{cluster.port(0)}",
             "--web.listen-address", f"127.0.0.1:{exporter_port}"],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "exporter.log", "wb"))
        config = (cluster.dir / "prometheus.yml").read_text().replace("scrape_interval: 5s", "scrape_interval: 1s")
        config += f"  - job_name: redis-exporter\n    static_configs:\n      - targets: ['127.0.0.1:{exporter_port}']\n"
        prometheus = Prometheus(tmp_path, config)

        prometheus.wait_for('count(up{job="tessera-nodes"} == 1)', lambda count: count == NODES)
        prometheus.wait_for('up{job="tessera-coordinator"}', lambda up: up == 1)
        assert prometheus.wait_for("tessera_coordinator_leader", lambda leader: leader == 1)
        shards = prometheus.wait_for("count(tessera_coordinator_shard_view)", lambda count: count > 0)
        # Every shard has one head, and three replicas across the nodes.
        prometheus.wait_for('count(tessera_group_info{role="head"})', lambda count: count == shards)
        prometheus.wait_for("count(tessera_group_info)", lambda count: count == 3 * shards)
        for up in ["redis_up", "redis_cluster_enabled", "redis_cluster_state"]:
            prometheus.wait_for(up, lambda value: value == 1)
        prometheus.wait_for("redis_cluster_slots_ok", lambda slots: slots == 16384)
        prometheus.wait_for("redis_cluster_known_nodes", lambda nodes: nodes == NODES)

        # Load moves the command counters, the latency histograms and the keys.
        sets_before = prometheus.wait_for('sum(tessera_command_calls_total{command="set"})', lambda _: True)
        client = cluster.client()
        keys = 600
        for index in range(keys):
            client.set(f"metrics:{index}", "v" * 32)
        prometheus.wait_for('sum(tessera_command_calls_total{command="set"})', lambda sets: sets >= sets_before + keys)
        # By table too: the cluster's tables, as its map names them.
        prometheus.wait_for('sum(tessera_table_commands_total{table="default"})', lambda calls: calls >= keys)
        prometheus.wait_for("sum(tessera_group_keys)", lambda stored: stored >= 3 * keys)
        prometheus.wait_for('sum(tessera_group_applied_writes{group="0"})', lambda applied: applied > 0)
        # Memory by group, as the expiry sweep's census estimates it: at least
        # the keys' and values' bytes, once per key (heads only).
        prometheus.wait_for("count(tessera_group_bytes)", lambda count: count == shards)
        prometheus.wait_for("sum(tessera_group_bytes)", lambda stored: stored >= keys * (len("metrics:000") + 32))
        p99 = prometheus.wait_for(
            'histogram_quantile(0.99, sum by (le) (rate(tessera_command_duration_seconds_bucket{command="set"}[1m])))',
            lambda seconds: seconds > 0)
        assert p99 < 1.0, p99
        prometheus.wait_for("sum(rate(tessera_net_input_bytes_total[1m]))", lambda rate: rate > 0)
        # Every head reports its lag (a chain's other members too), which drains
        # once the load stops.
        prometheus.wait_for("count(tessera_group_replication_lag_writes)", lambda count: count >= shards)
        prometheus.wait_for("max(tessera_group_replication_lag_writes)", lambda writes: writes == 0)
        prometheus.wait_for('redis_commands_total{cmd="set"}', lambda sets: sets > 0)
        prometheus.wait_for("redis_connected_clients", lambda clients: clients >= 1)

        # A failover shows on the coordinator and on the node that goes.
        epoch = prometheus.value("tessera_coordinator_epoch")
        failovers = prometheus.value("tessera_coordinator_failovers_total") or 0
        cluster.cli("kill", "1")
        prometheus.wait_for(f'up{{instance="127.0.0.1:{metrics_base + 2}"}}', lambda up: up == 0)
        prometheus.wait_for("tessera_coordinator_failovers_total", lambda count: count > failovers)
        prometheus.wait_for("tessera_coordinator_epoch", lambda now: now > epoch)
        prometheus.wait_for('sum(tessera_coordinator_view_changes_total{reason!=""})', lambda count: count > 0)
        # The members that remain hold leases the coordinator renews.
        prometheus.wait_for("max(tessera_group_lease_remaining_seconds)", lambda seconds: seconds > 0)
    finally:
        if prometheus:
            prometheus.stop()
        if exporter:
            exporter.send_signal(signal.SIGTERM)
            exporter.wait(timeout=10)
        cluster.down()


def test_a_node_reports_each_tables_keys_bytes_commands_and_errors(data_dir):
    """A node of its own: keys and estimated bytes per table and engine, the
    bytes at least what the keys and values hold; commands and errors by
    the table of their first key, in the metrics and in INFO tables."""
    from conftest import Node, free_port
    metrics_port = free_port()
    node = Node(data_dir, "--metrics-bind", f"127.0.0.1:{metrics_port}", "--expiry-sweep-interval-ms", "10").start()
    try:
        client = node.client()
        client.execute_command("TABLE.CREATE", "users", "PREFIX", "u:", "ENGINE", "ordered")
        for index in range(500):
            client.set(f"u:{index:03}", "x" * 100)
        client.rpush("queue", *[f"job-{index:04}" * 10 for index in range(1_000)])

        def scrape():
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
            return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines() if line.startswith("tessera_table_")}

        # Until a whole pass of the sweep began after the writes: one under
        # way while they ran counts only the keys it met.
        users_bytes, list_bytes = 500 * (5 + 100), 1_000 * len("job-0000" * 10)
        deadline = time.time() + 30
        while True:
            series = scrape()
            users = series.get('tessera_table_bytes{table="users",engine="ordered"}', 0)
            default = series.get('tessera_table_bytes{table="default",engine="memory"}', 0)
            if users >= users_bytes and default >= list_bytes:
                break
            assert time.time() < deadline, series
            time.sleep(0.1)
        with pytest.raises(redis.ResponseError):
            client.incr("u:000")  # not an integer: an error of table users
        client.lpop("queue")
        client.ping()  # no key, no table
        series = scrape()
        assert series['tessera_table_commands_total{table="users"}'] == 501, series
        assert series['tessera_table_command_errors_total{table="users"}'] == 1, series
        assert series['tessera_table_commands_total{table="default"}'] == 2, series
        assert series['tessera_table_command_errors_total{table="default"}'] == 0, series
        tables = client.info("tables")
        assert tables["table_users"]["calls"] == 501 and tables["table_users"]["failed_calls"] == 1, tables
        assert series['tessera_table_keys{table="users",engine="ordered"}'] == 500
        assert series['tessera_table_keys{table="default",engine="memory"}'] == 1
        assert users < users_bytes * 4, users
        assert default < list_bytes * 4, default
    finally:
        node.stop()
