"""``lbd dev add``: brokers joining a running dev cluster, as a cluster scales out."""

from __future__ import annotations

from pathlib import Path

import pytest

from lbd.devcluster.cluster import TRAFFIC_NAMESPACE, is_alive, load_cluster
from tests.e2e.clusters import Cluster, lbd, start_cluster, stop_cluster, wait_for

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]


def test_added_brokers_register_take_bundles_and_stop_with_the_cluster(tmp_path: Path) -> None:
    # Simulated brokers with traffic: the leader's shedding fills the new, empty broker.
    cluster = start_cluster(tmp_path, 2, secure=False, traffic=True, sim_brokers=True)
    try:
        added = lbd("dev", "add", "--brokers", "1", "--state-dir", str(tmp_path))
        assert added.returncode == 0, added.stderr
        assert added.stdout.startswith("broker-3: sidecar 127.0.0.1:")
        cluster = Cluster(load_cluster(tmp_path), tmp_path)
        assert cluster.broker_ids == ["broker-1", "broker-2", "broker-3"]
        for broker in cluster.broker_ids:
            listed = {b.info.broker_id for b in cluster.client(broker).brokers().brokers}
            assert listed == set(cluster.broker_ids), broker
        wait_for(
            "a bundle moved to broker-3",
            lambda: "broker-3" in cluster.owners(TRAFFIC_NAMESPACE).values() or None,
            timeout_s=60,
        )
        new = cluster.record.node("broker-3")
    finally:
        stop_cluster(cluster)
    assert not is_alive(new.sidecar) and not is_alive(new.broker)
