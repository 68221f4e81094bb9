"""Malformed and forged values written straight to the state channel of a real dev cluster.

Each value is published with a plain Pulsar producer, as a buggy or hostile writer would. After
each one, every sidecar still answers ListBundles and WatchOwnership, all of them hold the same
table, nobody served a bundle twice; and at the end the leader's duties still work: a killed
broker's bundles are Owned again by live brokers within the orphan bound.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator

import pulsar
import pytest

from lbd.core.state import MAX_VALUE_BYTES
from lbd.devcluster.serving import dual_serving, serving_intervals
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from tests.e2e.clusters import (
    ORPHAN_BOUND_S,
    Cluster,
    own_topics,
    start_cluster,
    stop_cluster,
    victim_owning,
    wait_for,
)

pytestmark = [pytest.mark.servers, pytest.mark.timeout(300)]

NAMESPACE = "chaos/forged"
BUNDLES = 8
CHANNEL = "persistent://pulsar/system/loadbalancer-service-unit-state"
SLACK_S = 15.0

Forge = Callable[[dict[str, str]], tuple[str, bytes]]
"""Given bundle -> owner, the key and the raw value to publish."""


def _value(**fields: object) -> bytes:
    base: dict[str, object] = {
        "state": "Owned",
        "dst_broker": None,
        "source_broker": None,
        "split_children": None,
        "force": False,
        "timestamp_ms": int(time.time() * 1000),
        "version_id": 1,
        "leader_term": None,
    }
    base.update(fields)
    return json.dumps(base).encode()


def _first(owners: dict[str, str]) -> tuple[str, str]:
    return sorted(owners.items())[0]


BROKERS = ("broker-1", "broker-2", "broker-3")
"""The module's cluster (``lbd dev up`` names its brokers ``broker-N``)."""


def _other(owners: dict[str, str], than: str) -> str:
    """A broker other than ``than``: one that owns a bundle if any does (the earlier forged
    values may have left every bundle on one broker), else any other broker of the cluster."""
    others = sorted(set(owners.values()) - {than}) or [b for b in BROKERS if b != than]
    return others[0]


FORGED: dict[str, Forge] = {
    "not JSON": lambda o: (_first(o)[0], b"\x00\xff not json"),
    "version beyond int64": lambda o: (_first(o)[0], _value(version_id=2**64, dst_broker="x")),
    "negative version": lambda o: (_first(o)[0], _value(version_id=-5, dst_broker="x")),
    "unknown state": lambda o: (_first(o)[0], _value(state="Bogus", version_id=99)),
    "wrong types": lambda o: (_first(o)[0], _value(version_id="seven", dst_broker=12)),
    "oversized": lambda o: (
        _first(o)[0],
        _value(version_id=99, dst_broker="x" * (MAX_VALUE_BYTES + 1)),
    ),
    "not a bundle key": lambda o: ("no-such/bundle/zz", _value(version_id=1, dst_broker="x")),
    "forced with an enormous leader term": lambda o: (
        _first(o)[0],
        _value(
            state="Owned",
            version_id=10**6,
            dst_broker=_first(o)[1],
            force=True,
            leader_term=2**62,
        ),
    ),
    "forced with a term just above the leader's": lambda o: (
        sorted(o)[1],
        _value(
            state="Owned",
            version_id=10**6,
            dst_broker=o[sorted(o)[1]],
            force=True,
            leader_term=10**9,
        ),
    ),
    "forced Free of a served bundle": lambda o: (
        sorted(o)[2],
        _value(state="Free", version_id=10**7, source_broker=o[sorted(o)[2]], force=True),
    ),
    "tombstone of a served bundle": lambda o: (sorted(o)[3], b""),
    "version gap giving the bundle to another broker": lambda o: (
        _first(o)[0],
        _value(state="Owned", version_id=10**7, dst_broker=_other(o, _first(o)[1])),
    ),
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    running = start_cluster(
        tmp_path_factory.mktemp("forged"), len(BROKERS), "shedding.interval_s=3600"
    )
    try:
        own_topics(running, NAMESPACE, BUNDLES)
        yield running
    finally:
        stop_cluster(running)


@pytest.fixture(scope="module")
def producer(cluster: Cluster) -> Iterator[pulsar.Producer]:
    client = pulsar.Client(cluster.record.pulsar_url, operation_timeout_seconds=10)
    try:
        yield client.create_producer(CHANNEL, batching_enabled=False)
    finally:
        client.close()


def watch_snapshot(cluster: Cluster, addr: str) -> int:
    """How many bundles a WatchOwnership stream's snapshot holds (it must end cleanly)."""
    with cluster.channel(addr) as channel:
        stream = lbd_pb2_grpc.LoadBalancerStub(channel).WatchOwnership(
            lbd_pb2.WatchOwnershipRequest(namespace=NAMESPACE), timeout=10
        )
        for count, change in enumerate(stream):
            if change.snapshot_done:
                stream.cancel()
                return count
    raise AssertionError(f"{addr}: the WatchOwnership snapshot never ended")


def tables(cluster: Cluster) -> list[dict[str, tuple[int, str, int]]]:
    return [
        {
            b.bundle: (b.state, b.owner_broker_id, b.version_id)
            for b in cluster.client(x).bundles().bundles
        }
        for x in cluster.broker_ids
    ]


@pytest.mark.parametrize("kind", list(FORGED))
def test_a_forged_value_breaks_no_rpc_and_splits_no_table(
    cluster: Cluster, producer: pulsar.Producer, kind: str
) -> None:
    owners = cluster.owners(NAMESPACE)
    key, raw = FORGED[kind](owners)
    producer.send(raw, partition_key=key)

    # Every sidecar applied it (or skipped it) the same way: the tables settle equal.
    def same() -> bool | None:
        seen = tables(cluster)
        return True if all(t == seen[0] for t in seen) else None

    wait_for("every sidecar's table the same", same, 10)
    for node in cluster.record.nodes:
        assert watch_snapshot(cluster, node.grpc_addr) == BUNDLES
    after = cluster.owners(NAMESPACE)
    assert len(after) == BUNDLES, f"{kind}: a bundle is no longer Owned: {after}"
    assert dual_serving(serving_intervals(cluster.events(), cluster.killed_at_ns)) == []


def test_after_every_forged_value_the_leader_still_reassigns_a_dead_brokers_bundles(
    cluster: Cluster,
) -> None:
    leader = cluster.client().leader().broker_id
    victim = victim_owning(cluster, NAMESPACE, leader)
    node = cluster.record.node(victim)
    cluster.killed_at_ns[victim] = time.monotonic_ns()
    os.kill(node.sidecar.pid, signal.SIGKILL)
    os.kill(node.broker.pid, signal.SIGKILL)
    wait_for(
        f"{victim} deregistered",
        lambda: (
            True
            if victim not in {b.info.broker_id for b in cluster.client(leader).brokers().brokers}
            else None
        ),
        ORPHAN_BOUND_S,
    )

    def moved() -> bool | None:
        now = cluster.owners(NAMESPACE, via=leader)
        live = {b.info.broker_id for b in cluster.client(leader).brokers().brokers}
        return True if len(now) == BUNDLES and set(now.values()) <= live else None

    wait_for("every bundle Owned by a live broker", moved, ORPHAN_BOUND_S + SLACK_S, 0.2)
    assert dual_serving(serving_intervals(cluster.events(), cluster.killed_at_ns)) == []
