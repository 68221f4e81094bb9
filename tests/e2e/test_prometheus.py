"""The alert rules of ``deploy/prometheus`` in a real Prometheus scraping a real dev cluster.

Prometheus (Debian's package) scrapes every sidecar's ``/metrics`` each second and evaluates the
rules of ``deploy/prometheus/lbd-alerts.yml`` each second, their ``for`` cut to 1s (the
expressions are exactly those of ``deploy/``). On the healthy cluster no alert is even pending.
Then etcd and pulsar-lite are frozen (SIGSTOP): every sidecar loses both its lease and its channel
read barrier, fences itself within ``etcd.fence_after_s``, and ``LbdFenced`` fires for each; once
they are thawed the sidecars unfence and the alert resolves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lbd.devcluster import free_port
from lbd.devcluster.faults import freeze
from lbd.devcluster.servers import die_with_parent_prefix
from tests.e2e.clusters import Cluster, start_cluster, stop_cluster, wait_for
from tests.prometheus_tools import binary, write_rules_with_for

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]

START_TIMEOUT_S = 30.0
ALERT_TIMEOUT_S = 60.0
QUIET_EVALUATIONS_S = 5.0
"""How long the healthy cluster is watched: several scrapes and rule evaluations."""
SETTLING = frozenset({"LbdLoadStdOverTarget"})
"""Alerts a healthy cluster just started may meet for a moment, left out of the quiet check: the
brokers' first load reports are uneven (start-up CPU; seen in CI at a std of 0.125), which the
rule's real hold of 30 minutes rides out and a hold cut to 1 s does not."""
HTTP_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A 3-broker dev cluster without periodic shedding, its leader elected."""
    running = start_cluster(tmp_path_factory.mktemp("prom"), 3, "shedding.interval_s=3600")
    try:
        wait_for("a leader", lambda: running.client().leader().broker_id or None, 30)
        yield running
    finally:
        stop_cluster(running)


class Prometheus:
    """A Prometheus on a free loopback port, and the parts of its HTTP API the test reads."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        rules = write_rules_with_for(workdir / "lbd-alerts.json", "1s")
        config = {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "evaluation_interval": "1s",
            },
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "lbd", "static_configs": [{"targets": targets}]}],
        }
        (workdir / "prometheus.json").write_text(json.dumps(config, indent=2))
        self.addr = f"127.0.0.1:{free_port()}"
        self.log = workdir / "prometheus.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [
                    *die_with_parent_prefix(),
                    binary("prometheus"),
                    f"--config.file={workdir / 'prometheus.json'}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address={self.addr}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def get(self, path: str) -> Any:
        """The ``data`` of an API answer."""
        with urllib.request.urlopen(f"http://{self.addr}{path}", timeout=HTTP_TIMEOUT_S) as r:
            answer = json.load(r)
        assert answer["status"] == "success", answer
        return answer["data"]

    def ready(self) -> bool | None:
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://{self.addr}/-/ready", timeout=HTTP_TIMEOUT_S):
                return True
        except (urllib.error.URLError, ConnectionError):
            return None

    def alerts(self, state: str | None = None) -> list[dict[str, Any]]:
        """Active alerts (pending or firing; only ``state`` when given)."""
        found: list[dict[str, Any]] = self.get("/api/v1/alerts")["alerts"]
        return [a for a in found if state is None or a["state"] == state]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()


@pytest.fixture
def prometheus(cluster: Cluster, tmp_path: Path) -> Iterator[Prometheus]:
    targets = [node.metrics_addr for node in cluster.record.nodes]
    server = Prometheus(tmp_path / "prometheus", targets)
    try:
        wait_for("prometheus ready", server.ready, START_TIMEOUT_S)
        yield server
    finally:
        server.stop()


def scraped(prometheus: Prometheus, targets: set[str]) -> bool | None:
    """True once every target was scraped successfully."""
    active = prometheus.get("/api/v1/targets?state=active")["activeTargets"]
    up = {t["labels"]["instance"] for t in active if t["health"] == "up"}
    return True if up >= targets else None


def fenced_instances(prometheus: Prometheus) -> set[str]:
    return {
        a["labels"]["instance"]
        for a in prometheus.alerts("firing")
        if a["labels"]["alertname"] == "LbdFenced"
    }


def test_no_alert_on_a_healthy_cluster_and_lbd_fenced_fires_when_sidecars_fence(
    cluster: Cluster, prometheus: Prometheus
) -> None:
    targets = {node.metrics_addr for node in cluster.record.nodes}
    wait_for("every sidecar scraped", lambda: scraped(prometheus, targets), START_TIMEOUT_S)
    leaders = prometheus.get("/api/v1/query?query=sum(lbd_is_leader)")["result"]
    assert [float(r["value"][1]) for r in leaders] == [1.0]

    # Firing is what reaches an operator; a rule may be pending for a moment on a loaded machine
    # (a leader re-elected within the dev cluster's 3 s lease TTL), which its `for` is there for.
    deadline = time.monotonic() + QUIET_EVALUATIONS_S
    while time.monotonic() < deadline:
        firing = [
            a for a in prometheus.alerts("firing") if a["labels"]["alertname"] not in SETTLING
        ]
        assert firing == []
        time.sleep(0.5)

    servers = (cluster.record.etcd.pid, cluster.record.pulsar.pid)
    try:
        for pid in servers:
            freeze(pid)
        wait_for(
            "LbdFenced firing for every sidecar",
            lambda: True if fenced_instances(prometheus) == targets else None,
            ALERT_TIMEOUT_S,
            interval_s=0.5,
        )
        firing = [a for a in prometheus.alerts("firing") if a["labels"]["alertname"] == "LbdFenced"]
        assert {a["labels"]["severity"] for a in firing} == {"critical"}
        assert all(a["annotations"]["runbook_url"] for a in firing)
    finally:
        for pid in servers:
            os.kill(pid, signal.SIGCONT)
    wait_for(
        "LbdFenced resolved",
        lambda: True if not fenced_instances(prometheus) else None,
        ALERT_TIMEOUT_S,
        interval_s=0.5,
    )
