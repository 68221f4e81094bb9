"""The ownership cache follows WatchOwnership: from a real sidecar's API (whose channel is cut and
restored), and from a scripted one that falls silent, drops the stream, refuses reconnects and
comes back with a different table. Times here are real: the cache keeps its bound on the
monotonic clock."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from lbd.broker import OwnershipCache, StaleOwnershipError
from lbd.core.errors import InvalidInputError
from lbd.gen.v1 import lbd_pb2
from tests.unit.api.served import serve_api
from tests.unit.broker.scripted import ScriptedSidecar, scripted_sidecar, until
from tests.unit.broker.views import DONE, heartbeat, owned, topic_with_hash
from tests.unit.services.harness import Harness

B1 = "public/default/0x00000000_0x40000000"
B2 = "public/default/0x40000000_0x80000000"
TOPIC = "persistent://public/default/t1"
T1 = topic_with_hash("public/default", 0x10000000)  # in B1
BOUND_S = 1.0
"""The staleness bound of the caches here: a second, far above in-process latencies."""


@pytest.fixture
async def sidecar() -> AsyncIterator[tuple[ScriptedSidecar, str]]:
    async with scripted_sidecar() as served:
        yield served


@contextlib.asynccontextmanager
async def clock_running(h: Harness) -> AsyncIterator[None]:
    """The harness's clock moved on 20 times faster than real time, so that the fence runs its
    read barriers (every second of that clock) while the test waits in real time."""

    async def drive() -> None:
        while True:
            await h.clock.run_for(0.2)
            await asyncio.sleep(0.01)

    driver = asyncio.create_task(drive())
    try:
        yield
    finally:
        driver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await driver


async def sleep_until(instant: float) -> None:
    await asyncio.sleep(max(0.0, instant - time.monotonic()))


async def test_a_real_sidecar_feeds_the_cache_and_a_change_reaches_it_within_the_bound() -> None:
    async with Harness() as h:
        sidecar = await h.add("broker-a")
        await h.ready()
        async with serve_api(h, sidecar) as api, clock_running(h):
            await until(lambda: api.elector.is_leader)
            async with OwnershipCache(
                api.addr, namespace="public/default", stale_after_s=BOUND_S, heartbeat_s=0.02
            ) as cache:
                await asyncio.wait_for(cache.wait_synced(), 5)
                assert cache.owner_of_topic(TOPIC) is None  # not assigned yet
                reply = await api.lb.Lookup(lbd_pb2.LookupRequest(topic=TOPIC), timeout=5)
                persisted = time.monotonic()  # the assignment is on the channel by now
                await until(lambda: cache.owner_of_topic(TOPIC) == "broker-a")
                assert time.monotonic() - persisted <= BOUND_S
                answer = cache.lookup_topic(TOPIC)
                assert answer is not None and answer.bundle == reply.bundle
                value = cache.get(reply.bundle)
                assert value is not None and value.owned and value.version_id > 0

                await api.admin.Unload(lbd_pb2.UnloadRequest(bundle=reply.bundle), timeout=5)
                # Releasing (no owner to send clients to), then Free: the stream may lag the
                # answer, so wait for the last step.
                await until(
                    lambda: (
                        (v := cache.get(reply.bundle)) is not None
                        and v.state == lbd_pb2.BUNDLE_STATE_FREE
                    )
                )
                assert cache.owner_of_topic(TOPIC) is None


async def test_a_sidecar_cut_off_from_the_channel_stops_vouching_and_the_cache_goes_stale() -> None:
    async with Harness() as h:
        sidecar = await h.add("broker-a")
        await h.ready()
        async with serve_api(h, sidecar) as api, clock_running(h):
            await until(lambda: api.elector.is_leader)
            await api.lb.Lookup(lbd_pb2.LookupRequest(topic=TOPIC), timeout=5)
            async with OwnershipCache(api.addr, stale_after_s=BOUND_S, heartbeat_s=0.02) as cache:
                await asyncio.wait_for(cache.wait_synced(), 5)
                await until(lambda: cache.owner_of_topic(TOPIC) == "broker-a")

                h.log.go_down()  # the sidecar's read barriers fail; its stream stays open
                cut = time.monotonic()
                await sleep_until(cut + BOUND_S + 0.05)
                assert cache.live
                # Heartbeats still come, vouching for nothing after the cut.
                with pytest.raises(StaleOwnershipError, match=r"last heartbeat came 0\.[0-4]"):
                    cache.owner_of_topic(TOPIC)
                assert cache.vouched_age_s() > BOUND_S

                h.log.come_back()
                await until(cache.fresh)
                assert cache.owner_of_topic(TOPIC) == "broker-a"
                assert cache.syncs == 1  # the same stream all along


async def test_a_silent_sidecar_is_noticed_within_the_bound_while_the_stream_stays_open(
    sidecar: tuple[ScriptedSidecar, str],
) -> None:
    servicer, addr = sidecar
    async with OwnershipCache(addr, stale_after_s=BOUND_S, heartbeat_s=0.05) as cache:
        feed = await servicer.next_watch()
        assert servicer.watch_requests[0].heartbeat_ms == 50
        for change in (owned(B1, "broker-1"), DONE):
            feed.put_nowait(change)
        sent = time.monotonic()
        feed.put_nowait(heartbeat(0))  # vouches for the instant it is sent
        await asyncio.wait_for(cache.wait_synced(), 5)
        heard = time.monotonic()
        await sleep_until(sent + BOUND_S / 2)
        assert cache.owner_of_topic(T1) == "broker-1"  # within the bound
        await sleep_until(heard + BOUND_S + 0.05)  # past it, though the stream is open
        assert cache.live
        with pytest.raises(StaleOwnershipError, match=r"the last heartbeat came 1\.\d+ s ago"):
            cache.owner_of_topic(T1)
        feed.put_nowait(heartbeat(0))
        await until(cache.fresh)
        assert cache.owner_of_topic(T1) == "broker-1"


async def test_changes_apply_after_the_snapshot_and_a_reconnect_replaces_the_table(
    sidecar: tuple[ScriptedSidecar, str],
) -> None:
    servicer, addr = sidecar
    async with OwnershipCache(addr, reconnect_min_s=0.05) as cache:
        first = await servicer.next_watch()
        for change in (owned(B1, "broker-1"), owned(B2, "broker-2"), DONE, heartbeat()):
            first.put_nowait(change)
        await asyncio.wait_for(cache.wait_synced(), 5)
        assert (cache.owner(B1), cache.owner(B2)) == ("broker-1", "broker-2")
        assert cache.owner_of_topic(T1) == "broker-1"
        first.put_nowait(
            lbd_pb2.OwnershipChange(
                bundle=B1,
                state=lbd_pb2.BUNDLE_STATE_ASSIGNING,
                owner_broker_id="broker-3",
                source_broker_id="broker-1",
                version_id=2,
            )
        )
        await until(lambda: cache.owner_of_topic(T1) is None)  # moving: nobody to send to
        first.put_nowait(owned(B1, "broker-3", 3))
        await until(lambda: cache.owner_of_topic(T1) == "broker-3")

        first.put_nowait(None)  # the stream ends; B2's value is removed while the cache is away
        second = await servicer.next_watch()
        assert cache.owner(B2) == "broker-2"  # within the bound: what it had
        for change in (owned(B1, "broker-4", 4), DONE, heartbeat()):
            second.put_nowait(change)
        await until(lambda: cache.syncs == 2)
        assert (cache.owner(B1), cache.get(B2)) == ("broker-4", None)
        assert cache.owner_of_topic(T1) == "broker-4"
        second.put_nowait(lbd_pb2.OwnershipChange(bundle=B1, state=lbd_pb2.BUNDLE_STATE_INIT))
        await until(lambda: cache.get(B1) is None)  # tombstoned
        assert cache.owner_of_topic(T1) is None


async def test_answers_go_stale_after_the_bound_and_fresh_again_after_a_resync(
    sidecar: tuple[ScriptedSidecar, str],
) -> None:
    servicer, addr = sidecar
    async with OwnershipCache(
        addr, stale_after_s=0.3, heartbeat_s=0.05, reconnect_min_s=0.05
    ) as cache:
        with pytest.raises(StaleOwnershipError, match="not synced yet"):
            cache.owner(B1)
        feed = await servicer.next_watch()
        for change in (owned(B1, "broker-1"), DONE, heartbeat()):
            feed.put_nowait(change)
        await until(cache.fresh)

        servicer.refuse = True
        feed.put_nowait(None)
        await until(lambda: not cache.live)
        assert cache.owner(B1) == "broker-1"
        await until(lambda: not cache.fresh())
        with pytest.raises(StaleOwnershipError, match="the stream is down"):
            cache.owner_of_topic(T1)

        servicer.refuse = False
        feed = await servicer.next_watch()
        for change in (owned(B1, "broker-2", 2), DONE):
            feed.put_nowait(change)
        await until(
            lambda: "waits for the sidecar's first heartbeat" in (cache.stale_reason() or "")
        )
        with pytest.raises(StaleOwnershipError):  # synced, but not vouched for yet
            cache.owner(B1)
        feed.put_nowait(heartbeat())
        await until(cache.fresh)
        assert cache.owner(B1) == "broker-2"


def test_a_heartbeat_interval_not_below_the_bound_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="heartbeat interval"):
        OwnershipCache("127.0.0.1:1", stale_after_s=1.0, heartbeat_s=1.0)
