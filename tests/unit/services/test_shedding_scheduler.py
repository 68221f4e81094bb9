"""The unload scheduler: snapshot, decide, act; dry runs, safe mode and the scenario snapshot."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from harness import DEFAULT_NAMESPACE, Harness
from rig import QUIET, publish_load, settle, turns

from lbd.adapters.clock import ManualClock
from lbd.adapters.memory.channel import MemoryChannelLog
from lbd.adapters.memory.loadstore import MemoryLoadStore
from lbd.adapters.memory.metadata import MemoryMetadataCluster, MemoryMetadataStore
from lbd.adapters.session import SessionPolicy
from lbd.core.broker_info import BrokerInfo
from lbd.core.bundles import NamespaceBundles
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BundleLoad, TopBundlesLoadData
from lbd.core.namespace import IsolationPolicy, NamespacePolicies
from lbd.core.settings import MB, SheddingConfig
from lbd.core.shedding import DecisionReason, SkipReason, parse_scenario, scenario_to_json
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, decode_value, encode_value
from lbd.metrics import Metrics
from lbd.ports.errors import UnavailableError
from lbd.services.channel.follower import ChannelFollower
from lbd.services.cluster.namespaces import NamespaceService
from lbd.services.cluster.registry import BrokerRegistry
from lbd.services.leader.shedding import UnloadScheduler

S = ServiceUnitState
A, B, GONE = BrokerId("broker-a"), BrokerId("broker-b"), BrokerId("broker-gone")
POLICY = SessionPolicy(lease_ttl_s=10, keepalive_interval_s=1.0)
SETTINGS = SheddingConfig(hit_count_threshold=0, min_throughput_threshold=0.0)


def bundle(i: int) -> BundleId:
    return BundleId(f"public/default/0x{i * 0x10000000:08x}_0x{(i + 1) * 0x10000000:08x}")


A_BUNDLES = tuple(bundle(i) for i in range(4))
B_BUNDLES = (bundle(4),)


@dataclass
class Rig:
    clock: ManualClock
    cluster: MemoryMetadataCluster
    brokers: MemoryMetadataStore
    registry: BrokerRegistry
    writer: MemoryChannelLog
    follower: ChannelFollower
    load_pub: MemoryLoadStore
    top_pub: MemoryLoadStore
    scheduler: UnloadScheduler
    metrics: Metrics
    namespaces: NamespaceService

    async def own(self, broker: BrokerId, *bundles: BundleId) -> None:
        for b in bundles:
            value = ServiceUnitStateData(
                state=S.Owned, version_id=1, dst_broker=broker, timestamp_ms=self.clock.now_ms()
            )
            position = await self.writer.publish(b, encode_value(value))
            await self.follower.wait_applied(position)

    async def report(self, broker: BrokerId, load: float, bundles: tuple[BundleId, ...]) -> None:
        """``broker``'s load data and top bundles: ``load``, 25 MB/s a bundle."""
        data = BrokerLoadData(
            broker,
            weighted_max_ema=load,
            msg_throughput_ema=25 * MB * len(bundles),
            updated_at_ms=self.clock.now_ms(),
        )
        await self.load_pub.publish(broker, data.to_json())
        tops = tuple(BundleLoad(b, msg_throughput_in=25 * MB) for b in bundles)
        await self.top_pub.publish(broker, TopBundlesLoadData(broker, tops).to_json())

    async def register(self, *brokers: BrokerId) -> None:
        for broker in brokers:
            await self.brokers.register_broker(broker, BrokerInfo(broker).to_json())
        await turns(lambda: all(self.registry.get(b) is not None for b in brokers))

    async def imbalanced(self) -> None:
        """A is at 90% with four bundles, B at 10% with one."""
        await self.register(A, B)
        await self.own(A, *A_BUNDLES)
        await self.own(B, *B_BUNDLES)
        await self.report(A, 0.9, A_BUNDLES)
        await self.report(B, 0.1, B_BUNDLES)

    def releasing(self) -> dict[BundleId, ServiceUnitStateData]:
        return {b: v for b, v in self.follower.table.items() if v.state is S.Releasing}


@contextlib.asynccontextmanager
async def rig(
    settings: SheddingConfig = SETTINGS, strategy: str = "transfer_shedder"
) -> AsyncIterator[Rig]:
    """One sidecar as the wiring builds it, with no broker of its own (so it takes no bundle),
    whose unload scheduler the tests run by hand; ``brokers`` registers the brokers A and B.
    The scheduler's own behaviour is shown with Pulsar's TransferShedder."""
    config = dataclasses.replace(QUIET, shedding=settings, shedding_strategy=strategy)
    async with Harness(seed=3, config=config) as h:
        leader = await h.add("leader", auto_ack=False)
        brokers = MemoryMetadataStore(h.metadata, POLICY)
        await brokers.start()
        try:
            yield Rig(
                h.clock,
                h.metadata,
                brokers,
                leader.registry,
                MemoryChannelLog(h.log),
                leader.follower,
                MemoryLoadStore(h.broker_load, h.clock),
                MemoryLoadStore(h.top_bundles, h.clock),
                leader.unload_scheduler,
                leader.metrics,
                leader.namespaces,
            )
        finally:
            await brokers.close()


async def applied(r: Rig) -> None:
    if len(r.writer.log):
        await r.follower.wait_applied(r.writer.log.messages[-1].position)


async def test_a_cycle_proposes_releasing_off_the_overloaded_broker() -> None:
    async with rig() as r:
        await r.imbalanced()
        report = await r.scheduler.run_cycle(dry_run=False)
        await applied(r)

        assert report.result.decisions and not report.dropped
        assert all(d.src == A and d.dst == B for d in report.result.decisions)
        assert report.result.decisions[0].reason is DecisionReason.OVERLOADED
        releasing = r.releasing()
        assert set(releasing) == {d.bundle for d in report.proposed}
        for value in releasing.values():
            assert (value.source_broker, value.dst_broker) == (A, B) and not value.force
        assert r.metrics.unload_total.labels(
            result="Success", reason="Overloaded"
        )._value.get() == len(report.proposed)
        # The leader remembers the unload: the bundle is in its grace period, A cools down.
        snapshot = r.scheduler.snapshot().snapshot
        assert set(snapshot.recently_unloaded_bundles) == set(releasing)
        assert set(snapshot.recently_unloaded_brokers) == {A}
        again = await r.scheduler.run_once(dry_run=False)
        assert again.skip_reason is SkipReason.COOL_DOWN


@pytest.mark.parametrize("strategy", ["cluster_planner", "transfer_shedder", "avg_shedder"])
async def test_the_strategy_sees_the_placement_rules_of_the_reported_bundles(
    strategy: str,
) -> None:
    settings = dataclasses.replace(
        SETTINGS,
        avg_shedder_hit_count_high_threshold=1,
        avg_shedder_hit_count_low_threshold=1,
        avg_shedder_unload_share=0.5,
    )
    async with rig(settings, strategy) as r:
        c = BrokerId("broker-c")
        await r.register(c)
        await r.imbalanced()
        await r.report(c, 0.2, (bundle(5),))
        await r.own(c, bundle(5))
        # The default namespace may only live on A and C: B, the least loaded, is out.
        await r.namespaces.set_policies(
            DEFAULT_NAMESPACE, NamespacePolicies(isolation=IsolationPolicy((A, c)))
        )
        report = await r.scheduler.run_cycle(dry_run=True)
        destinations = {d.dst for d in report.result.decisions}
        if strategy == "cluster_planner":
            assert destinations == {c}
        else:
            # Pulsar's strategies pair A with the least loaded broker, B, only: that pair may
            # not move anything.
            assert destinations == set()
            assert report.result.skip_reason is SkipReason.NO_BUNDLES


async def test_a_dry_run_proposes_nothing_and_carries_no_state() -> None:
    async with rig(SheddingConfig(hit_count_threshold=1, min_throughput_threshold=0.0)) as r:
        await r.imbalanced()
        first = await r.scheduler.run_once(dry_run=True)
        assert first.skip_reason is SkipReason.HIT_COUNT
        assert r.scheduler.state.hit_count == 0
        await r.scheduler.run_once(dry_run=False)  # the condition held once
        assert r.scheduler.state.hit_count == 1
        dry = await r.scheduler.run_once(dry_run=True)
        assert dry.decisions and all(d.src == A for d in dry.decisions)
        await applied(r)
        assert r.releasing() == {}
        assert r.scheduler.state.hit_count == 1
        assert r.scheduler.snapshot().snapshot.recently_unloaded_bundles == {}


async def test_only_registered_brokers_count_and_none_means_no_brokers() -> None:
    async with rig() as r:
        assert (await r.scheduler.run_once(dry_run=False)).skip_reason is SkipReason.NO_BROKERS
        await r.own(A, *A_BUNDLES)
        await r.report(A, 0.9, A_BUNDLES)  # published, but A is not registered
        await r.report(GONE, 0.1, B_BUNDLES)
        assert (await r.scheduler.run_once(dry_run=False)).skip_reason is SkipReason.NO_BROKERS
        await r.register(A, B)  # B registered but has not reported
        result = await r.scheduler.run_once(dry_run=False)
        assert result.skip_reason is SkipReason.NO_LOAD_DATA
        assert set(r.scheduler.snapshot().snapshot.brokers) == {A, B}


async def test_load_data_older_than_the_ttl_is_ignored() -> None:
    settings = SheddingConfig(hit_count_threshold=0, min_throughput_threshold=0, load_data_ttl_s=60)
    async with rig(settings) as r:
        await r.imbalanced()
        await r.clock.run_for(61)
        await r.report(A, 0.9, A_BUNDLES)  # A reports again, B went quiet
        result = await r.scheduler.run_once(dry_run=True)
        assert result.skip_reason is SkipReason.NO_LOAD_DATA
        assert r.scheduler.snapshot().snapshot.brokers[B] is None
        await r.clock.run_for(61)
        assert (await r.scheduler.run_once(dry_run=True)).skip_reason is SkipReason.NO_BROKERS


async def test_a_decision_on_a_bundle_that_is_not_owned_by_its_source_is_dropped() -> None:
    async with rig() as r:
        await r.imbalanced()
        # Plain unloads of A's bundles are under way: A is still their holder, but they are not
        # Owned, so the scheduler must not propose another Releasing on top.
        for b in A_BUNDLES:
            value = ServiceUnitStateData(state=S.Releasing, version_id=2, source_broker=A)
            await r.writer.publish(b, encode_value(value))
        await applied(r)
        before = len(r.writer.log)
        report = await r.scheduler.run_cycle(dry_run=False)
        assert report.result.decisions and report.proposed == ()
        assert {d.bundle for d, _ in report.dropped} == {d.bundle for d in report.result.decisions}
        assert all("Releasing now, not Owned" in why for _, why in report.dropped)
        assert len(r.writer.log) == before
        assert r.metrics.unload_total.labels(
            result="Failure", reason="Unknown"
        )._value.get() == len(report.dropped)


async def test_safe_mode_runs_no_cycle() -> None:
    async with rig() as r:
        await r.imbalanced()
        r.cluster.set_reachable(False)
        await settle(r.clock, lambda: not r.registry.reachable)
        with pytest.raises(UnavailableError, match="safe mode"):
            await r.scheduler.run_once(dry_run=False)
        await applied(r)
        assert r.releasing() == {}


async def test_the_snapshot_is_a_scenario_the_shed_command_reads_back() -> None:
    async with rig() as r:
        await r.imbalanced()
        scenario = r.scheduler.snapshot()
        assert scenario.now_ms == r.clock.now_ms()
        assert scenario.config == SETTINGS
        snap = scenario.snapshot
        assert snap.brokers[A] is not None and snap.brokers[A].weighted_max_ema == 0.9
        assert [b.bundle for b in snap.top_bundles[B]] == list(B_BUNDLES)
        assert snap.owners[A_BUNDLES[0]] == A
        back = parse_scenario(scenario_to_json(scenario))
        assert back.snapshot.owners == snap.owners
        assert set(back.snapshot.brokers) == {A, B}


async def test_the_leader_moves_a_bundle_off_an_overloaded_broker_to_its_new_owner() -> None:
    shedding = SheddingConfig(hit_count_threshold=0, min_throughput_threshold=0)
    config = dataclasses.replace(QUIET, shedding=shedding, shedding_interval_s=60)
    async with Harness(config=config) as h:
        a = await h.add("broker-a", auto_ack=False, fake_broker=True)
        b = await h.add("broker-b", auto_ack=False, fake_broker=True)
        await h.ready()
        bundles = [x.id for x in NamespaceBundles.default(DEFAULT_NAMESPACE).bundles()]
        for x in bundles:
            assert await a.operations.assign(x, a.me) == a.me
        await h.idle()
        await publish_load(h, a.me, 0.9, bundles, 25 * MB)
        await publish_load(h, b.me, 0.1, [], 25 * MB)
        await settle(h.clock, lambda: a.elector.is_leader)  # the first to campaign
        await settle(h.clock, lambda: len(h.log) > len(bundles) * 2, seconds=61)
        await h.idle()

        moved = [x for x in bundles if h.owner(x) == b.me]
        assert moved and all(h.owner(x) in (a.me, b.me) for x in bundles)
        for x in moved:
            # Releasing(b, a) -> Assigning(b, a) -> Owned(b): A released before B owned.
            states = [decode_value(m.value).state for m in h.log.messages if m.key == x]
            assert states[-3:] == [S.Releasing, S.Assigning, S.Owned]
            assert h.kinds(x)[-2:] == [(a.me, "release"), (b.me, "own")]
            assert x in b.broker.serving and x not in a.broker.serving
        assert h.violations == []
