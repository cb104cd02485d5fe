"""The coordinator's dashboard in a real browser: Debian's headless Chromium,
driven by Selenium through Debian's chromedriver, opens the page of a live
cluster, checks the topology it draws against the coordinator's map, sees a
node's kill turn into failovers, and saves a screenshot of each
(target/test-artifacts/)."""

import os
import shutil
import time
import urllib.error
import urllib.request

import pytest

from conftest import ROOT
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
    from selenium.webdriver.common.by import By

    return page.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr")


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
        wait_until(lambda: all(row.get_attribute("data-alive") == "true" for row in rows(page, "nodes")),
                   "every node alive")
        heads = {str(shard["id"]): str(shard["members"][0]) for shard in cluster.map()["shards"]}
        shown = {row.get_attribute("data-shard"): row.get_attribute("data-head") for row in rows(page, "shards")}
        assert shown == heads
        assert "epoch" in page.find_element("id", "status").text
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.save_screenshot(str(ARTIFACTS / "dashboard-before-failover.png"))

        cluster.cli("kill", "1")
        node_1 = lambda: next(row for row in rows(page, "nodes") if row.get_attribute("data-node") == "1")
        wait_until(lambda: node_1().get_attribute("data-alive") == "false", "node 1 silent")
        wait_until(lambda: any(row.get_attribute("data-failover") == "true" for row in rows(page, "decisions")),
                   "a failover among the decisions")
        wait_until(lambda: all(row.get_attribute("data-head") != "1" for row in rows(page, "shards")),
                   "no group headed by node 1")
        decisions = " ".join(row.text for row in rows(page, "decisions"))
        assert "failover" in decisions and "replica removed" in decisions, decisions
        page.save_screenshot(str(ARTIFACTS / "dashboard-after-failover.png"))
    finally:
        if page is not None:
            page.quit()
        cluster.down()
