"""The metrics the alerts of ``deploy/prometheus`` watch, kept by the services that know:
``lbd_fenced`` and ``lbd_fence_total`` by the fence, ``lbd_bundles_in_flight`` from the channel
table, ``lbd_load_std`` and ``lbd_load_target_std`` by the leader's shedding cycles."""

from harness import DEFAULT_NAMESPACE, Harness, Sidecar, Timing
from rig import QUIET

from lbd.adapters.memory.channel import MemoryChannelLog
from lbd.core.bundles import NamespaceBundles
from lbd.core.ids import BrokerId
from lbd.core.shedding import SheddingResult, SkipReason
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, encode_value
from lbd.metrics import Metrics

S = ServiceUnitState
BUNDLES = [b.id for b in NamespaceBundles.default(DEFAULT_NAMESPACE).bundles()]
TIMING = Timing(lease_ttl_s=15, keepalive_interval_s=2.0, fence_after_s=8.0)


def applied(sidecar: Sidecar, state: str) -> float:
    value = sidecar.metrics.registry.get_sample_value(
        "lbd_channel_subscribe_ops_total", {"state": state}
    )
    return value or 0.0


def data(
    state: ServiceUnitState, version: int, dst: BrokerId | None, src: BrokerId | None = None
) -> ServiceUnitStateData:
    return ServiceUnitStateData(state=state, version_id=version, dst_broker=dst, source_broker=src)


def sample(sidecar: Sidecar | Metrics, name: str) -> float | None:
    metrics = sidecar if isinstance(sidecar, Metrics) else sidecar.metrics
    return metrics.registry.get_sample_value(name)


async def test_fenced_is_one_while_fenced_and_each_fencing_is_counted() -> None:
    async with Harness(timing=TIMING) as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        await h.ready()
        assert (sample(a, "lbd_fenced"), sample(a, "lbd_fence_total")) == (0, 0)
        h.metadata.set_reachable(False)
        h.log.go_down()
        await h.clock.run_for(TIMING.fence_after_s + 2, step=0.5)
        assert a.fence.fenced
        assert (sample(a, "lbd_fenced"), sample(a, "lbd_fence_total")) == (1, 1)
        h.metadata.set_reachable(True)
        h.log.come_back()
        await h.clock.run_for(TIMING.keepalive_interval_s + TIMING.fence_check_interval_s, step=0.5)
        assert not a.fence.fenced
        assert (sample(a, "lbd_fenced"), sample(a, "lbd_fence_total")) == (0, 1)


async def test_bundles_in_flight_follow_the_table_on_every_sidecar() -> None:
    async with Harness(config=QUIET) as h:
        a = await h.add("a")
        b = await h.add("b", auto_ack=False, fake_broker=True)
        await h.ready()
        # Assigning, then Owned: in flight for a moment, none after.
        await a.operations.assign(BUNDLES[0], b.me)
        await h.idle()
        assert h.owner(BUNDLES[0]) == b.me
        assert sample(a, "lbd_bundles_in_flight") == sample(b, "lbd_bundles_in_flight") == 0
        # A broker that refuses to take a bundle leaves it Assigning.
        b.broker.ack_own = False
        await a.proposer.propose(BUNDLES[1], ServiceUnitState.Assigning, dst=b.me)
        await h.idle()
        assert h.owner(BUNDLES[1]) is None
        assert sample(a, "lbd_bundles_in_flight") == sample(b, "lbd_bundles_in_flight") == 1
        # A sidecar started now counts what its table already holds.
        c = await h.add("c")
        await h.idle()
        assert sample(c, "lbd_bundles_in_flight") == 1


async def test_changes_applied_together_are_each_counted_and_owned_bundles_follow() -> None:
    async with Harness(config=QUIET) as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        await h.ready()
        writer = MemoryChannelLog(h.log)
        before = {s: applied(a, s) for s in ("Assigning", "Owned", "Releasing")}
        # Published back to back: the sidecar applies them before its counter runs again.
        for bundle in BUNDLES:
            await writer.publish(bundle, encode_value(data(S.Assigning, 1, a.me)))
            await writer.publish(bundle, encode_value(data(S.Owned, 2, a.me)))
        await writer.publish(BUNDLES[0], encode_value(data(S.Releasing, 3, None, a.me)))
        await a.follower.wait_applied(h.log.messages[-1].position)
        await h.idle()
        assert applied(a, "Assigning") - before["Assigning"] == len(BUNDLES)
        assert applied(a, "Owned") - before["Owned"] == len(BUNDLES)
        assert applied(a, "Releasing") - before["Releasing"] == 1
        values = [v for _, v in a.follower.table.items()]
        assert sample(a, "lbd_owned_bundles") == len(BUNDLES) - 1
        assert sample(a, "lbd_owned_bundles") == sum(
            1 for v in values if v.state is S.Owned and v.dst_broker == a.me
        )
        assert sample(a, "lbd_bundles_in_flight") == sum(1 for v in values if v.state.is_in_flight)
        await writer.close()


async def test_the_leaders_shedding_cycle_sets_the_load_std_and_its_target() -> None:
    async with Harness(config=QUIET) as h:
        a = await h.add("a")
        await h.ready()
        await a.unload_scheduler.run_once(dry_run=False)
        assert sample(a, "lbd_load_target_std") == QUIET.shedding.target_std
        assert sample(a, "lbd_load_std") == 0  # no load reported: nothing to spread


def test_observe_shedding_keeps_the_target_it_was_last_given() -> None:
    metrics = Metrics()
    metrics.observe_shedding(SheddingResult((), SkipReason.COOL_DOWN, 0.4, 0.3), target_std=0.1)
    metrics.observe_shedding(SheddingResult((), SkipReason.COOL_DOWN, 0.4, 0.2))
    assert sample(metrics, "lbd_load_std") == 0.2
    assert sample(metrics, "lbd_load_target_std") == 0.1
