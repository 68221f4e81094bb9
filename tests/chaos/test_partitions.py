"""Network partitions on a real dev cluster, under real clients: one link cut at a time.

Every link between the cluster's processes runs through a proxy (``lbd dev up --links``,
:mod:`lbd.devcluster.links`) that cuts it the way a partition does: nothing passes, nothing is
closed, each side learns from its own timeouts. The scenarios (:data:`SCENARIOS`) cut one broker
host's links to etcd only and to the channel only for a minute, its broker's link to its sidecar,
the leader's link to the channel, every link of one host to the servers, and make links flaky,
while the official client's producers and consumers run on topics spread over every broker.

What must hold in every scenario: no acknowledged message lost; no message stored twice (a
cut-off broker's unreceipted sends must not land once the partition heals, after its clients
sent them again elsewhere), but for a send storage stored before the cut whose receipt the cut
held (at-least-once, as Pulsar without deduplication); no two brokers serving a bundle at once,
no broker accepting a message for a bundle it did not serve at that instant, storage in the
order of the owners; and the cluster whole again (every bundle Owned by a registered broker,
every sidecar listing every broker) within seconds of the links' return. A sidecar cut from etcd
alone loses its lease, so its bundles move; one cut from the channel alone keeps its lease, so
nothing moves, nor when the leader is the one cut from the channel.

The ``--secure`` pass of ``make test`` leaves this module out: the proxies pass TLS through
untouched, and the outages and client suites already reconnect every link over TLS.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lbd.devcluster.disruptions import ClientHarness, EventFigures, SafetyFigures
from lbd.devcluster.partitions import SCENARIOS
from lbd.devcluster.partitions import run as run_partition
from lbd.traffic.clients import TrafficSpec, topics_for
from tests.e2e.clusters import SECURE, Cluster, lbd, start_cluster, stop_cluster, wait_for

pytestmark = [
    pytest.mark.servers,
    pytest.mark.timeout(900),
    pytest.mark.skipif(SECURE, reason="TLS passes the proxies untouched (module docstring)"),
]

NAMESPACE = "chaos/partitions"
BUNDLES = 8
TOPICS = 12
RATE = 20.0
WHOLE_BOUND_S = 15.0
"""From the links' return until the cluster is whole again: a reconnect (etcd's backoff is capped
at half a second, the Pulsar client's starts at 100 ms), a registration, a channel catch-up."""


@dataclass(frozen=True)
class Run:
    events: dict[str, EventFigures]
    safety: SafetyFigures
    state_dir: Path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    state_dir = tmp_path_factory.mktemp("partitions")
    cluster = start_cluster(
        state_dir, 3, "shedding.interval_s=3600", "split.interval_s=3600", links=True
    )
    harness = None
    try:
        cluster.client().create_namespace(NAMESPACE, BUNDLES)
        spec = TrafficSpec(
            service_url=cluster.record.service_url,
            topics=topics_for([NAMESPACE], TOPICS, "part"),
            rate=RATE,
            log_file=str(Path(cluster.record.state_dir) / "clients.log"),
        )
        harness = ClientHarness(cluster.record, spec)
        harness.start()
        _every_broker_serves_traffic(cluster, harness)
        for scenario in SCENARIOS:
            run_partition(harness, scenario)
        figures, safety = harness.finish()
        yield Run({f.name: f for f in figures}, safety, state_dir)
    finally:
        stop_cluster(cluster)
        if harness is not None:
            harness.close()


def _every_broker_serves_traffic(cluster: Cluster, harness: ClientHarness) -> None:
    """Give each broker that serves none of the traffic one of its bundles, from the broker
    serving the most, so that every cut has something to move: least-usage placement sends a
    burst of lookups to the brokers the margin under the average, and brokers just started can
    differ by more (seen in CI on a slow machine: every traffic bundle on the first broker, and
    the cut of another moved nothing)."""
    held: dict[str, set[str]] = {b: set() for b in cluster.broker_ids}
    for bundle, owner in harness.placement().values():
        held.setdefault(owner, set()).add(bundle)
    client = cluster.client()
    for broker in sorted(b for b in held if not held[b]):
        donor = max(sorted(held), key=lambda b: len(held[b]))
        if len(held[donor]) < 2:
            break
        bundle = sorted(held[donor])[0]
        client.transfer(bundle, broker)
        held[donor].discard(bundle)
        held[broker].add(bundle)

    def spread() -> bool | None:
        owners = {owner for _, owner in harness.placement().values()}
        return True if owners >= set(cluster.broker_ids) else None

    wait_for("every broker serving some of the traffic", spread, 30)


def _describe(e: EventFigures) -> str:
    return f"{e.name}: {e.summary.line()} ({e.note})"


def test_every_scenario_ran(run: Run) -> None:
    assert set(run.events) == {s.name for s in SCENARIOS}


def test_no_acknowledged_message_is_lost_in_any_partition(run: Run) -> None:
    for e in run.events.values():
        assert e.summary.acknowledged > 0, _describe(e)
        assert e.summary.lost == 0, _describe(e) + f" {e.summary.lost_examples}"


def test_no_write_a_cut_off_broker_sent_lands_in_storage_after_the_partition_heals(
    run: Run,
) -> None:
    # A broker that stops serving with sends storage never receipted resets its storage
    # connections, so those sends are dropped rather than stored after the clients sent them
    # again through the new owner (before that fix: about 500 stored twice per host split).
    # What the reset cannot undo is a send storage stored before the cut while the cut held its
    # receipt: at-least-once, as Apache Pulsar without deduplication. So a message may be stored
    # twice only if it was one of the sends the fronts stopped without a receipt for that they
    # had accepted before the cut (a handful at most; the fix's ~500 were all accepted after).
    for e in run.events.values():
        assert e.summary.stored_twice <= e.unreceipted, _describe(e) + (
            f"; {e.unreceipted} unreceipted sends accepted before the cut"
        )


def test_no_two_brokers_serve_a_bundle_at_once_and_storage_keeps_the_owners_order(
    run: Run,
) -> None:
    s = run.safety
    assert s.writes_checked > 0
    assert s.dual_served == ()
    assert s.writes_outside_serving == ()
    assert s.storage_order == ()


def test_the_cluster_is_whole_again_within_seconds_of_every_links_return(run: Run) -> None:
    for e in run.events.values():
        assert e.recovery_s is not None and e.recovery_s <= WHOLE_BOUND_S, _describe(e)


def test_a_sidecar_cut_from_etcd_alone_loses_its_bundles_to_live_brokers(run: Run) -> None:
    e = run.events["sidecar cut from etcd"]
    assert e.moved, _describe(e)


def test_a_sidecar_cut_from_the_channel_alone_keeps_its_bundles(run: Run) -> None:
    for name in ("sidecar cut from the channel", "leader cut from the channel"):
        e = run.events[name]
        assert e.moved == 0, _describe(e)


def test_lbd_dev_link_lists_every_link_up_again_and_names_the_ones_it_does_not_know(
    run: Run,
) -> None:
    listed = lbd("dev", "link", "--state-dir", str(run.state_dir))
    assert listed.returncode == 0, listed.stderr
    for kind in ("etcd", "channel", "sidecar", "storage"):
        assert f"broker-3/{kind}" in listed.stdout
    assert " cut " not in listed.stdout and " flaky " not in listed.stdout
    refused = lbd("dev", "link", "--state-dir", str(run.state_dir), "broker-9/etcd", "--cut")
    assert refused.returncode != 0
    assert "no link broker-9/etcd" in refused.stderr and "broker-1/etcd" in refused.stderr
