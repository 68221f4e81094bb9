"""The leader's safety auditor on in-process sidecars (the wiring ``lbd serve`` uses): nothing on a
healthy cluster, however long it runs, and exactly its finding for each planted fault.

The ownership monitor is what repairs these faults; here it is not run (its sweep is replaced by
one that does nothing), so that a fault outlives its bound as it would with a broken monitor.
The clock is the harness's manual clock; every audit is run by the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import pytest
from harness import Harness, Sidecar
from rig import NEVER_S, QUIET, turns

from lbd.adapters.memory.channel import MemoryChannelLog
from lbd.adapters.memory.metadata import MemoryMetadataStore
from lbd.adapters.session import SessionPolicy
from lbd.core.audit import AuditData, AuditReport, DeadOwnerAnswers, FindingKind
from lbd.core.broker_info import BrokerInfo
from lbd.core.ids import BrokerId, BundleId
from lbd.core.settings import MonitorConfig, OperationsConfig
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, encode_value
from lbd.core.table import ChannelPosition
from lbd.services.leader.auditor import AUDIT_SLICE
from lbd.services.leader.monitor import SweepReport

S = ServiceUnitState
MONITOR = MonitorConfig(
    interval_s=5,
    inflight_timeout_s=10,
    tombstone_after_s=3600,
    orphan_cleanup_grace_s=20,
    unseen_broker_grace_s=20,
)
"""G = 20 s, I = 10 s, slack = 2 sweeps = 10 s: an owner gone 30 s is late, a move 20 s old."""
CONFIG = dataclasses.replace(
    QUIET, monitor=MONITOR, operations=OperationsConfig(audit_interval_s=NEVER_S)
)
ANNOUNCE_DUE_S = 30.0
STUCK_AFTER_S = 20.0
TOPICS = [f"persistent://public/default/t{i}" for i in range(12)]
SPARE_TOPIC = TOPICS[-1]
"""Its bundle is left unassigned by the cluster's start, for the test's own use."""
Z = BrokerId("broker-z")
"""A broker registered with no sidecar of ours: it never acts on what the channel says."""


@dataclasses.dataclass
class Cluster:
    h: Harness
    leader: Sidecar
    plain: Sidecar
    """An auto-ack sidecar."""
    fake: Sidecar
    """A sidecar whose broker is a FakeBroker (it can leave and come back)."""
    lonely: Sidecar
    """A sidecar without a broker of its own (never registered): it only answers lookups."""
    spare: BundleId
    """The bundle of :data:`SPARE_TOPIC`, with no value yet."""

    @property
    def sidecars(self) -> list[Sidecar]:
        return [self.leader, self.plain, self.fake, self.lonely]

    async def audit(self) -> AuditReport:
        """A second later (so that each report is a new one), let the cluster settle, have
        every sidecar report and audit on the leader."""
        await self.h.clock.run_for(1.0, step=0.5)
        await self.h.idle()
        for sidecar in self.sidecars:
            await sidecar.reporter.report_once()
        return await self.leader.auditor.run_once()

    def gauge(self, kind: FindingKind) -> float | None:
        return self.leader.metrics.registry.get_sample_value(
            "lbd_audit_findings", {"kind": kind.value}
        )

    async def spare_owned_by(self, broker: BrokerId) -> BundleId:
        """Assign the spare bundle to ``broker``; the bundle."""
        value = await self.leader.lookup.assign(self.spare, broker)
        assert value.dst_broker == broker
        await self.h.idle()
        return self.spare


async def _monitor_not_run(*args: object, **kwargs: object) -> SweepReport:
    """The monitor's sweep, doing nothing: the faults outlive their bounds."""
    return SweepReport(skipped="the auditor's tests keep the monitor out")


@contextlib.asynccontextmanager
async def cluster(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    async with Harness(config=CONFIG) as h:
        leader = await h.add("broker-0")
        await turns(lambda: leader.elector.is_leader)
        plain = await h.add("broker-1")
        fake = await h.add("broker-2", auto_ack=False, fake_broker=True)
        lonely = await h.add("broker-3", auto_ack=False)
        await h.ready()
        for sidecar in h.live():
            monkeypatch.setattr(sidecar.monitor, "run_once", _monitor_not_run)
        spare = await leader.lookup.bundle_of(SPARE_TOPIC)
        c = Cluster(h, leader, plain, fake, lonely, spare)
        for i, topic in enumerate(TOPICS[:-1]):
            if await leader.lookup.bundle_of(topic) != spare:
                await c.sidecars[i % 3].lookup.lookup(topic)
        assert leader.follower.get(spare) is None and len(leader.follower.table) == 3
        yield c


def kinds(report: AuditReport) -> list[tuple[FindingKind, BundleId | None, BrokerId | None]]:
    return [(f.kind, f.bundle, f.broker) for f in report.findings]


async def test_a_healthy_cluster_has_no_finding_however_long_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with cluster(monkeypatch) as c:
        reports = [await c.audit() for _ in range(2)]
        await c.h.clock.run_for(3 * ANNOUNCE_DUE_S, step=0.5)
        reports.append(await c.audit())
        for report in reports:
            assert report.findings == () and report.skipped is None
            assert report.sidecars_compared == 4 and report.not_compared == ()
        table = c.leader.follower.table
        assert reports[-1].bundles_checked == len(table) >= 3
        # What each sidecar publishes with its load: its table's position and digest.
        published = c.leader.loads.brokers()[c.lonely.me].audit
        mine = c.lonely.follower.table
        assert published == AuditData(mine.last_position, mine.digest, DeadOwnerAnswers())
        assert published.position == table.last_position and published.digest == table.digest
        assert c.leader.auditor.latest == reports[-1]
        assert {c.gauge(kind) for kind in FindingKind} == {0.0}
        registry = c.leader.metrics.registry
        assert registry.get_sample_value("lbd_audit_runs_total") == 3
        assert registry.get_sample_value("lbd_audit_last_run_timestamp_seconds") == (
            reports[-1].checked_at_ms / 1000
        )
        assert c.plain.metrics.registry.get_sample_value("lbd_audit_runs_total") == 0


async def test_a_bundle_of_a_gone_broker_left_owned_past_its_bound_is_a_stale_owner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with cluster(monkeypatch) as c:
        gone = c.fake.me
        bundle = await c.spare_owned_by(gone)
        assert (await c.audit()).findings == ()
        assert c.fake.broker is not None
        await c.fake.broker.disconnect()
        await turns(lambda: c.leader.registry.get(gone) is None)
        await c.h.clock.run_for(ANNOUNCE_DUE_S - 1, step=0.5)
        in_time = await c.audit()  # gone 30 s: the failover is still within the monitor's bound
        assert in_time.findings == ()

        late = await c.audit()
        owned = sorted(b for b, owner in c.leader.follower.table.owners().items() if owner == gone)
        assert bundle in owned
        assert kinds(late) == [(FindingKind.STALE_OWNER, b, gone) for b in owned]
        finding = late.findings[0]
        assert "left the broker registry 31s ago" in finding.detail
        assert "lbd ctl decisions" in finding.action
        assert finding.since_ms == late.checked_at_ms
        assert c.gauge(FindingKind.STALE_OWNER) == len(owned)
        assert c.gauge(FindingKind.STUCK_IN_FLIGHT) == c.gauge(FindingKind.TABLE_DIVERGENCE) == 0

        again = await c.audit()
        assert again.findings[0].since_ms == finding.since_ms


async def test_a_move_its_source_never_carries_out_is_stuck_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with cluster(monkeypatch) as c:
        others = MemoryMetadataStore(c.h.metadata, SessionPolicy(15, 2.0))
        await others.start()
        try:
            await others.register_broker(Z, BrokerInfo(Z).to_json())
            await turns(lambda: c.leader.registry.get(Z) is not None)
            bundle = c.spare
            writer = MemoryChannelLog(c.h.log)
            for version, state, src in ((1, S.Owned, None), (2, S.Releasing, Z)):
                v = ServiceUnitStateData(
                    state=state,
                    version_id=version,
                    dst_broker=Z if state is S.Owned else c.leader.me,
                    source_broker=src,
                    timestamp_ms=c.h.clock.now_ms(),
                )
                await writer.publish(bundle, encode_value(v))
            assert (await c.audit()).findings == ()

            await c.h.clock.run_for(STUCK_AFTER_S - 2, step=0.5)
            assert (await c.audit()).findings == ()  # 20 s old: the monitor still has time
            late = await c.audit()
            assert kinds(late) == [(FindingKind.STUCK_IN_FLIGHT, bundle, Z)]
            assert "Releasing for 21s" in late.findings[0].detail
            assert f"The sidecar of {Z} did not finish releasing" in late.findings[0].action
            assert c.gauge(FindingKind.STUCK_IN_FLIGHT) == 1
            assert c.gauge(FindingKind.STALE_OWNER) == 0
        finally:
            await others.close()


async def test_a_sidecar_whose_table_differs_at_the_same_position_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with cluster(monkeypatch) as c:
        assert (await c.audit()).findings == ()
        # The next message of the channel: the plain sidecar applies a bogus value there (as a
        # corrupt read would), then every other sidecar applies the real one.
        at = ChannelPosition(0, len(c.h.log))
        bundle = BundleId("other/ns/0x00000000_0xffffffff")
        bogus = ServiceUnitStateData(state=S.Free, version_id=1, source_broker=c.plain.me)
        real = dataclasses.replace(bogus, source_broker=c.leader.me)
        c.plain.follower.table.apply(at, bundle, encode_value(bogus))
        assert await MemoryChannelLog(c.h.log).publish(bundle, encode_value(real)) == at
        await c.h.idle()
        assert {s.follower.table.last_position for s in c.sidecars} == {at}
        assert c.plain.follower.get(bundle) == bogus and c.leader.follower.get(bundle) == real

        first = await c.audit()
        assert first.findings == ()  # one disagreeing report could be a fluke of timing
        assert first.sidecars_compared == 4
        second = await c.audit()
        assert kinds(second) == [(FindingKind.TABLE_DIVERGENCE, None, c.plain.me)]
        finding = second.findings[0]
        assert str(at) in finding.detail
        assert finding.action.startswith(f"Restart sidecar {c.plain.me}")
        assert c.gauge(FindingKind.TABLE_DIVERGENCE) == 1


async def test_dead_owner_answers_during_a_failover_are_counted_but_no_finding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with cluster(monkeypatch) as c:
        gone = c.fake.me
        await c.spare_owned_by(gone)
        assert (await c.audit()).findings == ()
        assert c.fake.broker is not None
        await c.fake.broker.disconnect()
        await turns(lambda: c.plain.registry.get(gone) is None)
        await c.h.clock.run_for(ANNOUNCE_DUE_S - 5, step=0.5)

        answer = await c.plain.lookup.lookup(SPARE_TOPIC)
        assert (answer.owner_id, answer.owner) == (gone, None)
        answers = c.plain.lookup.dead_owners
        assert (answers.count, answers.owner, answers.away_s) == (1, gone, ANNOUNCE_DUE_S - 5)
        assert c.plain.metrics.registry.get_sample_value("lbd_lookup_dead_owner_total") == 1
        assert (await c.audit()).findings == ()


async def test_a_sidecar_answering_with_an_owner_its_registry_lost_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with cluster(monkeypatch) as c:
        owner, broker = c.fake.me, c.fake.broker
        assert broker is not None
        bundle = await c.spare_owned_by(owner)
        assert (await c.audit()).findings == ()
        # The owner leaves; the lonely sidecar is cut off from etcd; the owner comes back, which
        # everyone but the lonely sidecar sees.
        await broker.disconnect()
        await turns(lambda: c.lonely.registry.get(owner) is None)
        c.lonely.metadata.set_cut_off(True)
        await broker.connect(c.fake.link)
        await turns(lambda: c.leader.registry.get(owner) is not None)
        await c.h.clock.run_for(ANNOUNCE_DUE_S + 1, step=0.5)

        answer = await c.lonely.lookup.lookup(SPARE_TOPIC)
        assert (answer.bundle, answer.owner_id, answer.owner) == (bundle, owner, None)
        report = await c.audit()
        assert kinds(report) == [(FindingKind.LOOKUP_DEAD_OWNER, bundle, c.lonely.me)]
        finding = report.findings[0]
        assert f"the leader sees {owner} registered" in finding.detail
        assert f"Sidecar {c.lonely.me}'s view of the broker registry is behind etcd" in (
            finding.action
        )
        assert c.gauge(FindingKind.LOOKUP_DEAD_OWNER) == 1
        # No new wrong answer since: the finding is gone.
        assert (await c.audit()).findings == ()
        assert c.gauge(FindingKind.LOOKUP_DEAD_OWNER) == 0


async def test_a_large_table_is_checked_in_slices_with_every_finding_in_bundle_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # More bundles than two slices, all Owned by a broker that is gone: every one is found, in
    # bundle order, and the event loop runs between slices (lookups wait for no whole audit).
    gone = BrokerId("broker-gone")
    async with cluster(monkeypatch) as c:
        writer = MemoryChannelLog(c.h.log)
        count = 2 * AUDIT_SLICE + 7
        bundles = [BundleId(f"audit/big/0x{i:08x}_0x{i + 1:08x}") for i in range(count)]
        for bundle in reversed(bundles):
            value = ServiceUnitStateData(
                state=S.Owned, version_id=1, dst_broker=gone, timestamp_ms=c.h.clock.now_ms()
            )
            await writer.publish(bundle, encode_value(value))
        assert (await c.audit()).findings == ()  # the grace starts when the auditor notices
        await c.h.clock.run_for(ANNOUNCE_DUE_S + 1, step=0.5)
        await c.h.idle()
        turns_during = [0]
        auditing = asyncio.ensure_future(c.leader.auditor.run_once())

        async def count_turns() -> None:
            while not auditing.done():
                turns_during[0] += 1
                await asyncio.sleep(0)

        await asyncio.gather(auditing, count_turns())
        report = auditing.result()
        assert turns_during[0] >= 2
        assert kinds(report) == [(FindingKind.STALE_OWNER, b, gone) for b in bundles]
        assert report.bundles_checked == len(c.leader.follower.table)
