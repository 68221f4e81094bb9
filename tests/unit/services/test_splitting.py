"""The split scheduler of in-process sidecars (as the wiring builds it): a hot bundle splits after
the hit count, and each split is counted once; a child of a bundle still Splitting is held back;
the decision's failures are counted."""

from __future__ import annotations

from harness import DEFAULT_NAMESPACE, Harness, Sidecar
from rig import settle, turns

from lbd.core.broker_info import LoadReport
from lbd.core.bundles import NamespaceBundles, bundle_id, parse_bundle_id
from lbd.core.ids import BundleId
from lbd.core.load import BundleLoad
from lbd.core.settings import SplitConfig
from lbd.core.split import SplitReason
from lbd.core.state import ServiceUnitState
from lbd.services.sidecar.splitting import SplitScheduler

S = ServiceUnitState
BUNDLES = [b.id for b in NamespaceBundles.default(DEFAULT_NAMESPACE).bundles()]
HOT, COOL, ELSEWHERE = BUNDLES[0], BUNDLES[1], BUNDLES[2]
HOT_CHILDREN = {
    BundleId("public/default/0x00000000_0x20000000"),
    BundleId("public/default/0x20000000_0x40000000"),
}


async def report(sidecar: Sidecar, *loads: BundleLoad) -> None:
    assert sidecar.broker is not None
    sent = LoadReport(bundles=loads)
    sidecar.broker.report(sent)
    await turns(lambda: sidecar.link.latest_report is sent)


async def test_a_hot_bundle_splits_after_the_hit_count_and_others_do_not() -> None:
    async with Harness() as h:
        a = await h.add("broker-a", auto_ack=False, fake_broker=True)
        b = await h.add("broker-b")
        await h.ready()
        await a.operations.assign(HOT, a.me)
        await a.operations.assign(COOL, a.me)
        await a.operations.assign(ELSEWHERE, b.me)
        await h.idle()
        await report(
            a,
            BundleLoad(HOT, topics=1500),  # over the 1000-topic limit
            BundleLoad(COOL, topics=10),
            BundleLoad(ELSEWHERE, topics=5000),  # reported by mistake: B owns it
        )
        splitter = a.splitter
        for cycle in range(1, 4):
            plan = await splitter.run_once()
            assert plan.decisions == ()
            assert dict(splitter.state.hit_counts) == {HOT: cycle}

        plan = await splitter.run_once()
        await h.idle()

        assert [(d.bundle, d.reason) for d in plan.decisions] == [(HOT, SplitReason.TOPICS)]
        assert splitter.state.hit_counts == {}
        assert a.follower.get(HOT).state is S.Deleted
        for child in HOT_CHILDREN:
            assert h.owner(child) == a.me
        assert h.owner(COOL) == a.me and h.owner(ELSEWHERE) == b.me
        record = await a.namespaces.refresh(DEFAULT_NAMESPACE)
        assert len(record.bundles()) == 5
        # Counted once, by Operations.split: the scheduler does not count it again.
        assert a.metrics.split_total.labels(result="Success", reason="Topics")._value.get() == 1
        assert a.metrics.split_total.labels(result="Failure", reason="Topics")._value.get() == 0
        assert h.violations == []


async def test_a_bundle_that_cools_down_loses_its_count() -> None:
    async with Harness() as h:
        a = await h.add("broker-a", auto_ack=False, fake_broker=True)
        await h.ready()
        await a.operations.assign(HOT, a.me)
        await h.idle()
        splitter = a.splitter
        await report(a, BundleLoad(HOT, msg_rate_in=40000, topics=3))
        await splitter.run_once()
        await splitter.run_once()
        assert splitter.state.hit_counts == {HOT: 2}
        await report(a, BundleLoad(HOT, msg_rate_in=10, topics=3))
        await splitter.run_once()
        assert splitter.state.hit_counts == {}


async def test_without_a_broker_there_is_nothing_to_split() -> None:
    async with Harness() as h:
        a = await h.add("broker-a")  # auto-ack, no broker: no per-bundle stats
        await h.ready()
        await a.operations.assign(HOT, a.me)
        plan = await a.splitter.run_once()
        assert plan.decisions == () and plan.state.hit_counts == {}


async def test_the_scheduler_runs_every_interval() -> None:
    async with Harness() as h:
        a = await h.add("broker-a", auto_ack=False, fake_broker=True)
        await h.ready()
        await a.operations.assign(HOT, a.me)
        await h.idle()
        await report(a, BundleLoad(HOT, topics=1500))
        splitter = a.splitter
        await settle(h.clock, lambda: splitter.state.hit_counts == {HOT: 2}, seconds=121)
        await splitter.close()
        await h.clock.run_for(h.config.split_interval_s * 2)
        assert splitter.state.hit_counts == {HOT: 2}  # closed: no more cycles


async def test_a_child_of_a_bundle_still_splitting_is_held_back() -> None:
    parent = parse_bundle_id(HOT)
    middle = (parent.range.lo + parent.range.hi) // 2
    lo = bundle_id(parent.namespace, parent.range.lo, middle)
    hi = bundle_id(parent.namespace, middle, parent.range.hi)
    async with Harness() as h:
        a = await h.add("broker-a", auto_ack=False, fake_broker=True)
        b = await h.add("broker-b", auto_ack=False, fake_broker=True)
        await h.ready()
        await a.operations.assign(HOT, a.me)
        await h.idle()
        await a.namespaces.get(DEFAULT_NAMESPACE)  # the bundle count, cached before the cut
        a.metadata.set_cut_off(True)  # the layout cannot be cut: the split waits
        await a.proposer.propose(HOT, S.Splitting, src=a.me, split_children={lo: a.me, hi: a.me})
        await turns(lambda: a.served() >= {lo, hi})
        # A child Owned while its parent is still Splitting (B writes it: A is cut off).
        await b.proposer.propose(lo, S.Owned, dst=a.me)
        await turns(lambda: a.follower.get(lo) is not None)
        await report(a, BundleLoad(lo, topics=1500))
        for _ in range(4):
            plan = await a.splitter.run_once()
        assert plan.decisions == () and plan.failures == ()
        assert plan.held_back == ((lo, f"overlaps {HOT}, which is Splitting"),)
        a.metadata.set_cut_off(False)
        await turns(lambda: a.follower.get(HOT).state is S.Deleted)
        await h.idle()
        plan = await a.splitter.run_once()
        assert [d.bundle for d in plan.decisions] == [lo]


async def test_the_decisions_failures_are_counted_as_unknown() -> None:
    async with Harness() as h:
        a = await h.add("broker-a", auto_ack=False, fake_broker=True)
        await h.ready()
        await a.operations.assign(HOT, a.me)
        await h.idle()
        # topic_count_equally_divide, and the broker sends no topic stats: no split point.
        config = SplitConfig(algorithm="topic_count_equally_divide", hit_count_threshold=0)
        splitter = SplitScheduler(
            a.me,
            a.operations,
            a.follower,
            a.link,
            a.namespaces,
            h.clock,
            config,
            interval_s=60.0,
            metrics=a.metrics,
        )
        await report(a, BundleLoad(HOT, topics=1500))
        plan = await splitter.run_once()
        assert plan.decisions == ()
        assert [b for b, _ in plan.failures] == [HOT]
        failed = a.metrics.split_total.labels(result="Failure", reason="Unknown")
        assert failed._value.get() == 1
