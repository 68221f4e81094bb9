"""A paused sidecar on a real dev cluster (SIGSTOP, as in a long GC pause or a frozen VM).

A paused process cannot fence itself, and its broker's stream stays open: what stops the broker
is its serving lease, which the paused sidecar no longer renews. The sidecar stays paused for
twice the etcd lease TTL plus the orphan cleanup grace, long enough for the leader to hand its
bundles to others; the brokers' event logs must show no instant when two brokers served one
bundle, and every bundle must end Owned by a live broker.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from lbd.devcluster.serving import dual_serving, serving_intervals
from tests.e2e.clusters import (
    Cluster,
    own_topics,
    serving_overlaps,
    start_cluster,
    stop_cluster,
    victim_owning,
    wait_for,
)

pytestmark = [pytest.mark.servers, pytest.mark.timeout(240)]

NAMESPACE = "chaos/pauses"
BUNDLES = 12
LEASE_TTL_S = 3.0
CLEANUP_GRACE_S = 7.0
PAUSE_S = 2 * LEASE_TTL_S + CLEANUP_GRACE_S
SETTLE_S = 20.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    running = start_cluster(tmp_path_factory.mktemp("pauses"), 3, "shedding.interval_s=3600")
    try:
        own_topics(running, NAMESPACE, BUNDLES)
        yield running
    finally:
        stop_cluster(running)


def pause_sidecar(cluster: Cluster, victim: str, witness: str) -> list[str]:
    """Pause ``victim``'s sidecar until its bundles are Owned elsewhere (at least PAUSE_S),
    resume it; the bundles it owned before."""
    owned = sorted(b for b, o in cluster.owners(NAMESPACE, via=witness).items() if o == victim)
    assert owned, f"{victim} owns nothing to lose"
    pid = cluster.record.node(victim).sidecar.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()

        def moved() -> bool | None:
            now = cluster.owners(NAMESPACE, via=witness)
            return True if all(now.get(b) not in (None, victim) for b in owned) else None

        wait_for(f"the bundles of paused {victim} owned elsewhere", moved, PAUSE_S + SETTLE_S)
        time.sleep(max(0.0, PAUSE_S - (time.monotonic() - started)))
    finally:
        os.kill(pid, signal.SIGCONT)
    return owned


def assert_served_once(cluster: Cluster) -> None:
    """No dual serving: in intervals cut at lease ends, and in what the brokers logged (a broker
    that is not paused logs its own stop when its lease runs out)."""
    assert dual_serving(serving_intervals(cluster.events(), cluster.killed_at_ns)) == []
    assert serving_overlaps(cluster) == []


def registered(cluster: Cluster, via: str) -> set[str]:
    """The brokers registered, as one sidecar sees them."""
    return {b.info.broker_id for b in cluster.client(via).brokers().brokers}


def converged(cluster: Cluster, witness: str) -> None:
    """Every bundle of the namespace Owned by a registered broker, as the witness sees it."""

    def check() -> bool | None:
        owners = cluster.owners(NAMESPACE, via=witness)
        live = registered(cluster, witness)
        return True if len(owners) == BUNDLES and set(owners.values()) <= live else None

    wait_for("every bundle Owned by a live broker", check, SETTLE_S)


def test_a_paused_follower_sidecars_broker_stops_before_its_bundles_move(cluster: Cluster) -> None:
    leader = cluster.client().leader().broker_id
    # The assigner, not the sidecar asked, chose the owners: a follower that owns something
    # (moved there first when the assigner placed every bundle on the leader's broker).
    victim = victim_owning(cluster, NAMESPACE, leader)
    pause_sidecar(cluster, victim, witness=leader)
    converged(cluster, leader)
    assert_served_once(cluster)


def test_a_paused_leader_sidecars_broker_stops_before_its_bundles_move(cluster: Cluster) -> None:
    old = cluster.client().leader().broker_id
    witness = next(b for b in cluster.broker_ids if b != old)
    if not any(o == old for o in cluster.owners(NAMESPACE, via=witness).values()):
        cluster.client(witness).transfer(next(iter(cluster.owners(NAMESPACE, via=witness))), old)
    pause_sidecar(cluster, old, witness=witness)
    converged(cluster, witness)
    assert_served_once(cluster)


def test_a_paused_broker_loses_its_bundles_only_after_its_lease(cluster: Cluster) -> None:
    leader = cluster.client().leader().broker_id
    # A sidecar paused by an earlier test may still be registering its broker again.
    wait_for(
        "every broker registered",
        lambda: True if registered(cluster, leader) == set(cluster.broker_ids) else None,
        SETTLE_S,
    )
    victim = victim_owning(cluster, NAMESPACE, leader)
    owners = cluster.owners(NAMESPACE, via=leader)
    moved = next(b for b, o in sorted(owners.items()) if o == victim)
    pid = cluster.record.node(victim).broker.pid
    os.kill(pid, signal.SIGSTOP)  # its stream stays open; it acks nothing, asks for nothing
    try:
        # An operator (or the shedder) moves one of its bundles meanwhile: the Release is never
        # acknowledged, so the move waits out the paused broker's lease.
        done = cluster.client(leader).transfer(moved, leader)
        assert done.dst_broker_id == leader
        # Silent past broker.silence_timeout_s, it is deregistered; its other bundles follow
        # the orphan path.
        wait_for(
            f"paused {victim} deregistered",
            lambda: True if victim not in registered(cluster, leader) else None,
            SETTLE_S,
        )
        converged(cluster, leader)
        assert victim not in cluster.owners(NAMESPACE, via=leader).values()
    finally:
        os.kill(pid, signal.SIGCONT)
    converged(cluster, leader)
    # It logged nothing while paused: only the lease ends bound what it served.
    assert dual_serving(serving_intervals(cluster.events(), cluster.killed_at_ns)) == []
