"""The coordinator's dashboard in a real browser: Debian's headless Chromium,
driven by Selenium through Debian's chromedriver, opens the page of a live
cluster, checks the topology it draws against the coordinator's map, sees a
node's kill turn into failovers, and saves a screenshot of each
(target/test-artifacts/)."""

import os
import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest
import redis

from conftest import ROOT, table_info
from test_cluster import NODES, LocalCluster, free_base_port

ARTIFACTS = ROOT / "target" / "test-artifacts"


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        if os.environ.get("TESSERA_REQUIRE_EXTERNAL") == "1":
            pytest.fail("chromium and chromium-driver are missing (scripts/test-all.sh installs them)")
        pytest.skip("chromium or chromedriver is not installed")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1200,1400"]:
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(driver), options=options)


def wait_until(condition, what, timeout=30):
    deadline = time.time() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.time() < deadline, f"the page never showed {what}"
        time.sleep(0.25)


def rows(page, table):
    """The rows of `table` as the page shows them now, read in one step (the
    page redraws every second, so elements found earlier go stale): each
    row's data attributes, its cells' text and its cells' classes."""
    return page.execute_script(
        """
        return [...document.querySelectorAll(`#${arguments[0]} tbody tr`)].map(row => ({
            data: {...row.dataset},
            cells: [...row.cells].map(cell => cell.textContent),
            classes: [...row.cells].map(cell => cell.className),
            text: row.textContent,
        }));
        """,
        table,
    )


def test_the_dashboard_shows_the_topology_and_a_failover_as_it_happens(tmp_path):
    cluster = LocalCluster(tmp_path, "strong")
    dashboard_port = free_base_port(0)
    while dashboard_port in range(cluster.base_port, cluster.base_port + NODES + 3):
        dashboard_port = free_base_port(0)
    cluster.options = ["--dashboard-port", str(dashboard_port)]
    page = None
    try:
        cluster.up()
        base = f"http://127.0.0.1:{dashboard_port}"
        token = (cluster.dir / "dashboard.token").read_text().strip()
        # The page holds no data; the data needs the token.
        with urllib.request.urlopen(base + "/", timeout=5) as response:
            assert response.status == 200 and b"/api/state" in response.read()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + "/api/state", timeout=5)
        assert refused.value.code == 401

        page = browser()
        page.get(base + "/")
        wait_until(lambda: "token" in page.find_element("id", "status").text, "that it needs its token")

        page.get(f"{base}/#token={token}")
        page.refresh()
        shards = cluster.map()["shards"]
        wait_until(lambda: len(rows(page, "nodes")) == NODES and len(rows(page, "shards")) == len(shards),
                   "every node and group")
        wait_until(lambda: all(row["data"]["alive"] == "true" for row in rows(page, "nodes")), "every node alive")
        heads = {str(shard["id"]): str(shard["members"][0]) for shard in cluster.map()["shards"]}
        shown = {row["data"]["shard"]: row["data"]["head"] for row in rows(page, "shards")}
        assert shown == heads
        assert "epoch" in page.find_element("id", "status").text

        # Writes show as writes per second at the nodes that head them, reads
        # as reads per second at the nodes that serve them, with latency.
        writing = threading.Event()

        def write():
            client = cluster.client()
            index = 0
            while not writing.is_set():
                client.set(f"dashboard:{index}", "v")
                client.get(f"dashboard:{index}")
                index += 1

        writer = threading.Thread(target=write)
        writer.start()
        try:
            def shown_rates():
                return [int(text) for row in rows(page, "nodes")
                        for text, kind in zip(row["cells"], row["classes"]) if kind == "writes" and text.isdigit()]
            wait_until(lambda: sum(shown_rates()) > 0, "writes per second")

            def shown(kind):
                return [text for row in rows(page, "nodes")
                        for text, cell_kind in zip(row["cells"], row["classes"]) if cell_kind == kind]
            wait_until(lambda: sum(int(text) for text in shown("reads") if text.isdigit()) > 0, "reads per second")
            wait_until(lambda: len(shown("latency")) == NODES
                       and all(" / " in text and "s" in text for text in shown("latency")),
                       "every node's latency")
        finally:
            writing.set()
            writer.join()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.save_screenshot(str(ARTIFACTS / "dashboard-before-failover.png"))

        cluster.cli("kill", "1")
        node_1 = lambda: next(row for row in rows(page, "nodes") if row["data"]["node"] == "1")
        wait_until(lambda: node_1()["data"]["alive"] == "false", "node 1 silent")
        wait_until(lambda: any(row["data"]["failover"] == "true" for row in rows(page, "decisions")),
                   "a failover among the decisions")
        wait_until(lambda: all(row["data"]["head"] != "1" for row in rows(page, "shards")),
                   "no group headed by node 1")
        decisions = " ".join(row["text"] for row in rows(page, "decisions"))
        assert "failover" in decisions and "replica removed" in decisions, decisions
        page.save_screenshot(str(ARTIFACTS / "dashboard-after-failover.png"))
    finally:
        if page is not None:
            page.quit()
        cluster.down()


def test_a_cluster_laid_out_in_the_designer_starts_as_designed(tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    # The designer is a page of the dashboard: a cluster serves it.
    host = LocalCluster(tmp_path / "host", "strong")
    dashboard_port = free_base_port(0)
    host.options = ["--dashboard-port", str(dashboard_port)]
    designed = LocalCluster(tmp_path / "designed", "strong")
    used = set(range(host.base_port, host.base_port + NODES + 3)) | {dashboard_port}
    while used & set(range(designed.base_port, designed.base_port + 8)):
        designed = LocalCluster(tmp_path / "designed", "strong")
    page = None
    try:
        host.up(nodes=3)
        page = browser()
        page.get(f"http://127.0.0.1:{dashboard_port}/designer")

        def set_number(field, value):
            element = page.find_element("id", field)
            element.clear()
            element.send_keys(str(value))

        # A mistake is named, and no file is offered.
        set_number("nodes", 2)
        wait_until(lambda: "cannot keep 3 replicas" in page.find_element("id", "errors").text, "the mistake")
        assert page.find_element("id", "config").text == ""

        set_number("nodes", 4)
        set_number("groups", 8)
        set_number("base_port", designed.base_port)
        Select(page.find_element("id", "consistency")).select_by_visible_text("eventual")
        page.find_element("id", "add_table").click()
        row = page.find_elements(By.CSS_SELECTOR, "#tables tbody tr")[0]
        row.find_element(By.CLASS_NAME, "table-name").send_keys("events")
        row.find_element(By.CLASS_NAME, "table-prefix").send_keys("ev:")
        Select(row.find_element(By.CLASS_NAME, "table-engine")).select_by_visible_text("lsm")
        Select(row.find_element(By.CLASS_NAME, "table-mode")).select_by_visible_text("aa+ec")
        config = wait_until(lambda: page.find_element("id", "config").text, "the configuration")
        assert page.find_element("id", "errors").text == ""
        heads = page.execute_script(
            "return [...document.querySelectorAll('.group.head')].map(tag => [tag.dataset.group, tag.dataset.members])")
        planned = {int(group): [int(node) for node in members.split(",")] for group, members in heads}
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.save_screenshot(str(ARTIFACTS / "designer.png"))

        path = tmp_path / "cluster.toml"
        path.write_text(config + "\n")
        designed.nodes = 4
        started = designed.cli("up", "--config", str(path), "--no-demo", "--lease-ms", "400",
                               "--failure-timeout-ms", "700")
        assert "table events" in started.stdout, started.stdout
        shards = [shard for shard in designed.map()["shards"] if shard["table"] == "default"]
        assert {shard["id"]: shard["members"] for shard in shards} == planned, "placed as the designer showed"
        assert designed.map()["mode"] == "primary-backup", "master–slave, eventual"
        info = table_info(redis.Redis(port=designed.port(0), socket_timeout=10), "events")
        assert info[b"engine"] == b"lsm" and info[b"mode"] == b"aa+ec", info
    finally:
        if page is not None:
            page.quit()
        host.down()
        designed.down()

