"""OwnershipReactor with fake brokers: Own before Owned, Release before moving on, reconcile,
registration while attached."""

import asyncio
import dataclasses

from harness import DEFAULT_NAMESPACE, FakeBroker, Harness
from rig import QUIET, settle, turns

from lbd.core.bundles import NamespaceBundles, bundle_id, parse_bundle_id
from lbd.core.settings import MonitorConfig
from lbd.core.state import ServiceUnitState, state_of

BUNDLES = [b.id for b in NamespaceBundles.default(DEFAULT_NAMESPACE).bundles()]
B0 = BUNDLES[0]
S = ServiceUnitState


async def test_assigning_to_me_is_owned_only_after_the_broker_acked_own() -> None:
    async with Harness() as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        await h.ready()
        await a.proposer.propose(B0, S.Assigning, dst=a.me)
        await h.idle()
        assert h.kinds(B0) == [("a", "own")]
        value = a.follower.get(B0)
        assert (value.state, value.dst_broker, value.version_id) == (S.Owned, "a", 2)
        assert a.broker.serving == {B0} and a.served() == {B0}


async def test_a_broker_that_refuses_own_leaves_the_bundle_assigning() -> None:
    async with Harness() as h:
        a = await h.add("a", auto_ack=False, fake_broker=True, ack_own=False)
        await h.ready()
        await a.proposer.propose(B0, S.Assigning, dst=a.me)
        await h.idle()
        assert a.follower.get(B0).state is S.Assigning
        assert a.served() == frozenset()


async def test_an_unload_releases_then_frees() -> None:
    async with Harness() as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        await h.ready()
        await a.proposer.propose(B0, S.Assigning, dst=a.me)
        await h.idle()
        assert await h.admin_move(B0) == "a"
        await h.idle()
        assert h.kinds(B0) == [("a", "own"), ("a", "release")]
        value = a.follower.get(B0)
        assert (value.state, value.source_broker, value.dst_broker) == (S.Free, "a", None)
        assert a.broker.serving == set()
        assert a.reactor.release_timeouts == 0


async def test_an_unacknowledged_release_moves_on_after_the_timeout_and_is_counted() -> None:
    async with Harness() as h:
        a = await h.add("a", auto_ack=False, fake_broker=True, ack_release=None)
        b = await h.add("b", auto_ack=False, fake_broker=True)
        await h.ready()
        await a.proposer.propose(B0, S.Assigning, dst=a.me)
        await h.idle()
        transfer = asyncio.create_task((await h.leader()).tracker.admin_move(B0, b.me))
        await turns(lambda: a.follower.get(B0).state is S.Releasing)
        await h.clock.run_for(h.timing.ack_timeout_s - 1, step=0.5)
        assert a.follower.get(B0).state is S.Releasing  # still waiting for the ack
        await h.clock.run_for(1.5, step=0.5)
        # No ack: whatever a's broker did, it may still serve B0 until its serving lease, no
        # longer renewed, has surely run out.
        await h.clock.run_for(h.timing.serving_lease_s - 1, step=0.5)
        assert a.follower.get(B0).state is S.Releasing
        await h.clock.run_for(h.timing.lease_margin_s + 2, step=0.5)
        async with asyncio.timeout(2):
            assert await transfer == "a"
        assert a.reactor.release_timeouts == 1
        assert h.owner(B0) == "b"
        kinds = [(e.broker, e.kind) for e in h.events if e.kind == "lapse" or e.bundle == B0]
        assert kinds.index(("a", "lapse")) < kinds.index(("b", "own"))
        assert h.violations == []


async def test_the_broker_serves_exactly_what_the_table_says_after_reattaching() -> None:
    async with Harness() as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        await h.ready()
        for bundle in BUNDLES[:2]:
            await a.proposer.propose(bundle, S.Assigning, dst=a.me)
        await h.idle()
        await a.broker.disconnect()
        a.broker.serving.clear()  # the broker restarted
        h.events.clear()
        await a.broker.connect(a.link)
        await h.idle()
        assert sorted((e.kind, e.bundle) for e in h.events) == [("own", b) for b in BUNDLES[:2]]
        assert a.broker.serving == set(BUNDLES[:2])


async def test_no_value_takes_a_served_bundle_away_but_a_release() -> None:
    async with Harness() as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        await h.ready()
        await a.proposer.propose(B0, S.Assigning, dst=a.me)
        await h.idle()
        owned = a.follower.get(B0)
        # Neither a forced Free nor a tombstone may leave a served bundle with no server: the
        # table would call it free while a still serves it.
        await a.proposer.propose(B0, S.Free, src=a.me, force=True, leader_term=1)
        await a.proposer.tombstone(B0)
        await h.idle()
        assert a.follower.get(B0) == owned
        assert a.broker.serving == {B0}
        # A release is the way: a is told, acknowledges, and the bundle is Free.
        await a.proposer.propose(B0, S.Releasing, src=a.me)
        await h.idle()
        assert h.kinds(B0) == [("a", "own"), ("a", "release")]
        assert a.broker.serving == set() and a.follower.get(B0).state is S.Free


async def test_the_broker_is_registered_only_while_attached() -> None:
    async with Harness() as h:
        watcher = await h.add("watcher")
        a = await h.add("a", auto_ack=False)
        await h.ready()
        assert a.me not in watcher.registry.brokers()
        a.broker = FakeBroker(a.info, h)
        await a.broker.connect(a.link)
        await h.ready()
        info = watcher.registry.get(a.me)
        assert info is not None and info.sidecar_grpc_addr == "a:7000"
        assert info.service_url == a.info.service_url
        changes = watcher.registry.changes()
        await a.broker.disconnect()
        async with asyncio.timeout(2):
            async for event in changes:
                if event.broker == a.me and event.value is None:
                    break
        assert a.me not in watcher.registry.brokers()
        assert watcher.registry.absent_since(a.me) == h.clock.monotonic()


async def test_auto_ack_registers_at_start_and_serves_on_its_own() -> None:
    async with Harness() as h:
        a = await h.add("a")
        await h.ready()
        assert a.registry.get(a.me).sidecar_grpc_addr == "a:7000"
        await a.proposer.propose(B0, S.Assigning, dst=a.me)
        await h.idle()
        assert a.follower.get(B0).state is S.Owned
        assert a.served() == {B0}


async def test_a_transfer_releases_on_the_source_before_the_destination_owns() -> None:
    async with Harness() as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        b = await h.add("b", auto_ack=False, fake_broker=True)
        await h.ready()
        await a.proposer.propose(B0, S.Assigning, dst=a.me)
        await h.idle()
        assert await h.admin_move(B0, b.me) == "a"
        await h.idle()
        assert h.kinds(B0) == [("a", "own"), ("a", "release"), ("b", "own")]
        release = next(e for e in h.events if e.kind == "release")
        assert release.detail == "b"  # the new owner travels with the Release
        value = b.follower.get(B0)
        assert (value.state, value.dst_broker, value.source_broker) == (S.Owned, "b", "a")
        assert h.violations == []


async def test_a_silent_broker_is_deregistered_and_its_bundles_move_after_its_lease() -> None:
    monitor = MonitorConfig(interval_s=1.0, orphan_cleanup_grace_s=5.0)
    async with Harness(config=dataclasses.replace(QUIET, monitor=monitor)) as h:
        a = await h.add("a")  # the leader
        b = await h.add("b", auto_ack=False, fake_broker=True)
        await h.ready()
        await a.operations.assign(B0, b.me)
        await h.idle()
        b.broker.paused = True  # as in a long GC pause: its stream stays open
        await settle(h.clock, lambda: a.registry.get(b.me) is None, seconds=20)
        assert not b.broker.may_serve()  # its lease ran out long before
        await settle(h.clock, lambda: h.owner(B0) == a.me, seconds=20)
        assert h.violations == []
        b.broker.paused = False
        await settle(h.clock, lambda: a.registry.get(b.me) is not None, seconds=10)


async def test_a_silent_broker_is_deregistered_the_moment_its_silence_reaches_the_timeout() -> None:
    async with Harness() as h:
        a = await h.add("a")
        b = await h.add("b", auto_ack=False, fake_broker=True)
        await h.ready()
        await h.clock.run_for(1.4)  # out of step with the watch's first wake, whenever it is
        b.broker.paused = True
        heard = b.link.last_heard
        assert heard is not None
        await settle(h.clock, lambda: a.registry.get(b.me) is None, seconds=20, step=0.05)
        # The watch wakes when the silence would reach the timeout, not up to a quarter later.
        timeout_s = h.timing.silence_timeout_s
        assert heard + timeout_s <= h.clock.monotonic() <= heard + timeout_s + 0.2


async def test_a_child_moved_away_during_a_split_takes_its_parent_off_the_broker() -> None:
    """A split waits for the namespace layout (its sidecar is cut off etcd) while the leader
    hands one child to another broker: the splitting broker stops serving the parent, whose range
    covers that child, before it releases the child, and never takes the child back when the
    split is retried."""
    parent = parse_bundle_id(B0)
    middle = (parent.range.lo + parent.range.hi) // 2
    lo = bundle_id(parent.namespace, parent.range.lo, middle)
    hi = bundle_id(parent.namespace, middle, parent.range.hi)
    async with Harness() as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        b = await h.add("b", auto_ack=False, fake_broker=True)
        await h.ready()
        await a.proposer.propose(B0, S.Assigning, dst=a.me)
        await h.idle()
        a.metadata.set_cut_off(True)  # the layout cannot be cut: the split waits
        await a.proposer.propose(B0, S.Splitting, src=a.me, split_children={lo: a.me, hi: a.me})
        await turns(lambda: a.served() >= {lo, hi})
        assert B0 in a.broker.serving and a.follower.get(B0).state is S.Splitting
        # The leader's announcement, then the hand-over.
        await b.proposer.propose(lo, S.Releasing, src=a.me, dst=b.me, force=True, leader_term=1)
        await turns(lambda: lo in b.broker.serving)
        events = [(e.broker, e.kind, e.bundle) for e in h.events]
        assert events.index(("a", "close", B0)) < events.index(("a", "release", lo))
        assert B0 not in a.broker.serving and lo not in a.broker.serving
        assert h.violations == []
        a.metadata.set_cut_off(False)  # the split finishes without taking the child back
        await settle(h.clock, lambda: state_of(a.follower.get(B0)) is S.Deleted)
        await h.idle()
        assert h.kinds(lo) == [("a", "own"), ("a", "release"), ("b", "own")]
        assert a.broker.serving == {hi} and b.broker.serving == {lo}
