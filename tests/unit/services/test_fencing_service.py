"""Self-fencing: a sidecar that can no longer vouch for its broker closes its bundles in time,
and one that still can (etcd down for everyone, or for it alone) keeps serving until a move it
reads on the channel."""

import asyncio
import dataclasses

import pytest
from harness import DEFAULT_NAMESPACE, Harness, Sidecar, Timing
from rig import QUIET, settle, turns

from lbd.core.broker_info import CommandAck
from lbd.core.bundles import NamespaceBundles
from lbd.core.settings import MonitorConfig, SidecarTimings
from lbd.core.state import ServiceUnitState
from lbd.ports.errors import UnavailableError

LAYOUT = NamespaceBundles.default(DEFAULT_NAMESPACE)
BUNDLES = [b.id for b in LAYOUT.bundles()]
TIMING = Timing(lease_ttl_s=15, keepalive_interval_s=2.0, fence_after_s=8.0)
DEFAULTS = SidecarTimings()
SECONDS = Timing(
    lease_ttl_s=3,  # etcd.lease_ttl_s
    keepalive_interval_s=0.5,
    fence_after_s=DEFAULTS.fence_after_s,
    channel_fence_after_s=DEFAULTS.channel_fence_after_s,
    fence_check_interval_s=DEFAULTS.fence_check_interval_s,
    serving_lease_s=DEFAULTS.serving_lease_s,
    silence_timeout_s=DEFAULTS.silence_timeout_s,
)
"""The default timings (failover in seconds), with a renewal every half second: while etcd
answers, the lease ground always holds with room to spare."""


def topic_in(bundle: str) -> str:
    return next(
        t
        for t in (f"persistent://public/default/f{i}" for i in range(1000))
        if LAYOUT.find(t).id == bundle
    )


async def test_a_sidecar_cut_off_from_etcd_and_the_channel_closes_every_bundle() -> None:
    async with Harness(timing=TIMING) as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        b = await h.add("b", auto_ack=False, fake_broker=True)
        await h.ready()
        for bundle in BUNDLES[:3]:
            await a.operations.assign(bundle, a.me)
        await h.idle()
        assert a.broker.serving == set(BUNDLES[:3])
        renewed = a.metadata.last_renewed_monotonic
        cut = h.clock.monotonic()
        h.metadata.set_reachable(False)
        h.log.go_down()
        # Not yet: the lease was renewed less than fence_after_s ago.
        await h.clock.run_for(renewed + TIMING.fence_after_s - h.clock.monotonic() - 0.5, step=0.5)
        assert not a.fence.fenced
        assert [e for e in h.events if e.kind == "close"] == []
        # Fenced once neither the lease nor a read barrier is younger than fence_after_s.
        await h.clock.run_for(
            cut + TIMING.fence_after_s + TIMING.fence_check_interval_s - h.clock.monotonic() + 0.5,
            step=0.5,
        )
        assert a.fence.fenced and a.fence.fencings == 1
        await h.idle()
        closed = sorted(e.bundle for e in h.events if e.kind == "close" and e.broker == "a")
        assert closed == sorted(BUNDLES[:3])
        assert a.broker.serving == set()
        # Every close came before the lease could have expired.
        assert h.clock.monotonic() < renewed + TIMING.lease_ttl_s
        # The table still says a owns them; a's sidecar never answers itself now.
        with pytest.raises(UnavailableError, match="fenced"):
            await a.lookup.lookup(topic_in(BUNDLES[0]))
        # Nor from memory, now that the topic's bundle is located.
        with pytest.raises(UnavailableError, match="fenced"):
            a.lookup.answer_now(topic_in(BUNDLES[0]))
        assert b.broker.serving == set()


async def test_a_fenced_sidecar_reowns_what_is_still_its_own_after_renewing() -> None:
    async with Harness(timing=TIMING) as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        await h.add("b", auto_ack=False, fake_broker=True)
        await h.ready()
        for bundle in BUNDLES[:2]:
            await a.operations.assign(bundle, a.me)
        await h.idle()
        h.metadata.set_reachable(False)
        h.log.go_down()
        await h.clock.run_for(TIMING.fence_after_s + 2, step=0.5)
        assert a.fence.fenced
        h.log.come_back()
        await h.idle()
        # While fenced nothing is owned again, even a bundle the table hands it.
        await a.proposer.propose(BUNDLES[2], ServiceUnitState.Assigning, dst=a.me)
        await h.idle()
        assert a.broker.serving == set()
        h.metadata.set_reachable(True)
        await h.clock.run_for(TIMING.keepalive_interval_s + TIMING.fence_check_interval_s, step=0.5)
        assert not a.fence.fenced
        # The broker's serving lease was not renewed while its sidecar could not vouch: once it
        # ran out the broker dropped everything, and the sidecar, told so by the next lease
        # request, owns it all again.
        await h.clock.run_for(TIMING.serving_lease_s + 1, step=0.5)
        await h.idle()
        assert a.broker.serving == set(BUNDLES[:3])
        assert h.owner(BUNDLES[2]) == "a"
        result = await a.lookup.lookup(topic_in(BUNDLES[0]))
        assert result.owner_id == "a"
        assert h.violations == []


async def test_an_ack_arriving_after_fencing_is_undone() -> None:
    async with Harness(timing=TIMING) as h:
        a = await h.add("a", auto_ack=False, fake_broker=True, ack_own=None)
        await h.ready()
        owning = asyncio.create_task(a.link.own(BUNDLES[0]))
        await turns(lambda: ("own", BUNDLES[0]) in [(e.kind, e.bundle) for e in h.events])
        await a.link.fence("test")
        a.broker.ack_own = True
        # The broker answers the earlier Own late (it had taken the bundle): it is closed again.
        a.broker.report_ack(CommandAck(1))
        async with asyncio.timeout(2):
            assert await owning is False
        assert [(e.kind, e.bundle) for e in h.events][-1] == ("close", BUNDLES[0])
        assert a.served() == frozenset()


async def test_barriers_come_every_half_channel_window_while_the_lease_is_sound() -> None:
    async with Harness(timing=SECONDS) as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        await h.ready()
        await a.operations.assign(BUNDLES[0], a.me)
        await h.idle()
        begun = a.follower.barriers_begun
        await h.clock.run_for(6.0, step=0.05)
        # Every 0.75 s (half of channel_fence_after_s): 8 in 6 s, not 24 (one per check).
        assert 7 <= a.follower.barriers_begun - begun <= 9
        # etcd goes: once the lease could lapse within a channel window and a half, a barrier
        # comes every check interval, and the channel ground takes over with no gap at all.
        h.metadata.set_reachable(False)
        begun = a.follower.barriers_begun
        for _ in range(200):  # ten seconds, looked at every 50 ms
            await h.clock.run_for(0.05, step=0.05)
            assert a.fence.vouches() and not a.fence.fenced
        assert a.follower.barriers_begun - begun >= 25  # about one per 0.3 s (50 ms steps)
        assert a.broker.serving == {BUNDLES[0]} and a.broker.may_serve()
        assert h.violations == []


LEADING = dataclasses.replace(
    QUIET,
    monitor=MonitorConfig(interval_s=1.0, inflight_timeout_s=30.0, orphan_cleanup_grace_s=5.0),
)
"""Sidecars whose leader sweeps for orphans every second, with a short grace."""


async def _two_brokers(h: Harness) -> tuple[Sidecar, Sidecar]:
    a = await h.add("a", auto_ack=False, fake_broker=True)
    b = await h.add("b", auto_ack=False, fake_broker=True)
    await h.ready()
    for bundle in BUNDLES[:2]:
        await a.operations.assign(bundle, a.me)
    for bundle in BUNDLES[2:]:
        await b.operations.assign(bundle, b.me)
    await h.idle()
    assert a.broker.serving == set(BUNDLES[:2]) and b.broker.serving == set(BUNDLES[2:])
    return a, b


async def test_a_cluster_wide_etcd_outage_closes_and_moves_nothing() -> None:
    async with Harness(timing=TIMING, config=LEADING) as h:
        a, b = await _two_brokers(h)
        h.metadata.set_reachable(False)
        # A minute without etcd: every lease expires meanwhile, yet nobody can move anything,
        # and every sidecar still reads the channel through, so both brokers keep serving.
        for _ in range(120):
            await h.clock.run_for(0.5, step=0.5)
            assert a.broker.may_serve() and b.broker.may_serve()
        assert not a.fence.fenced and not b.fence.fenced
        # etcd is back with every lease gone (as a paused etcd revokes them on resume): the
        # sidecars register again within the grace, and the leader moves nothing.
        h.metadata.set_reachable(True)
        await h.clock.run_for(TIMING.lease_ttl_s + LEADING.monitor.orphan_cleanup_grace_s * 3)
        await h.idle()
        assert a.broker.serving == set(BUNDLES[:2]) and b.broker.serving == set(BUNDLES[2:])
        assert [e for e in h.events if e.kind in ("close", "release")] == []
        assert {h.owner(bundle) for bundle in BUNDLES[:2]} == {a.me}
        assert a.broker.may_serve() and b.broker.may_serve()
        assert h.violations == []


async def test_a_sidecar_cut_off_from_etcd_alone_hands_its_bundles_over_with_no_overlap() -> None:
    async with Harness(timing=TIMING, config=LEADING) as h:
        a, b = await _two_brokers(h)
        a.metadata.set_cut_off(True)  # b still reaches etcd: a's lease expires, b leads
        await settle(
            h.clock,
            lambda: all(h.owner(bundle) == b.me for bundle in BUNDLES),
            seconds=TIMING.lease_ttl_s + 5 + TIMING.timings().handover_wait_s + 30,
        )
        await h.idle()
        assert b.broker.serving == set(BUNDLES)
        assert a.broker.serving == set()
        # a still read the channel: it released each bundle itself before b was told to own it.
        released = sorted(e.bundle for e in h.events if e.kind == "release" and e.broker == "a")
        assert released == sorted(BUNDLES[:2])
        assert h.violations == []


async def test_no_lease_is_granted_while_the_broker_serves_what_the_table_gives_another() -> None:
    async with Harness(timing=TIMING) as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        b = await h.add("b", auto_ack=False, fake_broker=True)
        await h.ready()
        await a.operations.assign(BUNDLES[0], a.me)
        await h.idle()
        assert a.fence.vouches()
        await a.operations.assign(BUNDLES[1], b.me)
        await h.idle()
        # An Own sent on a stale table (a sidecar resumed mid-way through a step): the broker
        # holds a bundle the channel gives to b.
        assert await a.link.own(BUNDLES[1])
        assert BUNDLES[1] in a.served() and a.follower.get(BUNDLES[1]).dst_broker == "b"
        assert not a.fence.vouches() and not a.fence.fenced
        await a.reactor.reconcile()  # closes it: the lease is granted again
        await h.idle()
        assert BUNDLES[1] not in a.broker.serving and ("a", "close") in h.kinds(BUNDLES[1])
        assert a.fence.vouches()


async def test_no_lease_is_granted_while_an_announced_bundle_waits_behind_its_own() -> None:
    # The leader's hand-over wait does not wait for an Own of the bundle to be answered: a
    # sidecar that read the announcement grants nothing until the Release (or a Close) is sent.
    bundle = BUNDLES[0]
    async with Harness(timing=TIMING) as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        b = await h.add("b", auto_ack=False, fake_broker=True)
        await h.ready()
        a.broker.ack_own = None  # it gets the Own and does not answer (yet)
        await a.proposer.propose(bundle, ServiceUnitState.Assigning, dst=a.me)
        await turns(lambda: ("a", "own") in h.kinds(bundle))
        assert bundle in a.link.possibly_served() and bundle not in a.served()
        assert a.fence.vouches()
        await b.proposer.propose(
            bundle, ServiceUnitState.Releasing, src=a.me, dst=b.me, force=True, leader_term=1
        )
        await turns(lambda: a.follower.get(bundle).state is ServiceUnitState.Releasing)
        assert not a.fence.vouches() and not a.fence.fenced
        # The Own times out; the Close that follows it ends the wait.
        await settle(h.clock, lambda: bundle not in a.link.possibly_served())
        assert a.fence.vouches()
        assert bundle not in a.broker.serving


async def test_a_channel_outage_starts_a_new_run_of_readable_time_when_it_ends() -> None:
    # What the leader's monitor waits on before it calls a value stuck in flight: the channel
    # read through without a break for the whole timeout.
    async with Harness(timing=TIMING) as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        await h.ready()
        started = a.fence.readable_since
        assert started is not None and started <= h.clock.monotonic()
        await h.clock.run_for(3 * TIMING.fence_check_interval_s, step=0.25)
        assert a.fence.readable_since == started  # barriers kept completing
        h.log.go_down()
        await h.clock.run_for(TIMING.fence_after_s + 2, step=0.5)
        assert a.fence.readable_since == started  # nothing completed yet
        h.log.come_back()
        back = h.clock.monotonic()
        await settle(h.clock, lambda: a.fence.readable_since != started)
        assert back <= a.fence.readable_since <= h.clock.monotonic()
