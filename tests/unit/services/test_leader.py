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
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, encode_value
from lbd.metrics import Metrics
from lbd.services.channel.follower import ChannelFollower
from lbd.services.leader.election import LeaderElector

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


async def test_duties_stop_when_the_channel_shows_a_higher_term() -> None:
    clock = ManualClock()
    cluster, log = MemoryMetadataCluster(clock), MemoryLog()
    async with candidate(A, cluster, log, clock) as a:
        await settle(clock, lambda: a.duty.running)
        term = a.elector.term
        assert term is not None
        newer = ServiceUnitStateData(
            state=ServiceUnitState.Owned,
            version_id=1,
            dst_broker=B,
            force=True,
            leader_term=term + 100,
        )
        await MemoryChannelLog(log).publish(BUNDLE, encode_value(newer))
        await settle(clock, lambda: not a.elector.is_leader, seconds=0.5)

        assert a.duty.stopped == [term] and a.elector.term is None
        # It keeps queueing up, but no term of its own beats the channel's: it never leads again.
        await clock.run_for(5)
        assert a.duty.started == [term]


async def test_an_unreachable_store_pauses_the_duties_until_it_answers_again() -> None:
    clock = ManualClock()
    cluster, log = MemoryMetadataCluster(clock), MemoryLog()
    async with candidate(A, cluster, log, clock) as a:
        await settle(clock, lambda: a.duty.running)
        term = a.elector.term

        cluster.set_reachable(False)
        await settle(clock, lambda: not a.elector.is_leader)
        assert not a.duty.running

        cluster.set_reachable(True)
        await settle(clock, lambda: a.duty.running)
        # The lease survived: same candidacy, same term.
        assert a.elector.term == term
        assert a.duty.started == [term, term]


async def test_closing_the_leader_hands_over_at_once() -> None:
    clock = ManualClock()
    cluster, log = MemoryMetadataCluster(clock), MemoryLog()
    async with candidate(B, cluster, log, clock) as b, candidate(A, cluster, log, clock) as a:
        await settle(clock, lambda: b.elector.is_leader)
        await settle(clock, lambda: a.elector.leader is not None)
        assert not a.elector.is_leader
        await b.elector.close()  # resigns: no wait for its lease to expire
        await settle(clock, lambda: a.elector.is_leader, seconds=0.5)
        assert not b.duty.running and a.duty.running


async def test_a_duty_that_dies_stops_the_leader_and_is_reported() -> None:
    class Broken:
        name = "broken"

        async def run_leading(self, term: int) -> None:
            raise RuntimeError("bug in a duty")

    clock = ManualClock()
    cluster, log = MemoryMetadataCluster(clock), MemoryLog()
    store = MemoryMetadataStore(cluster, POLICY)
    await store.start()
    follower = ChannelFollower(MemoryChannelLog(log))
    await follower.start()
    deaths: list[str] = []
    healthy = RecordingDuty()
    elector = LeaderElector(
        A,
        store,
        follower,
        clock,
        [Broken(), healthy],
        metrics=Metrics(),
        retry_s=1.0,
        on_death=lambda name, e: deaths.append(f"{name}: {e}"),
    )
    async with elector:
        await settle(clock, lambda: bool(deaths))
        await settle(clock, lambda: not healthy.running)
    await follower.close()
    await store.close()
    assert deaths[0] == "leader-broken: bug in a duty"
    assert healthy.started and len(healthy.stopped) == len(healthy.started)
