"""Self-fencing: a sidecar whose lease renewals fail closes its broker's bundles in time."""

import asyncio

import pytest
from harness import DEFAULT_NAMESPACE, Harness, Timing
from rig import turns

from lbd.core.broker import CommandAck
from lbd.core.bundles import NamespaceBundles
from lbd.core.state import ServiceUnitState
from lbd.ports.errors import UnavailableError

LAYOUT = NamespaceBundles.default(DEFAULT_NAMESPACE)
BUNDLES = [b.id for b in LAYOUT.bundles()]
TIMING = Timing(lease_ttl_s=15, keepalive_interval_s=2.0, fence_after_s=8.0)


def topic_in(bundle: str) -> str:
    return next(
        t
        for t in (f"persistent://public/default/f{i}" for i in range(1000))
        if LAYOUT.find(t).id == bundle
    )


async def test_renewals_failing_for_fence_after_s_close_every_bundle() -> None:
    async with Harness(timing=TIMING) as h:
        a = await h.add("a", auto_ack=False, fake_broker=True)
        b = await h.add("b", auto_ack=False, fake_broker=True)
        await h.ready()
        for bundle in BUNDLES[:3]:
            await a.operations.assign(bundle, a.me)
        await h.idle()
        assert a.broker.serving == set(BUNDLES[:3])
        renewed = a.metadata.last_renewed_monotonic
        h.metadata.set_reachable(False)
        # Not yet: the lease was renewed less than fence_after_s ago.
        await h.clock.run_for(renewed + TIMING.fence_after_s - h.clock.monotonic() - 0.5, step=0.5)
        assert not a.fence.fenced
        assert [e for e in h.events if e.kind == "close"] == []
        await h.clock.run_for(1.0, step=0.5)
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
        await h.clock.run_for(TIMING.fence_after_s + 1, step=0.5)
        assert a.fence.fenced
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
