"""End to end: kill -9 of a sidecar and its broker, then of the leader's sidecar.

The tests run in order on one cluster of their own: the first leaves two brokers, the second one
live sidecar. Timings come from the dev cluster's settings (lease TTL 3 s, cleanup grace 7 s).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from lbd.core.shedding import SkipReason
from lbd.gen.v1 import lbd_pb2
from tests.e2e.clusters import (
    DEV,
    HANDOVER_S,
    Cluster,
    own_topics,
    serving_overlaps,
    start_cluster,
    stop_cluster,
    victim_owning,
    wait_for,
)

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]

NAMESPACE = "e2e/failover"
BUNDLES = 12
LEASE_TTL_S = DEV.etcd.lease_ttl_s
CLEANUP_GRACE_S = DEV.monitor.orphan_cleanup_grace_s
SLACK_S = 6.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    running = start_cluster(tmp_path_factory.mktemp("failover"))
    try:
        own_topics(running, NAMESPACE, BUNDLES)
        yield running
    finally:
        stop_cluster(running)


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def test_the_bundles_of_a_killed_sidecar_and_broker_move_to_live_brokers(cluster: Cluster) -> None:
    leader = cluster.client().leader().broker_id
    victim = victim_owning(cluster, NAMESPACE, leader)
    owners = cluster.owners(NAMESPACE, via=leader)
    orphans = sorted(b for b, o in owners.items() if o == victim)
    survivors = [b for b in cluster.broker_ids if b != victim]
    node = cluster.record.node(victim)

    cluster.killed_at_ns[victim] = time.monotonic_ns()
    kill(node.sidecar.pid)
    kill(node.broker.pid)
    start = time.monotonic()

    def moved() -> dict[str, str] | None:
        now = cluster.owners(NAMESPACE, via=leader)
        return now if all(now.get(b) in survivors for b in orphans) else None

    bound = LEASE_TTL_S + CLEANUP_GRACE_S + HANDOVER_S + SLACK_S
    now = wait_for(f"orphans of {victim} owned again", moved, bound, interval_s=0.2)
    took = time.monotonic() - start
    earliest = (CLEANUP_GRACE_S + HANDOVER_S) * 0.8
    assert took >= earliest, f"moved after {took:.1f}s: before the grace and the hand-over"
    assert all(o in survivors for o in now.values())
    owned_by = {(e["bundle"], e["broker"]) for e in cluster.events() if e["event"] == "own"}
    assert all((b, now[b]) in owned_by for b in orphans), "a new owner's broker never got Own"
    brokers = {b.info.broker_id for b in cluster.client(leader).brokers().brokers}
    assert brokers == set(survivors)


def test_killing_the_leader_s_sidecar_elects_a_new_leader_that_sheds(cluster: Cluster) -> None:
    live = [b for b in cluster.broker_ids if b not in cluster.killed_at_ns]
    old = cluster.client(live[0]).leader()
    alive = [b for b in live if b != old.broker_id]
    assert alive, "no live sidecar besides the leader's"
    witness = alive[0]
    kill(cluster.record.node(old.broker_id).sidecar.pid)
    start = time.monotonic()

    def new_leader() -> lbd_pb2.GetLeaderResponse | None:
        r = cluster.client(witness).leader()
        return r if r.broker_id and r.broker_id != old.broker_id else None

    elected = wait_for("a new leader", new_leader, LEASE_TTL_S + SLACK_S)
    assert elected.term > old.term
    assert elected.broker_id == witness
    print(f"new leader after {time.monotonic() - start:.1f}s")
    # Its duties start a moment after the election (FAILED_PRECONDITION until then).
    result = wait_for(
        "a shedding cycle on the new leader",
        lambda: cluster.client(witness).rebalance(dry_run=False),
        SLACK_S,
    )
    # The new leader ran a cycle: it moved bundles off survivors only, or said why it moved
    # none in one of Pulsar's words.
    if result.decisions:
        assert all(d.src_broker_id in alive for d in result.decisions), result
    else:
        assert result.skip_reason in {r.value for r in SkipReason}, result
    snapshot = cluster.client(witness).snapshot()
    assert '"brokers"' in snapshot.scenario_json


def test_no_two_brokers_ever_served_a_bundle_at_once(cluster: Cluster) -> None:
    assert serving_overlaps(cluster) == []
