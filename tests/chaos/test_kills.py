"""kill -9 on a real dev cluster: a sidecar with its broker, then the leader's sidecar while 20
transfers are in flight. No instant of dual serving, no bundle lost, and every transfer answers
with what happened.

The tests run in order on one 4-broker cluster of their own.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from lbd.ctl.client import RpcFailure, SidecarClient
from lbd.devcluster.serving import dual_serving, serving_intervals
from lbd.gen.v1 import lbd_pb2
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

NAMESPACE = "chaos/kills"
BUNDLES = 24
TRANSFERS = 20
SLACK_S = 15.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    running = start_cluster(tmp_path_factory.mktemp("kills"), 4, "shedding.interval_s=3600")
    try:
        own_topics(running, NAMESPACE, BUNDLES)
        yield running
    finally:
        stop_cluster(running)


def live_brokers(cluster: Cluster, via: str) -> set[str]:
    return {b.info.broker_id for b in cluster.client(via).brokers().brokers}


def converged(cluster: Cluster, witness: str, bound_s: float) -> dict[str, str]:
    """Every bundle of the namespace Owned by a registered broker, as the witness sees it."""

    def check() -> dict[str, str] | None:
        owners = cluster.owners(NAMESPACE, via=witness)
        live = live_brokers(cluster, witness)
        return owners if len(owners) == BUNDLES and set(owners.values()) <= live else None

    return wait_for("every bundle Owned by a live broker", check, bound_s, interval_s=0.2)


def assert_served_once(cluster: Cluster) -> None:
    assert dual_serving(serving_intervals(cluster.events(), cluster.killed_at_ns)) == []


def test_kill_9_of_a_sidecar_and_its_broker(cluster: Cluster) -> None:
    leader = cluster.client().leader().broker_id
    victim = victim_owning(cluster, NAMESPACE, leader)
    node = cluster.record.node(victim)
    cluster.killed_at_ns[victim] = time.monotonic_ns()
    os.kill(node.sidecar.pid, signal.SIGKILL)
    os.kill(node.broker.pid, signal.SIGKILL)
    wait_for(
        f"{victim} deregistered",
        lambda: True if victim not in live_brokers(cluster, leader) else None,
        ORPHAN_BOUND_S,
    )

    now = converged(cluster, leader, ORPHAN_BOUND_S + SLACK_S)

    assert victim not in now.values()
    assert_served_once(cluster)


def test_kill_9_of_the_leader_during_20_concurrent_transfers(cluster: Cluster) -> None:
    live = [b for b in cluster.broker_ids if b not in cluster.killed_at_ns]
    leader = cluster.client(live[0]).leader().broker_id
    others = [b for b in live if b != leader]
    owners = cluster.owners(NAMESPACE, via=others[0])
    moves: list[tuple[str, str, str]] = []  # (bundle, dst, asked via)
    for n, (bundle, owner) in enumerate(sorted(owners.items())[:TRANSFERS]):
        candidates = [b for b in live if b != owner]
        moves.append((bundle, candidates[n % len(candidates)], others[n % len(others)]))

    def transfer(move: tuple[str, str, str]) -> lbd_pb2.TransferResponse | RpcFailure:
        bundle, dst, via = move
        with SidecarClient(
            cluster.addr(via), credentials=cluster.credentials, timeout_s=60
        ) as client:
            try:
                return client.transfer(bundle, dst)
            except RpcFailure as e:
                return e

    with ThreadPoolExecutor(TRANSFERS) as pool:
        futures = [pool.submit(transfer, move) for move in moves]
        time.sleep(0.1)  # some transfers are under way, some not yet
        os.kill(cluster.record.node(leader).sidecar.pid, signal.SIGKILL)
        answers = [f.result(timeout=90) for f in futures]

    survivors = [b for b in live if b != leader]
    wait_for(
        f"{leader} deregistered",
        lambda: True if leader not in live_brokers(cluster, survivors[0]) else None,
        ORPHAN_BOUND_S,
    )
    now = converged(cluster, survivors[0], ORPHAN_BOUND_S + SLACK_S)
    assert leader not in now.values()
    assert_served_once(cluster)
    # An OK says where the bundle went, and that broker was told to Own it.
    owned = {(str(e["bundle"]), str(e["broker"])) for e in cluster.events() if e["event"] == "own"}
    for (bundle, dst, _), answer in zip(moves, answers, strict=True):
        if isinstance(answer, lbd_pb2.TransferResponse):
            assert answer.dst_broker_id == dst, answer
            assert (bundle, dst) in owned, f"{bundle}: said moved to {dst}, never owned there"
        else:
            assert answer.code is not None and answer.details, answer
    print(
        "transfers:",
        sum(isinstance(a, lbd_pb2.TransferResponse) for a in answers),
        "ok,",
        sorted({a.code.name for a in answers if isinstance(a, RpcFailure)}),
    )
