"""Real Pulsar clients through a real dev cluster while it is disrupted: what users feel.

The official client's producers (``send_async``) and consumers (acknowledging) run on topics
spread over every broker front of one dev cluster, while the cluster goes through each event in
turn (:class:`lbd.devcluster.disruptions.ClientHarness`). Then every event is judged on what must
never break, from the clients' own records and the brokers' event logs:

- no acknowledged message is lost, in any event;
- no broker accepts a message for a bundle it does not serve at that instant, storage keeps each
  topic's messages in the order of its owners, and no two brokers serve a bundle at once;
- a transfer costs no failed send and no lookup (the clients are sent to the new owner);
- an unload costs at most one lookup per producer and consumer of a topic;
- a rolling restart of every broker fails no send.

Latencies and the failover's resume time are the ``clients`` benchmark's figures
(``make bench``), not asserted here. The second, ``--secure`` pass of ``make test`` leaves out
the pauses (they exercise nothing TLS changes) to keep CI short.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lbd.devcluster.disruptions import ClientHarness, EventFigures, SafetyFigures
from lbd.traffic.clients import ClientTls, TrafficSpec, topics_for
from tests.e2e.clusters import SECURE, start_cluster, stop_cluster

NAMESPACE = "e2e/clients"
TOPICS = 12
RATE = 20.0
TRANSFERS = 3
PAUSE_S = 10.0
"""A paused front or sidecar stays frozen until its bundles are Owned elsewhere (about 9 s with
the default timings) and at least this long: it comes back to bundles that moved on."""
ETCD_PAUSE_S = 20.0
"""Several times every etcd timer (lease TTL 3 s, fence_after 3 s); the chaos suite's outages
hold etcd away for a minute."""

pytestmark = pytest.mark.timeout(900)


@dataclass(frozen=True)
class Run:
    events: dict[str, list[EventFigures]]
    safety: SafetyFigures


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    cluster = start_cluster(
        tmp_path_factory.mktemp("clients"), 3, "shedding.interval_s=3600", "split.interval_s=3600"
    )
    harness = None
    try:
        cluster.client().create_namespace(NAMESPACE, 8)
        record = cluster.record
        c = record.pulsar_client
        spec = TrafficSpec(
            service_url=record.service_url,
            topics=topics_for([NAMESPACE], TOPICS, "e2e"),
            rate=RATE,
            log_file=str(Path(record.state_dir) / "clients.log"),
            tls=ClientTls(c["ca_file"], c["cert_file"], c["key_file"]) if c else None,
        )
        harness = ClientHarness(record, spec)
        harness.start()
        for _ in range(TRANSFERS):
            harness.transfer()
        harness.unload()
        harness.split()
        harness.drain()
        harness.rolling_restart()
        harness.kill_front()
        harness.kill_sidecar()
        harness.kill_leader()
        if not SECURE:
            harness.pause_front(PAUSE_S)
            harness.pause_sidecar(PAUSE_S)
            harness.pause_etcd(ETCD_PAUSE_S)
        harness.restart_storage()
        figures, safety = harness.finish()
        grouped: dict[str, list[EventFigures]] = {}
        for f in figures:
            grouped.setdefault(f.name, []).append(f)
        yield Run(grouped, safety)
    finally:
        stop_cluster(cluster)
        if harness is not None:
            harness.close()


def _describe(events: list[EventFigures]) -> str:
    return "; ".join(f"{e.name}: {e.summary.line()} ({e.note})" for e in events)


def test_no_acknowledged_message_is_lost_in_any_event(run: Run) -> None:
    lost = [e for events in run.events.values() for e in events if e.summary.lost]
    assert not lost, _describe(lost) + " " + str([e.summary.lost_examples for e in lost])


def test_no_broker_accepts_a_message_for_a_bundle_it_does_not_serve(run: Run) -> None:
    s = run.safety
    assert s.writes_checked > 0
    assert s.writes_outside_serving == ()
    assert s.storage_order == ()


def test_no_two_brokers_serve_a_bundle_at_once(run: Run) -> None:
    assert run.safety.dual_served == ()


def test_a_transfer_fails_no_send_and_needs_no_lookup(run: Run) -> None:
    transfers = run.events["transfer"]
    assert len(transfers) == TRANSFERS
    for t in transfers:
        assert t.affected_topics > 0
        assert (t.summary.failed, t.lookups) == (0, 0), _describe([t])


def test_an_unload_costs_at_most_one_lookup_per_producer_and_consumer(run: Run) -> None:
    (unload,) = run.events["unload"]
    assert unload.summary.failed == 0, _describe([unload])
    assert 0 < unload.lookups <= 2 * unload.affected_topics, _describe([unload])


def test_a_split_and_a_drain_fail_no_send(run: Run) -> None:
    for name in ("split", "drain"):
        (event,) = run.events[name]
        assert event.summary.failed == 0, _describe([event])


def test_a_rolling_restart_of_every_broker_fails_no_send(run: Run) -> None:
    (restart,) = run.events["rolling restart"]
    assert restart.summary.sent > 0
    assert restart.summary.failed == 0, _describe([restart])


def test_after_every_failover_the_producers_resumed(run: Run) -> None:
    for name in ("kill -9 front", "kill -9 sidecar", "kill -9 leader sidecar"):
        (event,) = run.events[name]
        assert event.resume_s is not None, _describe([event])


def test_every_event_ran(run: Run) -> None:
    expected = {
        "transfer",
        "unload",
        "split",
        "drain",
        "rolling restart",
        "kill -9 front",
        "kill -9 sidecar",
        "kill -9 leader sidecar",
        "storage restarted",
    }
    if not SECURE:
        expected |= {
            f"SIGSTOP front {PAUSE_S:g} s",
            f"SIGSTOP sidecar {PAUSE_S:g} s",
            f"etcd paused {ETCD_PAUSE_S:g} s",
        }
    assert set(run.events) == expected
