"""The ownership cache follows WatchOwnership: from a real sidecar's API, and from a scripted one
that drops the stream, refuses reconnects and comes back with a different table."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from lbd.broker import OwnershipCache, StaleOwnershipError
from lbd.gen.v1 import lbd_pb2
from tests.unit.api.served import serve_api
from tests.unit.broker.scripted import ScriptedSidecar, scripted_sidecar, until
from tests.unit.services.harness import Harness

B1 = "public/default/0x00000000_0x40000000"
B2 = "public/default/0x40000000_0x80000000"
TOPIC = "persistent://public/default/t1"
DONE = lbd_pb2.OwnershipChange(snapshot_done=True)


def owned(bundle: str, owner: str, version: int = 1) -> lbd_pb2.OwnershipChange:
    return lbd_pb2.OwnershipChange(
        bundle=bundle,
        state=lbd_pb2.BUNDLE_STATE_OWNED,
        owner_broker_id=owner,
        version_id=version,
    )


@pytest.fixture
async def sidecar() -> AsyncIterator[tuple[ScriptedSidecar, str]]:
    async with scripted_sidecar() as served:
        yield served


async def test_the_cache_follows_a_real_sidecar() -> None:
    async with Harness() as h:
        sidecar = await h.add("broker-a")
        await h.ready()
        async with serve_api(h, sidecar) as api:
            await until(lambda: api.elector.is_leader)
            async with OwnershipCache(api.addr, namespace="public/default") as cache:
                await asyncio.wait_for(cache.wait_synced(), 5)
                reply = await api.lb.Lookup(lbd_pb2.LookupRequest(topic=TOPIC), timeout=5)
                await until(lambda: cache.owner(reply.bundle) == "broker-a")
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
                assert cache.owner(reply.bundle) is None


async def test_changes_apply_after_the_snapshot_and_a_reconnect_replaces_the_table(
    sidecar: tuple[ScriptedSidecar, str],
) -> None:
    servicer, addr = sidecar
    async with OwnershipCache(addr, reconnect_min_s=0.05) as cache:
        first = await servicer.next_watch()
        for change in (owned(B1, "broker-1"), owned(B2, "broker-2"), DONE):
            first.put_nowait(change)
        await asyncio.wait_for(cache.wait_synced(), 5)
        assert (cache.owner(B1), cache.owner(B2)) == ("broker-1", "broker-2")
        first.put_nowait(
            lbd_pb2.OwnershipChange(
                bundle=B1,
                state=lbd_pb2.BUNDLE_STATE_ASSIGNING,
                owner_broker_id="broker-3",
                source_broker_id="broker-1",
                version_id=2,
            )
        )
        await until(lambda: cache.owner(B1) is None)  # moving: nobody to send clients to
        first.put_nowait(owned(B1, "broker-3", 3))
        await until(lambda: cache.owner(B1) == "broker-3")

        first.put_nowait(None)  # the stream ends; B2's value is removed while the cache is away
        second = await servicer.next_watch()
        assert cache.owner(B2) == "broker-2"  # within the bound: what it had
        second.put_nowait(owned(B1, "broker-4", 4))
        second.put_nowait(DONE)
        await until(lambda: cache.syncs == 2)
        assert (cache.owner(B1), cache.get(B2)) == ("broker-4", None)
        second.put_nowait(lbd_pb2.OwnershipChange(bundle=B1, state=lbd_pb2.BUNDLE_STATE_INIT))
        await until(lambda: cache.get(B1) is None)  # tombstoned


async def test_answers_go_stale_after_the_bound_and_fresh_again_after_a_resync(
    sidecar: tuple[ScriptedSidecar, str],
) -> None:
    servicer, addr = sidecar
    async with OwnershipCache(addr, stale_after_s=0.3, reconnect_min_s=0.05) as cache:
        with pytest.raises(StaleOwnershipError, match="not synced yet"):
            cache.owner(B1)
        feed = await servicer.next_watch()
        feed.put_nowait(owned(B1, "broker-1"))
        feed.put_nowait(DONE)
        await until(cache.fresh)

        servicer.refuse = True
        feed.put_nowait(None)
        await until(lambda: not cache.live)
        assert cache.owner(B1) == "broker-1"
        await until(lambda: not cache.fresh())
        with pytest.raises(StaleOwnershipError, match="stale: disconnected"):
            cache.owner(B1)

        servicer.refuse = False
        feed = await servicer.next_watch()
        feed.put_nowait(owned(B1, "broker-2", 2))
        feed.put_nowait(DONE)
        await until(cache.fresh)
        assert cache.owner(B1) == "broker-2"
