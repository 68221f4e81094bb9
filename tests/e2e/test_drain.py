"""Broker maintenance end to end, on a 4-broker dev cluster with traffic: drain a broker while
lookups go on (nothing new lands on it, it ends empty, no instant of dual serving), then
decommission another with ``lbd ctl decommission --wait`` and see it deregistered and staying
so until it is uncordoned.

The tests run in order on one cluster of their own; the shedder is off so that only the drains
move bundles.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from lbd.ctl.client import RpcFailure, SidecarClient
from lbd.devcluster.serving import dual_serving, serving_intervals
from lbd.gen.v1 import lbd_pb2
from tests.e2e.clusters import Cluster, own_topics, start_cluster, stop_cluster, wait_for

pytestmark = [pytest.mark.servers, pytest.mark.timeout(240)]

NAMESPACE = "e2e/drain"
BUNDLES = 24
FRESH = "e2e/fresh"
"""Looked up while the drain runs: every one of its bundles is assigned then, never to the
drained broker."""
LOOKUPS = 40
"""New topics looked up from the moment every sidecar sees the cordon (during the drain and
after)."""
DRAIN_BOUND_S = 60.0
STAY_AWAY_S = 8.0
"""How long a decommissioned broker is watched staying deregistered: over two lease TTLs of the
dev cluster, so a lease renewal or a re-registration would show."""


def start_with_traffic(state_dir: Path, brokers: int) -> Cluster:
    """``lbd dev up --traffic`` (public/demo assigned, the brokers reporting load), no shedder.

    Simulated brokers: their load is even, so the bundles spread. Broker fronts report their
    process's CPU, and a burst of assignments lands wholly on the one that used least at its
    last report (as Pulsar's least-usage strategy does), which may leave no broker but the
    leader with bundles to drain."""
    return start_cluster(
        state_dir, brokers, "shedding.interval_s=3600", traffic=True, sim_brokers=True
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    running = start_with_traffic(tmp_path_factory.mktemp("drain"), 4)
    try:
        own_topics(running, NAMESPACE, BUNDLES)
        yield running
    finally:
        stop_cluster(running)


def brokers(cluster: Cluster, via: str) -> dict[str, lbd_pb2.BrokerStatus]:
    return {b.info.broker_id: b for b in cluster.client(via).brokers().brokers}


def owned(cluster: Cluster, broker: str, via: str | None = None) -> list[str]:
    """Bundles of every namespace Owned by ``broker``, as one sidecar lists them."""
    return sorted(b for b, owner in cluster.owners(via=via).items() if owner == broker)


def assert_served_once(cluster: Cluster) -> None:
    assert dual_serving(serving_intervals(cluster.events(), cluster.killed_at_ns)) == []


class Lookups:
    """Lookups of new topics in a thread, one sidecar after the other, until stopped."""

    def __init__(self, cluster: Cluster) -> None:
        self.answers: list[lbd_pb2.LookupResponse] = []
        self.failures: list[RpcFailure] = []
        self._cluster = cluster
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lookups")

    def __enter__(self) -> Lookups:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        ids = self._cluster.broker_ids
        clients = [
            SidecarClient(
                self._cluster.addr(b), credentials=self._cluster.credentials, timeout_s=20
            )
            for b in ids
        ]
        try:
            n = 0
            while not self._stop.is_set():
                try:
                    topic = f"persistent://{FRESH}/topic-{n}"
                    self.answers.append(clients[n % len(clients)].lookup(topic))
                except RpcFailure as e:
                    self.failures.append(e)
                n += 1
        finally:
            for client in clients:
                client.close()


def test_drain_empties_a_broker_under_traffic_with_no_dual_serving(cluster: Cluster) -> None:
    leader = cluster.client().leader().broker_id
    load = Counter(cluster.owners().values())
    victim = max((b for b in cluster.broker_ids if b != leader), key=lambda b: load[b])
    before = owned(cluster, victim)
    assert len(before) >= 5, load  # its share of public/demo and of the test's namespace
    cluster.client().create_namespace(FRESH, 32)

    started = time.monotonic()
    op = cluster.client().drain(victim)  # the first sidecar, forwarded to the leader if need be
    assert (op.kind, op.broker_id) == ("drain", victim)
    for via in cluster.broker_ids:  # every sidecar's own view of the record
        wait_for(
            f"{via} sees {victim} draining",
            lambda via=via: (
                brokers(cluster, via)[victim].maintenance in ("draining", "cordoned") or None
            ),
            5,
        )
    with Lookups(cluster) as lookups:
        watched = list(cluster.client().watch_operation(op.id, timeout_s=DRAIN_BOUND_S))
        took_s = time.monotonic() - started
        # Still cordoned once drained: go on looking up new topics for a while.
        wait_for("40 lookups", lambda: len(lookups.answers) >= LOOKUPS or None, 30)
    last = watched[-1]
    assert last.state == lbd_pb2.OPERATION_STATE_SUCCEEDED, last
    print(
        f"drain of {victim}: {last.moves_done} bundle(s) in {took_s:.2f}s "
        f"({len(lookups.answers)} lookups of new topics, {len(lookups.failures)} failed)"
    )
    assert last.moves_done >= len(before)
    assert took_s < DRAIN_BOUND_S

    for via in cluster.broker_ids:
        assert owned(cluster, victim, via) == [], via
    assert brokers(cluster, leader)[victim].maintenance == "cordoned"
    landed = Counter(a.owner_broker_id for a in lookups.answers)
    assert lookups.answers and victim not in landed, landed
    assert_served_once(cluster)


def test_decommission_deregisters_the_broker_until_it_is_uncordoned(cluster: Cluster) -> None:
    leader = cluster.client().leader().broker_id
    drained = next(b for b, s in brokers(cluster, leader).items() if s.maintenance)
    victim = next(b for b in cluster.broker_ids if b not in (leader, drained))
    via = next(b for b in cluster.broker_ids if b not in (leader, victim))
    count = len(owned(cluster, victim))

    started = time.monotonic()
    done = cluster.ctl("--server", cluster.addr(via), "decommission", victim, "--wait")
    took_s = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    assert "succeeded" in done.stdout.lower(), done.stdout
    print(f"decommission of {victim}: {count} bundle(s) in {took_s:.2f}s")

    for sidecar in (leader, via, drained):
        wait_for(
            f"{sidecar} sees {victim} deregistered",
            lambda sidecar=sidecar: victim not in brokers(cluster, sidecar) or None,
            5,
        )
    time.sleep(STAY_AWAY_S)
    assert victim not in brokers(cluster, leader)
    assert owned(cluster, victim) == []
    shown = cluster.ctl("brokers")
    assert shown.returncode == 0 and "cordoned" in shown.stdout, shown.stdout

    back = cluster.ctl("--output", "json", "uncordon", victim)
    assert back.returncode == 0, back.stderr
    wait_for(f"{victim} registered again", lambda: victim in brokers(cluster, leader) or None, 10)
    assert brokers(cluster, leader)[victim].maintenance == ""
    assert_served_once(cluster)
