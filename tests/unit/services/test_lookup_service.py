"""LookupService on in-process sidecars: answers, assignment, sharing, splits, safe mode."""

import asyncio
import collections

import pytest
from harness import DEFAULT_NAMESPACE, Harness
from rig import let_run, turns

from lbd.core.bundles import NamespaceBundles, bundle_id, parse_bundle_id
from lbd.core.errors import DeadlineError, InvalidInputError, NotFoundError
from lbd.core.ids import BrokerId
from lbd.core.load import BrokerUsage, ResourceUsage
from lbd.core.names import NamespaceName
from lbd.core.namespace import IsolationPolicy, NamespacePolicies
from lbd.core.state import ServiceUnitState
from lbd.ports.errors import UnavailableError

TOPIC = "persistent://public/default/orders"


def bundle_of(topic: str):
    return NamespaceBundles.default(DEFAULT_NAMESPACE).find(topic).id


async def test_a_new_topic_is_assigned_then_answered_from_the_table() -> None:
    async with Harness() as h:
        a, _ = await h.start(2)
        first = await a.lookup.lookup(TOPIC)
        await h.idle()
        assert first.state is ServiceUnitState.Owned
        assert first.bundle == bundle_of(TOPIC)
        assert first.owner_id in {"broker-0", "broker-1"}
        assert first.owner is not None and first.owner.service_url.startswith("pulsar://")
        assert first.owner.sidecar_grpc_addr == f"{first.owner_id}:7000"
        messages = len(h.log)
        again = await h["broker-1"].lookup.lookup(TOPIC)
        assert again == first
        assert len(h.log) == messages  # answered from the table: nothing written


async def test_an_answer_from_memory_only_for_a_located_topic_of_an_owned_bundle() -> None:
    async with Harness() as h:
        a, b = await h.start(2)
        assert a.lookup.answer_now(TOPIC) is None  # never located
        first = await a.lookup.lookup(TOPIC)
        await h.idle()
        assert a.lookup.answer_now(TOPIC) == first
        # Located, but not Owned: Init, then in flight, then Owned.
        other = next(
            f"persistent://public/default/o{i}"
            for i in range(100)
            if bundle_of(f"persistent://public/default/o{i}") != first.bundle
        )
        assert (await b.lookup.lookup(other, read_only=True)).state is ServiceUnitState.Init
        assert b.lookup.answer_now(other) is None
        ghost = BrokerId("ghost")
        await a.proposer.propose(bundle_of(other), ServiceUnitState.Assigning, dst=ghost)
        await h.idle()
        assert b.lookup.answer_now(other) is None
        await a.proposer.propose(bundle_of(other), ServiceUnitState.Owned, dst=ghost)
        await h.idle()
        answer = b.lookup.answer_now(other)
        assert answer is not None and (answer.owner_id, answer.owner) == (ghost, None)
        moved = await b.lookup.lookup(TOPIC)
        # A split replaces the layout: the topic is located again by a lookup.
        outcome = await h[moved.owner_id].operations.split(first.bundle, "range_equally_divide")
        await h.idle()
        await b.namespaces.refresh(DEFAULT_NAMESPACE)
        assert b.lookup.answer_now(TOPIC) is None
        after = await b.lookup.lookup(TOPIC)
        assert after.bundle in outcome.children
        assert b.lookup.answer_now(TOPIC) == after


async def test_concurrent_lookups_on_one_sidecar_share_one_proposal() -> None:
    async with Harness() as h:
        a, _b = await h.start(2)
        results = await asyncio.gather(*(a.lookup.lookup(TOPIC) for _ in range(50)))
        assert len({r.owner_id for r in results}) == 1
        assert a.assigner.proposals == 1
        assert a.lookup._shared == {}


async def test_100_concurrent_lookups_over_three_sidecars_agree_on_one_owner() -> None:
    async with Harness() as h:
        sidecars = await h.start(3)
        results = await asyncio.gather(*(sidecars[i % 3].lookup.lookup(TOPIC) for i in range(100)))
        await h.idle()
        owners = {r.owner_id for r in results}
        assert len(owners) == 1
        (owner,) = owners
        assert h.owner(bundle_of(TOPIC)) == owner
        # At most one proposal per sidecar, and every sidecar's table agrees.
        assert all(s.assigner.proposals <= 1 for s in sidecars)
        assert {s.follower.get(bundle_of(TOPIC)).dst_broker for s in sidecars} == {owner}
        assert h[owner].served() == {bundle_of(TOPIC)}


async def test_1000_topics_spread_over_every_broker() -> None:
    async with Harness(default_bundles=64) as h:
        sidecars = await h.start(4)
        topics = [f"persistent://public/default/t-{i}" for i in range(1000)]
        results = await asyncio.gather(
            *(sidecars[i % 4].lookup.lookup(t) for i, t in enumerate(topics))
        )
        await h.idle()
        per_broker = collections.Counter(r.owner_id for r in results)
        assert set(per_broker) == {s.me for s in sidecars}
        owned = collections.Counter(h.owner(b) for b in {r.bundle for r in results})
        assert all(count >= 4 for count in owned.values()), owned
        assert all(r.owner_id == h.owner(r.bundle) for r in results)


async def test_the_least_loaded_broker_is_preferred() -> None:
    async with Harness() as h:
        a, b, c = await h.start(3)
        busy = BrokerUsage(cpu=ResourceUsage(90, 100))
        idle = BrokerUsage(cpu=ResourceUsage(5, 100))
        await a.publish_load(busy, h.clock.now_ms())
        await b.publish_load(busy, h.clock.now_ms())
        await c.publish_load(idle, h.clock.now_ms())
        results = [await a.lookup.lookup(f"persistent://public/default/x-{i}") for i in range(8)]
        assert {r.owner_id for r in results} == {c.me}


async def test_namespace_isolation_policy_is_honoured() -> None:
    async with Harness() as h:
        a, _b, _c = await h.start(3)
        ns = NamespaceName("tenant", "isolated")
        await a.namespaces.create(
            ns, 4, NamespacePolicies(isolation=IsolationPolicy(("broker-2",)))
        )
        results = [await a.lookup.lookup(f"persistent://tenant/isolated/t{i}") for i in range(6)]
        assert {r.owner_id for r in results} == {"broker-2"}


async def test_malformed_topics_and_unknown_namespaces_are_rejected() -> None:
    async with Harness() as h:
        (a,) = await h.start(1)
        with pytest.raises(InvalidInputError, match="missing '://'"):
            await a.lookup.lookup("public/default/t")
        with pytest.raises(InvalidInputError, match="unknown domain"):
            await a.lookup.lookup("kafka://public/default/t")
        with pytest.raises(NotFoundError, match="namespace nobody/here does not exist"):
            await a.lookup.lookup("persistent://nobody/here/t")
        assert len(h.log) == 0


async def test_read_only_lookups_never_assign() -> None:
    async with Harness() as h:
        (a,) = await h.start(1)
        result = await a.lookup.lookup(TOPIC, read_only=True)
        assert (result.state, result.owner_id) == (ServiceUnitState.Init, None)
        assert len(h.log) == 0


async def test_an_in_flight_bundle_is_waited_for_until_owned() -> None:
    async with Harness() as h:
        a, b = await h.start(2)
        bundle = bundle_of(TOPIC)
        # An Assigning value nobody will finish (a broker that never registered).
        await a.proposer.propose(bundle, ServiceUnitState.Assigning, dst=BrokerId("ghost"))
        await h.idle()
        waiting = asyncio.create_task(b.lookup.lookup(TOPIC))
        await let_run()
        assert not waiting.done()
        await a.proposer.propose(bundle, ServiceUnitState.Owned, dst=BrokerId("ghost"))
        async with asyncio.timeout(2):
            result = await waiting
        assert (result.state, result.owner_id, result.owner) == (
            ServiceUnitState.Owned,
            "ghost",
            None,
        )


async def test_a_lookup_that_does_not_settle_in_time_raises_deadline_error() -> None:
    async with Harness() as h:
        a, _ = await h.start(2)
        bundle = bundle_of(TOPIC)
        await a.proposer.propose(bundle, ServiceUnitState.Assigning, dst=BrokerId("ghost"))
        await h.idle()
        waiting = asyncio.create_task(a.lookup.lookup(TOPIC))
        await let_run()
        assert not waiting.done()
        await h.clock.run_for(h.timing.settle_timeout_s + 1, step=1.0)
        with pytest.raises(DeadlineError, match=f"bundle {bundle} did not settle"):
            async with asyncio.timeout(2):
                await waiting


async def test_a_split_bundle_is_found_through_the_refreshed_layout() -> None:
    async with Harness() as h:
        a, b = await h.start(2)
        first = await a.lookup.lookup(TOPIC)
        await h.idle()
        # b caches the layout before the split.
        assert (await b.lookup.lookup(TOPIC)).bundle == first.bundle
        owner = h[first.owner_id]
        outcome = await owner.operations.split(first.bundle, "range_equally_divide")
        await h.idle()
        after = await b.lookup.lookup(TOPIC)
        assert after.bundle in outcome.children
        assert after.owner_id == first.owner_id
        assert (
            b.namespaces.cached(DEFAULT_NAMESPACE).boundaries
            == (await b.namespaces.refresh(DEFAULT_NAMESPACE)).boundaries
        )


async def test_a_splitting_bundle_is_answered_with_its_source_at_once() -> None:
    async with Harness() as h:
        a, b = await h.start(2)
        first = await a.lookup.lookup(TOPIC)
        await h.idle()
        source = first.owner_id
        assert source is not None
        parent = parse_bundle_id(first.bundle)
        middle = (parent.range.lo + parent.range.hi) // 2
        children = (
            bundle_id(parent.namespace, parent.range.lo, middle),
            bundle_id(parent.namespace, middle, parent.range.hi),
        )
        # A split its source cannot finish (say the metadata store is unreachable): the bundle
        # stays Splitting until the leader rolls it back, and its source serves it meanwhile.
        h[source].metadata.set_cut_off(True)
        await h[source].proposer.propose(
            first.bundle,
            ServiceUnitState.Splitting,
            src=source,
            split_children=dict.fromkeys(children, source),
        )
        splitting = ServiceUnitState.Splitting
        await turns(lambda: all(s.follower.get(first.bundle).state is splitting for s in (a, b)))
        for sidecar in (a, b):
            async with asyncio.timeout(0.5):
                result = await sidecar.lookup.lookup(TOPIC)
            assert (result.bundle, result.state, result.owner_id) == (
                first.bundle,
                ServiceUnitState.Splitting,
                source,
            )
            assert result.owner is not None and result.owner.broker_id == source


async def test_safe_mode_answers_owned_bundles_but_assigns_nothing() -> None:
    async with Harness() as h:
        a, _ = await h.start(2)
        owned = await a.lookup.lookup(TOPIC)
        await h.idle()
        h.metadata.set_reachable(False)
        # The next keepalive fails: the session reports UNREACHABLE.
        await h.clock.run_for(h.timing.keepalive_interval_s + 0.1, step=0.5)
        assert not a.registry.reachable
        assert await a.lookup.lookup(TOPIC) == owned
        other = next(
            f"persistent://public/default/o{i}"
            for i in range(100)
            if bundle_of(f"persistent://public/default/o{i}") != owned.bundle
        )
        with pytest.raises(UnavailableError, match="safe mode"):
            await a.lookup.lookup(other)
        h.metadata.set_reachable(True)
        await h.clock.run_for(h.timing.keepalive_interval_s + 0.1, step=0.5)
        assert a.registry.reachable
        assert (await a.lookup.lookup(other)).state is ServiceUnitState.Owned


async def test_while_the_channel_takes_no_writes_new_assignments_fail_fast_and_owned_answer() -> (
    None
):
    async with Harness() as h:
        a, _ = await h.start(2)
        owned = await a.lookup.lookup(TOPIC)
        await h.idle()
        h.log.hang_publishes(True)  # Pulsar down: a producer's send just waits
        other = next(
            t
            for t in (f"persistent://public/default/t{i}" for i in range(100))
            if bundle_of(t) != owned.bundle
        )
        waiting = asyncio.create_task(a.lookup.lookup(other))
        await let_run()
        await h.clock.run_for(h.config.timings.publish_timeout_s + 0.5, step=0.5)
        with pytest.raises(UnavailableError, match="not taking writes"):
            async with asyncio.timeout(2):
                await waiting
        again = await a.lookup.lookup(TOPIC)
        assert (again.bundle, again.owner_id) == (owned.bundle, owned.owner_id)
        h.log.hang_publishes(False)


async def test_move_destinations_follow_isolation() -> None:
    async with Harness() as h:
        a, _b, _c = await h.start(3)
        isolated = NamespaceName("tenant", "isolated")
        await a.namespaces.create(
            isolated, 2, NamespacePolicies(isolation=IsolationPolicy(("broker-1", "broker-2")))
        )
        iso = NamespaceBundles.default(isolated, 2).bundles()[0].id
        free = bundle_of(TOPIC)
        allowed = (await a.assigner.move_rules()).destinations([iso, free])
        assert allowed == {
            iso: {"broker-1", "broker-2"},
            # The isolated namespace's primaries are reserved for it.
            free: {"broker-0"},
        }


async def test_move_destinations_follow_anti_affinity() -> None:
    async with Harness() as h:
        a, _b, _c = await h.start(3)
        spread = [NamespaceName("tenant", f"spread-{i}") for i in range(2)]
        for ns in spread:
            await a.namespaces.create(ns, 1, NamespacePolicies(anti_affinity_group="g"))
        first = (await a.lookup.lookup("persistent://tenant/spread-0/t")).bundle
        second = (await a.lookup.lookup("persistent://tenant/spread-1/t")).bundle
        await h.idle()
        assert h.owner(first) != h.owner(second)
        allowed = (await a.assigner.move_rules()).destinations([first, second, bundle_of(TOPIC)])
        # Neither may join the other namespace of its group; an unbound bundle is not listed.
        everyone = {"broker-0", "broker-1", "broker-2"}
        assert allowed == {
            first: everyone - {h.owner(second)},
            second: everyone - {h.owner(first)},
        }
