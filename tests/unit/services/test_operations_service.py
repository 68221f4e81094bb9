"""Operations: assign, transfer, unload, split; bad requests are refused and change nothing."""

import asyncio
import dataclasses

import pytest
from harness import DEFAULT_NAMESPACE, Harness
from rig import QUIET, settle, turns

from lbd.core.broker_info import LoadReport
from lbd.core.bundles import NamespaceBundles, TopicLoad, parse_bundle_id, topic_hash
from lbd.core.errors import InvalidInputError, NotFoundError, PreconditionError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BundleLoad
from lbd.core.names import NamespaceName
from lbd.core.namespace import NamespacePolicies
from lbd.core.settings import MonitorConfig
from lbd.core.state import MAX_SPLIT_CHILDREN, ServiceUnitState
from lbd.ports.errors import UnavailableError

S = ServiceUnitState
LAYOUT = NamespaceBundles.default(DEFAULT_NAMESPACE)
BUNDLES = [b.id for b in LAYOUT.bundles()]
B0 = BUNDLES[0]


async def owned_by(h: Harness, bundle: BundleId, broker: str) -> None:
    owner = h[broker]
    assert await owner.operations.assign(bundle, owner.me) == broker
    await h.idle()


def snapshot(h: Harness) -> tuple[object, ...]:
    """The whole shared state: channel, namespace records, broker events."""
    records = {k: (r.value, r.mod_revision) for k, r in h.metadata.list("namespaces/")[0].items()}
    return (len(h.log), records, list(h.events))


# -- assign ---------------------------------------------------------------------------------


async def test_assign_to_a_chosen_broker_and_to_a_selected_one() -> None:
    async with Harness() as h:
        a, _b = await h.start(2)
        assert await a.operations.assign(B0, BrokerId("broker-1")) == "broker-1"
        selected = await a.operations.assign(BUNDLES[1])
        await h.idle()
        assert h.owner(B0) == "broker-1"
        assert h.owner(BUNDLES[1]) == selected
        # Assigning an owned bundle again (to its owner, or anywhere) is a no-op.
        assert await a.operations.assign(B0) == "broker-1"
        assert await a.operations.assign(B0, BrokerId("broker-1")) == "broker-1"


async def test_bad_assign_requests_change_nothing() -> None:
    async with Harness() as h:
        a, _b = await h.start(2)
        await owned_by(h, B0, "broker-0")
        before = snapshot(h)
        with pytest.raises(NotFoundError, match="broker nobody is not registered"):
            await a.operations.assign(BUNDLES[1], BrokerId("nobody"))
        with pytest.raises(PreconditionError, match="owned by broker-0; transfer it"):
            await a.operations.assign(B0, BrokerId("broker-1"))
        with pytest.raises(NotFoundError, match="not a bundle of namespace public/default"):
            await a.operations.assign(BundleId("public/default/0x00000000_0x20000000"))
        with pytest.raises(NotFoundError, match="namespace public/nothing does not exist"):
            await a.operations.assign(BundleId("public/nothing/0x00000000_0x40000000"))
        with pytest.raises(InvalidInputError, match="invalid bundle id"):
            await a.operations.assign(BundleId("public/default/0-4"))
        assert snapshot(h) == before


# -- transfer and unload --------------------------------------------------------------------


async def test_transfer_moves_an_owned_bundle() -> None:
    async with Harness() as h:
        a, b = await h.start(2)
        await owned_by(h, B0, "broker-0")
        assert await h.admin_move(B0, b.me) == "broker-0"
        await h.idle()
        value = a.follower.get(B0)
        assert (value.state, value.dst_broker, value.source_broker) == (
            S.Owned,
            "broker-1",
            "broker-0",
        )
        assert a.served() == frozenset() and b.served() == {B0}


async def test_bad_transfer_requests_change_nothing() -> None:
    async with Harness() as h:
        a, b = await h.start(2)
        await owned_by(h, B0, "broker-0")
        # An in-flight bundle: Assigning to a broker that never finishes it.
        await a.proposer.propose(BUNDLES[2], S.Assigning, dst=BrokerId("ghost"))
        await h.idle()
        before = snapshot(h)
        with pytest.raises(PreconditionError, match="already owned by broker-0"):
            await h.admin_move(B0, a.me)
        with pytest.raises(NotFoundError, match="broker nobody is not registered"):
            await h.admin_move(B0, BrokerId("nobody"))
        with pytest.raises(NotFoundError, match="is not a bundle of namespace"):
            await h.admin_move(BundleId("public/default/0x00000000_0x00000010"), b.me)
        with pytest.raises(PreconditionError, match=r"is not owned \(Init\)"):
            await h.admin_move(BUNDLES[1], b.me)
        with pytest.raises(PreconditionError, match=r"in flight \(Assigning\)"):
            await h.admin_move(BUNDLES[2], b.me)
        with pytest.raises(PreconditionError, match=r"is not owned \(Init\)"):
            await h.admin_move(BUNDLES[1])
        with pytest.raises(PreconditionError, match=r"in flight \(Assigning\)"):
            await a.operations.assign(BUNDLES[2])
        assert snapshot(h) == before


async def test_unload_frees_and_the_next_lookup_assigns_again() -> None:
    async with Harness() as h:
        a, _b = await h.start(2)
        await owned_by(h, B0, "broker-0")
        assert await h.admin_move(B0) == "broker-0"
        await h.idle()
        assert a.follower.get(B0).state is S.Free
        assert a.served() == frozenset()
        topic = topics_in(B0, 1)[0]
        assert (await a.lookup.lookup(topic)).state is S.Owned


# -- split ----------------------------------------------------------------------------------


def topics_in(bundle: BundleId, count: int) -> list[str]:
    rng = parse_bundle_id(bundle).range
    found = []
    i = 0
    while len(found) < count:
        topic = f"persistent://public/default/s{i}"
        if topic_hash(topic) in rng:
            found.append(topic)
        i += 1
    return found


async def report_topics(h: Harness, broker: str, bundle: BundleId, topics: list[TopicLoad]) -> None:
    owner = h[broker]
    owner.broker.report(
        LoadReport(
            bundles=(BundleLoad(bundle, topics=len(topics)),), topics={bundle: tuple(topics)}
        )
    )
    for _ in range(10):  # let the link's reader run
        if owner.link.latest_report is not None:
            break
        await asyncio.sleep(0)
    assert owner.link.latest_report.topics_of(bundle) == tuple(topics)


async def test_split_range_equally_divide_gives_children_to_the_owner() -> None:
    async with Harness() as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        b = await h.add("b", auto_ack=False, fake_broker=True)
        await h.ready()
        await owned_by(h, B0, "a")
        outcome = await a.operations.split(B0, "range_equally_divide")
        await h.idle()
        assert outcome.parent == B0 and outcome.owner == "a"
        assert outcome.children == (
            "public/default/0x00000000_0x20000000",
            "public/default/0x20000000_0x40000000",
        )
        for child in outcome.children:
            assert h.owner(child) == "a"
        parent = b.follower.get(B0)
        assert (parent.state, parent.source_broker) == (S.Deleted, "a")
        layout = (await b.namespaces.refresh(DEFAULT_NAMESPACE)).boundaries
        assert layout == (0, 0x20000000, 0x40000000, 0x80000000, 0xC0000000, 0xFFFFFFFF)
        # The broker owned the children before it closed the parent.
        assert h.kinds(B0) == [("a", "own"), ("a", "close")]
        assert a.broker.serving == set(outcome.children)
        assert h.violations == []


async def test_no_split_starts_while_the_metadata_store_is_unreachable() -> None:
    async with Harness() as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        await h.add("b", auto_ack=False, fake_broker=True)
        await h.ready()
        await owned_by(h, B0, "a")
        h.metadata.set_reachable(False)
        await h.clock.run_for(h.timing.keepalive_interval_s + 0.1, step=0.5)
        assert not a.registry.reachable
        written = len(h.log)
        with pytest.raises(UnavailableError, match=r"safe mode.*split a bundle"):
            await a.operations.split(B0, "range_equally_divide")
        assert len(h.log) == written  # no Splitting was written
        assert a.follower.get(B0).state is S.Owned
        h.metadata.set_reachable(True)
        await h.clock.run_for(h.timing.keepalive_interval_s + 0.1, step=0.5)
        outcome = await a.operations.split(B0, "range_equally_divide")
        assert len(outcome.children) == 2


async def test_split_specified_positions_divide_cuts_at_the_given_boundaries() -> None:
    async with Harness() as h:
        (a,) = await h.start(1)
        await owned_by(h, B0, "broker-0")
        outcome = await a.operations.split(
            B0, "specified_positions_divide", [0x10000000, 0x30000000]
        )
        assert outcome.children == (
            "public/default/0x00000000_0x10000000",
            "public/default/0x10000000_0x30000000",
            "public/default/0x30000000_0x40000000",
        )
        await h.idle()
        assert len((await a.namespaces.refresh(DEFAULT_NAMESPACE)).bundles()) == 6


async def test_split_topic_count_equally_divide_uses_the_reported_topics() -> None:
    async with Harness() as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        await h.ready()
        await owned_by(h, B0, "a")
        topics = topics_in(B0, 6)
        await report_topics(h, "a", B0, [TopicLoad(t) for t in topics])
        outcome = await a.operations.split(B0, "topic_count_equally_divide")
        await h.idle()
        layout = await a.namespaces.refresh(DEFAULT_NAMESPACE)
        halves = [layout.bundles().find(t).id for t in topics]
        assert sorted(halves.count(c) for c in outcome.children) == [3, 3]


async def test_split_flow_or_qps_equally_divide_uses_the_reported_traffic() -> None:
    async with Harness() as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        await h.ready()
        await owned_by(h, B0, "a")
        limit = h.config.split.max_msg_rate
        loads = [TopicLoad(t, msg_rate=limit * 0.6) for t in topics_in(B0, 4)]
        await report_topics(h, "a", B0, loads)
        outcome = await a.operations.split(B0, "flow_or_qps_equally_divide")
        await h.idle()
        assert len(outcome.children) >= 2
        assert all(h.owner(c) == "a" for c in outcome.children)


async def test_bad_split_requests_change_nothing() -> None:
    async with Harness() as h:
        a, b = await h.start(2)
        await owned_by(h, B0, "broker-0")
        await a.namespaces.create(NamespaceName("t", "capped"), 2, NamespacePolicies(max_bundles=2))
        capped = BundleId("t/capped/0x00000000_0x80000000")
        await owned_by(h, capped, "broker-0")
        before = snapshot(h)
        with pytest.raises(InvalidInputError, match="unknown split algorithm 'halves'"):
            await a.operations.split(B0, "halves")
        with pytest.raises(InvalidInputError, match="not strictly inside"):
            await a.operations.split(B0, "specified_positions_divide", [0x50000000])
        with pytest.raises(InvalidInputError, match="needs at least one position"):
            await a.operations.split(B0, "specified_positions_divide", [])
        with pytest.raises(InvalidInputError, match="only for specified_positions_divide"):
            await a.operations.split(B0, "range_equally_divide", [0x10000000])
        with pytest.raises(InvalidInputError, match="needs at least 2 topics"):
            await a.operations.split(B0, "topic_count_equally_divide")
        with pytest.raises(PreconditionError, match="split it on that broker's sidecar"):
            await b.operations.split(B0, "range_equally_divide")
        with pytest.raises(PreconditionError, match=r"is not owned \(Init\)"):
            await a.operations.split(BUNDLES[1], "range_equally_divide")
        with pytest.raises(PreconditionError, match="above its max of 2"):
            await a.operations.split(capped, "range_equally_divide")
        assert snapshot(h) == before


# -- responses say what happened -----------------------------------------------------------------

QUICK_MONITOR = dataclasses.replace(
    QUIET, monitor=MonitorConfig(interval_s=1.0, inflight_timeout_s=5.0, orphan_cleanup_grace_s=5.0)
)
"""The leader's monitor sweeping every second, with short grace and in-flight timeouts."""


async def test_a_transfer_whose_destination_died_mid_move_says_so() -> None:
    async with Harness(config=QUICK_MONITOR) as h:
        a = await h.add("a")  # the leader: the first to campaign
        b = await h.add("b", auto_ack=False, fake_broker=True, ack_own=None)
        await h.add("c")
        await h.ready()
        await a.operations.assign(B0, a.me)
        await h.idle()
        transfer = asyncio.create_task((await h.leader()).tracker.admin_move(B0, b.me))
        await turns(lambda: (v := a.follower.get(B0)) is not None and v.state is S.Assigning)
        await b.close()  # b dies before it took the bundle
        await settle(h.clock, transfer.done, seconds=40)
        with pytest.raises(PreconditionError, match=f"transfer of {B0} to b did not complete"):
            await transfer
        assert h.owner(B0) in ("a", "c")


async def test_a_split_the_leader_rolled_back_says_so() -> None:
    async with Harness(config=QUICK_MONITOR) as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        await h.ready()
        await a.operations.assign(B0, a.me)
        await h.idle()
        a.broker.ack_own = False  # it will not take the children: the split gets stuck
        splitting = asyncio.create_task(a.operations.split(B0, "range_equally_divide"))
        await settle(h.clock, splitting.done, seconds=20)
        with pytest.raises(PreconditionError, match=f"split of {B0} did not complete"):
            await splitting
        assert h.owner(B0) == "a"
        assert a.metrics.split_total.labels(result="Failure", reason="Admin")._value.get() == 1


async def test_a_split_into_more_children_than_a_value_names_is_refused_before_publishing() -> None:
    # More children than a Splitting value may name: refused before anything is written, and
    # nothing changes (published, every follower would skip it as malformed).
    async with Harness() as h:
        (a,) = await h.start(1)
        ns = NamespaceName.parse("bench/wide")
        record = await a.namespaces.create(ns, 1, NamespacePolicies(max_bundles=20_000))
        (parent,) = (b.id for b in record.bundles().bundles())
        await owned_by(h, parent, "broker-0")
        before = snapshot(h)
        children = MAX_SPLIT_CHILDREN + 1
        step = 0xFFFFFFFF // children
        with pytest.raises(InvalidInputError, match=f"{children} children, at most"):
            await a.operations.split(
                parent, "specified_positions_divide", [step * i for i in range(1, children)]
            )
        await h.idle()
        assert snapshot(h) == before
        assert h.owner(parent) == "broker-0"
