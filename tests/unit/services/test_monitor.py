"""The leader's ownership monitor: orphans after the grace period and never in safe mode, stuck
in-flight states, tombstones, and the Kafka-style term fence. In-memory store and channel."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import pytest
from harness import Harness, Timing
from rig import QUIET, let_run, settle, turns

from lbd.adapters.clock import ManualClock
from lbd.adapters.memory.channel import MemoryChannelLog
from lbd.adapters.memory.checkpoint import MemoryCheckpointStore
from lbd.adapters.memory.loadstore import MemoryLoadStore
from lbd.adapters.memory.metadata import MemoryMetadataCluster, MemoryMetadataStore
from lbd.adapters.session import SessionPolicy
from lbd.core.admission import Budget
from lbd.core.broker_info import BrokerInfo
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData
from lbd.core.names import NamespaceName
from lbd.core.namespace import IsolationPolicy, NamespacePolicies
from lbd.core.settings import GovernorConfig, MonitorConfig
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, encode_value
from lbd.metrics import Metrics
from lbd.services.channel.checkpoints import CheckpointDuty
from lbd.services.channel.follower import ChannelFollower
from lbd.services.cluster.namespaces import NamespaceService
from lbd.services.cluster.registry import BrokerRegistry
from lbd.services.graph import Sidecar
from lbd.services.leader.monitor import (
    DECISION_LINES,
    GRACE_RETRY_S,
    SWEEP_SLICE,
    OwnershipMonitor,
)

S = ServiceUnitState
X, Y, Z = BrokerId("broker-x"), BrokerId("broker-y"), BrokerId("broker-z")
NS = NamespaceName.parse("public/default")
B1 = BundleId("public/default/0x00000000_0x40000000")
B2 = BundleId("public/default/0x40000000_0x80000000")
B3 = BundleId("public/default/0x80000000_0xc0000000")
CHILD_LO = BundleId("public/default/0x00000000_0x20000000")
CHILD_HI = BundleId("public/default/0x20000000_0x40000000")
TERM = 5
HANDOVER_S = Timing().timings().handover_wait_s
POLICY = SessionPolicy(lease_ttl_s=10, keepalive_interval_s=1.0)
SETTINGS = MonitorConfig(
    interval_s=QUIET.monitor.interval_s,  # swept by the tests only
    inflight_timeout_s=30,
    tombstone_after_s=3600,
    orphan_cleanup_grace_s=60,
)


@dataclass
class Rig:
    clock: ManualClock
    cluster: MemoryMetadataCluster
    others: MemoryMetadataStore
    """Registers the brokers X, Y, Z (as their sidecars would)."""
    registry: BrokerRegistry
    namespaces: NamespaceService
    writer: MemoryChannelLog
    follower: ChannelFollower
    monitor: OwnershipMonitor
    metrics: Metrics
    load_pub: MemoryLoadStore

    async def load(self, broker: BrokerId, load: float) -> None:
        """Publish ``broker``'s load (0..1) as its reporter would."""
        data = BrokerLoadData(broker, weighted_max_ema=load, updated_at_ms=self.clock.now_ms())
        await self.load_pub.publish(broker, data.to_json())

    async def register(self, *brokers: BrokerId) -> None:
        for broker in brokers:
            await self.others.register_broker(broker, BrokerInfo(broker).to_json())
        await turns(lambda: all(self.registry.get(b) is not None for b in brokers))

    async def deregister(self, broker: BrokerId) -> None:
        await self.others.deregister_broker(broker)
        await turns(lambda: self.registry.get(broker) is None)

    async def write(
        self,
        bundle: BundleId,
        state: ServiceUnitState,
        *,
        dst: BrokerId | None = None,
        src: BrokerId | None = None,
        age_s: float = 0.0,
        children: Mapping[BundleId, BrokerId | None] | None = None,
        leader_term: int | None = None,
        force: bool = False,
    ) -> None:
        current = self.follower.get(bundle)
        value = ServiceUnitStateData(
            state=state,
            version_id=1 if current is None else current.version_id + 1,
            dst_broker=dst,
            source_broker=src,
            split_children=children,
            timestamp_ms=self.clock.now_ms() - round(age_s * 1000),
            leader_term=leader_term,
            force=force,
        )
        position = await self.writer.publish(bundle, encode_value(value))
        await self.follower.wait_applied(position)

    async def sweep(self):
        report = await self.monitor.run_once(TERM)
        last = self.writer.log.messages[-1].position if len(self.writer.log) else None
        if last is not None:
            await self.follower.wait_applied(last)
        return report

    async def orphans_announced(self, *bundles: BundleId) -> None:
        """X, with ``bundles``, leaves Y alone; a sweep after the grace announces every one
        of them moving to Y."""
        await self.register(X, Y)
        for bundle in bundles:
            await self.write(bundle, S.Owned, dst=X)
        await self.deregister(X)
        await self.sweep()
        await self.clock.run_for(SETTINGS.orphan_cleanup_grace_s + 0.5)
        assert [f.state for f in (await self.sweep()).fixes] == [S.Releasing] * len(bundles)

    @contextlib.asynccontextmanager
    async def leading(self) -> AsyncIterator[None]:
        """The monitor's leader duty runs within the block."""
        duty = asyncio.ensure_future(self.monitor.run_leading(TERM))
        try:
            yield
        finally:
            duty.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await duty

    def cleanup(self, kind: str, result: str) -> float:
        return self.metrics.channel_cleanup_ops.labels(kind=kind, result=result)._value.get()


@contextlib.asynccontextmanager
async def rig(
    governor: GovernorConfig = QUIET.governor, monitor: MonitorConfig = SETTINGS
) -> AsyncIterator[Rig]:
    """One sidecar as the wiring builds it, with no broker of its own (so it is no candidate),
    whose monitor the tests sweep by hand; the brokers X, Y, Z are registered by ``others``."""
    config = dataclasses.replace(QUIET, monitor=monitor, governor=governor)
    async with Harness(config=config) as h:
        leader = await h.add("leader", auto_ack=False)
        sweep_by_hand(leader)
        others = MemoryMetadataStore(h.metadata, POLICY)
        await others.start()
        # The leader has read the channel through for longer than the in-flight timeout:
        # values stuck in flight are its to fix (a sidecar that just started waits that long).
        await h.clock.run_for(monitor.inflight_timeout_s + 1)
        try:
            yield Rig(
                h.clock,
                h.metadata,
                others,
                leader.registry,
                leader.namespaces,
                MemoryChannelLog(h.log),
                leader.follower,
                leader.monitor,
                leader.metrics,
                MemoryLoadStore(h.broker_load, h.clock),
            )
        finally:
            await others.close()


def sweep_by_hand(sidecar: Sidecar) -> None:
    """Run ``sidecar``'s monitor only when a test sweeps: its leader duty would hand announced
    moves over by itself as their waits end. From the next term on (the duty of the current
    one sleeps through the whole test, its interval being ``NEVER_S``)."""
    elector = sidecar.elector
    elector._duties = tuple(d for d in elector._duties if d is not sidecar.monitor)


def forced(value: ServiceUnitStateData | None) -> bool:
    return value is not None and value.force and value.leader_term == TERM


async def test_orphans_are_announced_after_the_grace_and_handed_over_after_the_wait() -> None:
    async with rig() as r:
        await r.register(X, Y)
        await r.write(B1, S.Owned, dst=X)
        await r.write(B2, S.Owned, dst=Y)
        await r.deregister(X)

        report = await r.sweep()
        assert report.fixes == () and set(report.waiting) == {X}
        await r.clock.run_for(SETTINGS.orphan_cleanup_grace_s - 1)
        assert (await r.sweep()).fixes == ()
        assert r.follower.get(B1).state is S.Owned

        await r.clock.run_for(1.5)
        report = await r.sweep()
        # First the move is announced: X's sidecar, if it still reads the channel, releases.
        assert [(f.bundle, f.kind, f.state, f.dst) for f in report.fixes] == [
            (B1, "orphan", S.Releasing, Y)
        ]
        value = r.follower.get(B1)
        assert (value.state, value.dst_broker, value.source_broker) == (S.Releasing, Y, X)
        assert forced(value)
        assert r.follower.get(B2).state is S.Owned  # a live owner's bundle is left alone

        # Y is told only once the hand-over wait has passed since the announcement was seen.
        await r.clock.run_for(HANDOVER_S - 1)
        report = await r.sweep()
        assert report.fixes == () and set(report.handing_over) == {B1}
        await r.clock.run_for(1.5)
        report = await r.sweep()
        assert [(f.bundle, f.kind, f.state, f.dst) for f in report.fixes] == [
            (B1, "orphan", S.Assigning, Y)
        ]
        value = r.follower.get(B1)
        assert (value.state, value.dst_broker, value.source_broker) == (S.Assigning, Y, X)
        assert forced(value)
        assert r.cleanup("orphan", "Success") == 2


async def test_orphans_held_back_by_the_recovery_budget_go_as_soon_as_a_slot_is_free() -> None:
    one_at_a_time = dataclasses.replace(
        QUIET.governor, recovery=Budget(per_broker=1, cluster=1, per_minute=0)
    )
    async with rig(one_at_a_time) as r:
        await r.orphans_announced(B1, B2)
        await r.clock.run_for(HANDOVER_S + 0.5)
        report = await r.sweep()
        assert [(f.bundle, f.state) for f in report.fixes] == [(B1, S.Assigning)]
        assert set(report.handing_over) == {B2}  # held back: the one slot is B1's

        # The leader duty's next sweep waits for room, not for the clock (which stands still).
        async with r.leading():
            for _ in range(50):
                await asyncio.sleep(0)
            assert r.follower.get(B2).state is S.Releasing
            await r.write(B1, S.Owned, dst=Y, src=X)  # Y's sidecar took B1: its slot is free
            await turns(lambda: r.follower.get(B2).state is S.Assigning)
            assert r.follower.get(B2).dst_broker == Y


async def test_the_leader_duty_announces_a_gone_brokers_bundles_as_its_grace_ends() -> None:
    # The duty's full sweeps are NEVER_S apart here: the announcement comes from the registry's
    # watch, a sweep when the gone broker's grace ends, not from the next interval.
    async with rig() as r:
        await r.register(X, Y)
        for bundle in (B1, B2):
            await r.write(bundle, S.Owned, dst=X)
        async with r.leading():
            await let_run()  # the duty's first sweep, at once
            await r.deregister(X)
            await r.clock.run_for(SETTINGS.orphan_cleanup_grace_s - 0.5)
            assert [r.follower.get(b).state for b in (B1, B2)] == [S.Owned, S.Owned]
            await r.clock.run_for(1.0)
            await turns(lambda: all(r.follower.get(b).state is S.Releasing for b in (B1, B2)))
            assert r.cleanup("orphan", "Success") == 2


async def test_an_announcement_the_channel_did_not_take_is_tried_again_a_second_later() -> None:
    # In a big failover the channel can be slow to take the leader's writes: the bundles whose
    # announcement failed go a second later, not at the next full sweep (NEVER_S here).
    async with rig() as r:
        await r.register(X, Y)
        await r.write(B1, S.Owned, dst=X)
        async with r.leading():
            await let_run()
            await r.deregister(X)
            r.writer.log.go_down()
            await r.clock.run_for(SETTINGS.orphan_cleanup_grace_s + 0.5)
            await settle(r.clock, lambda: r.cleanup("orphan", "Failure") >= 1)
            r.writer.log.come_back()
            assert r.follower.get(B1).state is S.Owned
            await r.clock.run_for(GRACE_RETRY_S + 0.5)
            await turns(lambda: r.follower.get(B1).state is S.Releasing)


async def test_a_broker_back_within_its_grace_keeps_its_bundles_while_the_duty_runs() -> None:
    async with rig() as r:
        await r.register(X, Y)
        await r.write(B1, S.Owned, dst=X)
        async with r.leading():
            await let_run()
            await r.deregister(X)
            await r.clock.run_for(SETTINGS.orphan_cleanup_grace_s / 2)
            await r.register(X)
            await r.clock.run_for(SETTINGS.orphan_cleanup_grace_s)
            await let_run()
            assert r.follower.get(B1).state is S.Owned
            assert r.follower.get(B1).dst_broker == X


async def test_a_new_leader_sweeps_at_once() -> None:
    # X vanished a grace ago, before this sidecar led: its first sweep announces X's bundle
    # rather than an interval (NEVER_S here) after the election.
    async with rig() as r:
        await r.register(X, Y)
        await r.write(B1, S.Owned, dst=X)
        await r.deregister(X)
        await r.clock.run_for(SETTINGS.orphan_cleanup_grace_s + 0.5)
        async with r.leading():
            await turns(lambda: r.follower.get(B1).state is S.Releasing)


async def test_the_leader_duty_hands_an_announced_move_over_when_its_wait_ends() -> None:
    # The duty's full sweeps are NEVER_S apart here: the hand-over comes from the pass the duty
    # runs when the announcement's wait ends, not from a sweep of the whole table.
    async with rig() as r:
        await r.orphans_announced(B1, B2)
        async with r.leading():
            await r.clock.run_for(HANDOVER_S - 0.5)
            assert [r.follower.get(b).state for b in (B1, B2)] == [S.Releasing, S.Releasing]
            await r.clock.run_for(1.0)
            await turns(lambda: all(r.follower.get(b).state is S.Assigning for b in (B1, B2)))
            assert {r.follower.get(b).dst_broker for b in (B1, B2)} == {Y}
            assert r.cleanup("orphan", "Success") == 4


async def test_held_back_orphans_go_without_a_full_sweep_each_on_the_value_it_was_held_on() -> None:
    one_at_a_time = dataclasses.replace(
        QUIET.governor, recovery=Budget(per_broker=1, cluster=1, per_minute=0)
    )
    async with rig(one_at_a_time) as r:
        await r.register(X, Y)
        for bundle in (B1, B2, B3):
            await r.write(bundle, S.Owned, dst=X)
        await r.deregister(X)
        await r.sweep()
        await r.clock.run_for(SETTINGS.orphan_cleanup_grace_s + 0.5)
        await r.sweep()
        await r.clock.run_for(HANDOVER_S + 0.5)
        report = await r.sweep()
        assert [(f.bundle, f.state) for f in report.fixes] == [(B1, S.Assigning)]
        assert set(report.handing_over) == {B2, B3}

        # No slot free: nothing goes, and both stay held back.
        assert (await r.monitor.run_held(TERM)).fixes == ()
        # B2 moves on meanwhile (its old owner's sidecar released it); B1's slot frees up.
        await r.write(B2, S.Free, dst=Y, src=X)
        await r.write(B1, S.Owned, dst=Y, src=X)
        report = await r.monitor.run_held(TERM)
        last = r.writer.log.messages[-1].position
        await r.follower.wait_applied(last)
        # B2 was held back on another value: left to the next full sweep, which finds it Free.
        assert [(f.bundle, f.state, f.dst) for f in report.fixes] == [(B3, S.Assigning, Y)]
        assert r.follower.get(B2).state is S.Free


async def test_an_announced_move_waits_for_the_sidecar_of_a_broker_that_came_back() -> None:
    async with rig() as r:
        await r.register(X, Y)
        await r.write(B1, S.Owned, dst=X)
        await r.deregister(X)
        await r.sweep()
        await r.clock.run_for(SETTINGS.orphan_cleanup_grace_s + 0.5)
        assert [f.state for f in (await r.sweep()).fixes] == [S.Releasing]
        await r.clock.run_for(HANDOVER_S + 0.5)
        # X is registered again in the store, though this leader's watch has not shown it yet:
        # its sidecar releases the bundle itself, so the leader does not hand it over.
        await r.others.register_broker(X, BrokerInfo(X).to_json())
        report = await r.monitor.run_once(TERM)
        assert report.fixes == ()
        assert r.follower.get(B1).state is S.Releasing


async def test_a_re_registration_cancels_the_cleanup() -> None:
    async with rig() as r:
        await r.register(X, Y)
        await r.write(B1, S.Owned, dst=X)
        await r.deregister(X)
        assert set((await r.sweep()).waiting) == {X}

        await r.clock.run_for(30)
        await r.register(X)
        assert (await r.sweep()).waiting == {}
        assert r.cleanup("orphan", "Cancel") == 1

        await r.clock.run_for(SETTINGS.orphan_cleanup_grace_s * 2)
        assert (await r.sweep()).fixes == ()
        assert r.follower.get(B1).dst_broker == X and r.follower.get(B1).state is S.Owned


async def test_no_orphan_is_cleaned_up_in_safe_mode() -> None:
    async with rig() as r:
        await r.register(X, Y)
        await r.write(B1, S.Owned, dst=X)
        await r.deregister(X)
        await r.sweep()
        r.cluster.set_reachable(False)
        await settle(r.clock, lambda: not r.registry.reachable)
        await r.clock.run_for(SETTINGS.orphan_cleanup_grace_s * 2)

        report = await r.sweep()
        assert report.fixes == () and report.skipped is not None and "safe mode" in report.skipped
        assert r.follower.get(B1).state is S.Owned

        r.cluster.set_reachable(True)
        await settle(r.clock, lambda: r.registry.reachable)
        assert [f.bundle for f in (await r.sweep()).fixes] == [B1]


async def test_an_orphan_the_leader_never_saw_leave_gets_the_grace_from_when_it_noticed() -> None:
    async with rig() as r:
        await r.register(Y)
        await r.write(B1, S.Owned, dst=X)  # X left before this leader was watching
        assert set((await r.sweep()).waiting) == {X}
        await r.clock.run_for(SETTINGS.orphan_cleanup_grace_s + 0.5)
        fixes = (await r.sweep()).fixes
        assert [(f.bundle, f.dst) for f in fixes] == [(B1, Y)]


async def test_stuck_in_flight_states_never_give_a_second_broker_the_bundle() -> None:
    async with rig() as r:
        await r.register(Y, Z)
        await r.write(B1, S.Assigning, dst=Y, age_s=31)  # Y may have taken it, but no Owned
        await r.write(B2, S.Owned, dst=Y, age_s=60)
        await r.write(B2, S.Releasing, dst=Z, src=Y, age_s=31)  # Y never released it
        await r.write(B3, S.Assigning, dst=Z, age_s=10)  # young: left alone

        report = await r.sweep()
        assert {(f.bundle, f.kind, f.state, f.dst) for f in report.fixes} == {
            (B1, "inflight", S.Releasing, Z),  # moved on through Y's release
            (B2, "inflight", S.Owned, Y),  # the move is undone
        }
        b1, b2 = r.follower.get(B1), r.follower.get(B2)
        assert forced(b1) and (b1.dst_broker, b1.source_broker) == (Z, Y)
        assert forced(b2) and b2.dst_broker == Y
        assert r.follower.get(B3).state is S.Assigning and not r.follower.get(B3).force
        assert r.cleanup("inflight", "Success") == 2


async def test_nothing_is_stuck_in_flight_until_the_channel_was_readable_for_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The channel was unreadable (Pulsar down) until 5 s ago: an Assigning from before the
    # outage is 31 s old, but its sidecars could not write Owned meanwhile. It gets the whole
    # in-flight timeout from when the channel reads through again.
    async with rig() as r:
        await r.register(Y, Z)
        await r.write(B1, S.Assigning, dst=Y, age_s=31)
        back = r.clock.monotonic() - 5
        monkeypatch.setattr(r.monitor, "_channel_readable_since", lambda: back)
        assert (await r.sweep()).fixes == ()
        await r.clock.run_for(SETTINGS.inflight_timeout_s - 5 - 0.5)
        assert (await r.sweep()).fixes == ()
        await r.clock.run_for(1.0)
        report = await r.sweep()
        assert [(f.bundle, f.kind, f.state) for f in report.fixes] == [
            (B1, "inflight", S.Releasing)
        ]


async def test_a_stuck_split_goes_back_to_its_source_or_is_finished() -> None:
    async with rig() as r:
        await r.register(Y)
        children = {CHILD_LO: Y, CHILD_HI: Y}
        await r.write(B1, S.Owned, dst=Y, age_s=60)
        await r.write(B1, S.Splitting, src=Y, children=children, age_s=31)
        await r.write(B2, S.Owned, dst=Y, age_s=60)
        other_children = {
            BundleId("public/default/0x40000000_0x60000000"): Y,
            BundleId("public/default/0x60000000_0x80000000"): Y,
        }
        await r.write(B2, S.Splitting, src=Y, children=other_children, age_s=31)
        await r.write(next(iter(other_children)), S.Owned, dst=Y)  # this split got further

        report = await r.sweep()
        assert {(f.bundle, f.state) for f in report.fixes} == {(B1, S.Owned), (B2, S.Deleted)}
        b1 = r.follower.get(B1)
        assert forced(b1) and b1.state is S.Owned and b1.dst_broker == Y
        assert forced(r.follower.get(B2)) and r.follower.get(B2).state is S.Deleted
        # The split's source never cut the layout: finishing the split cuts it, so the other
        # child can still be looked up and assigned.
        layout = (await r.namespaces.refresh(NS)).bundles().bundles()
        assert {b.id for b in layout} >= set(other_children)
        assert B2 not in {b.id for b in layout}


async def test_old_free_and_deleted_values_are_tombstoned() -> None:
    async with rig() as r:
        await r.write(B1, S.Free, src=X, age_s=SETTINGS.tombstone_after_s + 1)
        await r.write(B2, S.Deleted, src=X, age_s=SETTINGS.tombstone_after_s + 1)
        await r.write(B3, S.Free, src=X, age_s=SETTINGS.tombstone_after_s - 10)
        report = await r.sweep()
        assert {(f.bundle, f.kind, f.state) for f in report.fixes} == {
            (B1, "tombstone", None),
            (B2, "tombstone", None),
        }
        assert B1 not in r.follower.table and B2 not in r.follower.table
        assert r.follower.get(B3).state is S.Free
        assert r.cleanup("tombstone", "Success") == 2


async def test_a_deposed_leader_writes_nothing() -> None:
    async with rig() as r:
        await r.register(Y)
        await r.write(B1, S.Assigning, dst=Y, age_s=31)
        await r.write(B2, S.Owned, dst=Y, leader_term=TERM + 1, force=True)
        before = len(r.writer.log)
        report = await r.sweep()
        assert report.fixes == () and report.skipped is not None
        assert len(r.writer.log) == before


async def test_an_orphan_never_lands_on_a_broker_reserved_for_an_isolated_namespace() -> None:
    async with rig() as r:
        isolated = NamespacePolicies(isolation=IsolationPolicy(primary=(Z,)))
        await r.namespaces.create(NamespaceName.parse("iso/ns"), 4, isolated)
        await r.register(X, Y, Z)
        # Z is the least loaded: without the isolation filter it would be the one chosen.
        await r.load(Y, 0.9)
        await r.load(Z, 0.1)
        await r.write(B1, S.Owned, dst=X)
        await r.deregister(X)
        await r.clock.run_for(SETTINGS.orphan_cleanup_grace_s + 0.5)
        await r.load(Y, 0.9)
        await r.load(Z, 0.1)

        report = await r.sweep()

        assert [(f.bundle, f.dst) for f in report.fixes] == [(B1, Y)]
        assert "isolation" in report.fixes[0].reason


async def test_an_orphan_goes_where_its_anti_affinity_group_is_not() -> None:
    async with rig() as r:
        grouped = NamespacePolicies(anti_affinity_group="spread")
        one, two = NamespaceName.parse("aa/one"), NamespaceName.parse("aa/two")
        await r.namespaces.create(one, 2, grouped)
        await r.namespaces.create(two, 2, grouped)
        orphan = BundleId("aa/one/0x00000000_0x80000000")
        await r.register(X, Y, Z)
        await r.write(BundleId("aa/two/0x00000000_0x80000000"), S.Owned, dst=Z)
        await r.write(orphan, S.Owned, dst=X)
        await r.deregister(X)
        await r.clock.run_for(SETTINGS.orphan_cleanup_grace_s + 0.5)
        # Z is the least loaded, but it owns a bundle of the group's other namespace already.
        await r.load(Y, 0.9)
        await r.load(Z, 0.1)

        report = await r.sweep()

        assert [(f.bundle, f.dst) for f in report.fixes] == [(orphan, Y)]


async def test_the_checkpoint_duty_saves_under_the_leaders_term() -> None:
    async with rig() as r:
        store = MemoryCheckpointStore()
        duty = CheckpointDuty(store, r.follower, r.clock, interval_s=300)
        await r.write(B1, S.Owned, dst=Y)
        task = asyncio.create_task(duty.run_leading(TERM))
        try:
            await settle(r.clock, lambda: store.saves == 1, seconds=301)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        saved = await store.load()
        assert saved is not None and saved.leader_term == TERM
        assert saved.position == r.follower.table.last_position


async def test_an_orphan_ends_owned_by_a_live_broker_through_its_reactor() -> None:
    async with Harness(config=dataclasses.replace(QUIET, monitor=SETTINGS)) as h:
        a = await h.add("broker-a")
        b = await h.add("broker-b", auto_ack=False, fake_broker=True)
        sweep_by_hand(b)
        await h.ready()
        await a.operations.assign(B1, a.me)
        await h.idle()
        monitor = b.monitor
        await a.close()  # its lease is revoked: the registration vanishes at once
        await turns(lambda: b.registry.get(a.me) is None)
        assert (await monitor.run_once(TERM)).fixes == ()

        await h.clock.run_for(SETTINGS.orphan_cleanup_grace_s + 0.5)
        announced = (await monitor.run_once(TERM)).fixes
        await h.idle()
        assert h.owner(B1) is None and B1 not in b.broker.serving
        await h.clock.run_for(HANDOVER_S + 0.5)
        fixes = (await monitor.run_once(TERM)).fixes
        await h.idle()

        assert [(f.bundle, f.state) for f in announced] == [(B1, S.Releasing)]
        assert [(f.bundle, f.state, f.dst) for f in fixes] == [(B1, S.Assigning, b.me)]
        assert h.owner(B1) == b.me and B1 in b.broker.serving
        assert h.violations == []


async def test_a_sweep_of_a_large_table_lets_the_event_loop_run_between_slices() -> None:
    # When a broker with 100k bundles is gone, checking them is a few hundred milliseconds;
    # lookups and keepalives must not wait for all of it. Here: 3 slices of bundles Owned by
    # Z, which never registered (orphans once the grace ends), and one more at the end.
    async with rig() as r:
        await r.register(X, Y)
        count = 3 * SWEEP_SLICE
        big = [BundleId(f"public/default/0x{i:08x}_0x{i + 1:08x}") for i in range(count)]
        for bundle in big:
            await r.writer.publish(
                bundle,
                encode_value(
                    ServiceUnitStateData(
                        state=S.Owned, version_id=1, dst_broker=Z, timestamp_ms=r.clock.now_ms()
                    )
                ),
            )
        await r.write(B1, S.Owned, dst=Z)
        turns_during: list[int] = [0]
        sweeping = asyncio.ensure_future(r.monitor.run_once(TERM))

        async def count_turns() -> None:
            while not sweeping.done():
                turns_during[0] += 1
                await asyncio.sleep(0)

        await asyncio.gather(sweeping, count_turns())
        assert turns_during[0] >= 3  # one at least after every slice
        assert sweeping.result().waiting == {Z: 0.0}
        await r.clock.run_for(SETTINGS.orphan_cleanup_grace_s + 0.5)
        fixes = (await r.sweep()).fixes
        assert sorted((f.bundle, f.state) for f in fixes) == sorted(
            (b, S.Releasing) for b in [*big, B1]
        )


async def test_a_sweep_logs_its_first_decisions_one_by_one_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    few = [BundleId(f"public/default/0x{i:08x}_0x{i + 1:08x}") for i in range(DECISION_LINES)]
    many = [
        BundleId(f"public/default/0x{i:08x}_0x{i + 1:08x}")
        for i in range(DECISION_LINES, 3 * DECISION_LINES + 5)
    ]

    def lines(level: int) -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "lbd.services.leader.monitor" and r.levelno == level
        ]

    async with rig() as r:
        caplog.set_level(logging.INFO, logger="lbd.services.leader.monitor")
        await r.orphans_announced(*few)  # a sweep of exactly DECISION_LINES fixes
        decided = [line for line in lines(logging.INFO) if "monitor decision:" in line]
        assert sorted(line.split()[2] for line in decided) == sorted(f"bundle={b}" for b in few)
        assert all(f"kind=orphan wrote=Releasing dst={Y} term={TERM}" in line for line in decided)
        assert not any("more decisions" in line for line in lines(logging.INFO))

        caplog.clear()
        caplog.set_level(logging.DEBUG, logger="lbd.services.leader.monitor")
        await r.register(Z)
        for bundle in many:
            await r.write(bundle, S.Owned, dst=Z)
        await r.deregister(Z)
        await r.sweep()
        await r.clock.run_for(SETTINGS.orphan_cleanup_grace_s + 0.5)
        report = await r.sweep()
        assert len(report.fixes) == len(many) + len(few)  # the hand-overs of ``few`` too
        info = [line for line in lines(logging.INFO) if "monitor decision:" in line]
        debug = [line for line in lines(logging.DEBUG) if "monitor decision:" in line]
        assert len(info) == DECISION_LINES
        assert len(info) + len(debug) == len(report.fixes)
        summary = [line for line in lines(logging.INFO) if "more decisions" in line]
        assert summary == [
            f"monitor: {len(report.fixes) - DECISION_LINES} more decisions in this sweep "
            f"(term {TERM}), logged at DEBUG; `lbd ctl decisions` lists every one"
        ]


async def test_a_broker_never_seen_registered_keeps_its_bundles_for_the_unseen_grace() -> None:
    # A cluster starting: the table names brokers whose sidecars and brokers are still coming
    # up. This leader never saw X registered, so X gets the longer grace; Z, seen to leave,
    # gets the orphan grace.
    config = dataclasses.replace(SETTINGS, orphan_cleanup_grace_s=2, unseen_broker_grace_s=30)
    async with rig(monitor=config) as r:
        await r.register(Y, Z)
        await r.write(B1, S.Owned, dst=X)
        await r.write(B2, S.Owned, dst=Z)
        await r.deregister(Z)
        await r.sweep()
        await r.clock.run_for(config.orphan_cleanup_grace_s + 0.5)
        fixed = {f.bundle for f in (await r.sweep()).fixes}
        assert fixed == {B2} and r.follower.get(B1).state is S.Owned
        await r.register(X)  # its broker attached: it keeps its bundle
        await r.clock.run_for(config.unseen_broker_grace_s)
        assert B1 not in {f.bundle for f in (await r.sweep()).fixes}
        assert r.follower.get(B1).state is S.Owned and r.follower.get(B1).dst_broker == X
