"""The leader elector on the in-memory metadata store and channel, with a manual clock."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from rig import settle

from lbd.adapters.clock import ManualClock
from lbd.adapters.memory.channel import MemoryChannelLog, MemoryLog
from lbd.adapters.memory.metadata import MemoryMetadataCluster, MemoryMetadataStore
from lbd.adapters.session import SessionPolicy
from lbd.core.ids import BrokerId, BundleId
from lbd.core.state import MAX_TERM_JUMP, ServiceUnitState, ServiceUnitStateData, encode_value
from lbd.core.table import ChannelPosition
from lbd.metrics import Metrics
from lbd.services.channel.follower import ChannelFollower
from lbd.services.leader.election import LeaderElector, channel_term

POLICY = SessionPolicy(lease_ttl_s=6, keepalive_interval_s=1.0)
A, B = BrokerId("broker-a"), BrokerId("broker-b")
BUNDLE = BundleId("public/default/0x00000000_0x40000000")


@dataclass
class RecordingDuty:
    """A duty that records the terms it ran under and whether it is running."""

    name: str = "recorder"
    started: list[int] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return len(self.started) > len(self.stopped)

    async def run_leading(self, term: int) -> None:
        self.started.append(term)
        try:
            await asyncio.Event().wait()
        finally:
            self.stopped.append(term)


@dataclass
class Candidate:
    store: MemoryMetadataStore
    follower: ChannelFollower
    elector: LeaderElector
    duty: RecordingDuty
    metrics: Metrics


@contextlib.asynccontextmanager
async def candidate(
    me: BrokerId, cluster: MemoryMetadataCluster, log: MemoryLog, clock: ManualClock
) -> AsyncIterator[Candidate]:
    store = MemoryMetadataStore(cluster, POLICY)
    await store.start()
    follower = ChannelFollower(MemoryChannelLog(log), name=f"follower-{me}")
    await follower.start()
    duty = RecordingDuty()
    metrics = Metrics()
    deaths: list[str] = []
    elector = LeaderElector(
        me,
        store,
        follower,
        clock,
        [duty],
        metrics=metrics,
        retry_s=1.0,
        on_death=lambda name, e: deaths.append(f"{name}: {e}"),
    )
    await elector.start()
    try:
        yield Candidate(store, follower, elector, duty, metrics)
    finally:
        await elector.close()
        await follower.close()
        await store.close()
        assert deaths == []


async def test_the_first_candidate_leads_and_the_second_takes_over_when_its_lease_is_lost() -> None:
    clock = ManualClock()
    cluster, log = MemoryMetadataCluster(clock), MemoryLog()
    async with candidate(A, cluster, log, clock) as a:
        await settle(clock, lambda: a.elector.is_leader)
        async with candidate(B, cluster, log, clock) as b:
            await settle(clock, lambda: b.elector.leader is not None)
            first_term = a.elector.term
            assert first_term is not None
            assert a.duty.started == [first_term] and a.duty.running
            assert not b.elector.is_leader and not b.duty.started
            assert b.elector.leader is not None and b.elector.leader.broker == A
            assert a.metrics.is_leader._value.get() == 1
            assert b.metrics.is_leader._value.get() == 0

            cluster.revoke_lease(a.store.lease_id)
            await settle(clock, lambda: b.elector.is_leader and not a.elector.is_leader)

            assert b.duty.running and b.elector.term is not None
            assert b.elector.term > first_term
            assert a.duty.stopped == [first_term] and not a.duty.running
            await settle(clock, lambda: a.elector.leader == b.elector.leader)
            assert a.metrics.leader_term._value.get() == b.elector.term


def forced(term: int, version: int = 1) -> ServiceUnitStateData:
    """A forced write as a leader's monitor makes it (or as a forger would)."""
    return ServiceUnitStateData(
        state=ServiceUnitState.Owned,
        version_id=version,
        dst_broker=B,
        force=True,
        leader_term=term,
    )


async def publish(log: MemoryLog, value: ServiceUnitStateData) -> ChannelPosition:
    return await MemoryChannelLog(log).publish(BUNDLE, encode_value(value))


async def applies(follower: ChannelFollower, log: MemoryLog, value: ServiceUnitStateData) -> bool:
    """Publish ``value`` and say whether ``follower``'s table took it."""
    await follower.wait_applied(await publish(log, value))
    return follower.get(BUNDLE) == value


def test_the_channel_term_is_the_etcd_term_unless_the_channel_is_not_below_it() -> None:
    assert channel_term(5, 0) == 5
    assert channel_term(5, 4) == 5
    assert channel_term(5, 5) == 10
    assert channel_term(5, 1000) == 1005
    assert channel_term(6, 1000) == 1006  # a later election over the same channel leads higher


async def test_duties_stop_when_the_channel_shows_a_higher_term_and_lead_above_it_again() -> None:
    clock = ManualClock()
    cluster, log = MemoryMetadataCluster(clock), MemoryLog()
    async with candidate(A, cluster, log, clock) as a:
        await settle(clock, lambda: a.duty.running)
        term = a.elector.term
        assert term is not None and a.elector.channel_term == term
        await publish(log, forced(term + 100))
        await settle(clock, lambda: not a.elector.is_leader, seconds=0.5)
        assert a.duty.stopped == [term] and a.elector.term is None

        # It queues up again, wins with a new etcd term and leads above the channel's term.
        await settle(clock, lambda: a.duty.running)
        again = a.elector.term
        assert again is not None and again > term
        assert a.elector.channel_term == term + 100 + again
        assert a.duty.started == [term, term + 100 + again]


async def test_a_leader_elected_under_a_forged_term_leads_above_it() -> None:
    clock = ManualClock()
    cluster, log = MemoryMetadataCluster(clock), MemoryLog()
    forged = 10**6  # far above any etcd term here, within the largest jump
    await publish(log, forced(forged))
    async with candidate(A, cluster, log, clock) as a, candidate(B, cluster, log, clock) as b:
        await settle(clock, lambda: a.duty.running)
        term = a.elector.term
        assert term is not None and term < forged
        assert a.duty.started == [forged + term]
        assert a.elector.channel_term == forged + term
        # The etcd term names the leadership, for the API and the metrics.
        await settle(clock, lambda: b.elector.leader is not None)
        assert a.elector.leader == b.elector.leader
        assert b.elector.leader is not None and b.elector.leader.term == term
        assert a.metrics.leader_term._value.get() == term

        # Its forced writes under the channel term apply; under the etcd term they would not.
        assert not await applies(b.follower, log, forced(term, version=2))
        assert await applies(b.follower, log, forced(forged + term, version=3))
        await clock.run_for(5)
        assert a.duty.started == [forged + term] and a.duty.running


async def test_a_term_beyond_the_largest_jump_is_rejected_and_deposes_nobody() -> None:
    clock = ManualClock()
    cluster, log = MemoryMetadataCluster(clock), MemoryLog()
    async with candidate(A, cluster, log, clock) as a:
        await settle(clock, lambda: a.duty.running)
        term = a.elector.term
        assert term is not None
        assert not await applies(a.follower, log, forced(term + MAX_TERM_JUMP + 1))
        assert a.follower.get(BUNDLE) is None and a.follower.table.highest_term == 0
        # The leader's own forced writes still apply, and it keeps leading.
        assert await applies(a.follower, log, forced(term))
        assert a.follower.table.highest_term == term
        await clock.run_for(5)
        assert a.duty.started == [term] and a.duty.running
