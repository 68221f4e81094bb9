"""The metadata contract against the in-memory twin, plus its failure-injection hooks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TypeVar

import pytest

from lbd.adapters.clock import ManualClock
from lbd.adapters.memory import MemoryMetadataCluster, MemoryMetadataStore
from lbd.adapters.session import SessionPolicy
from lbd.core.ids import BrokerId
from lbd.ports.errors import UnavailableError
from lbd.ports.metadata import MetadataStore, SessionEventKind
from tests.contract.metadata_suite import MetadataHarness, MetadataStoreContract, next_event

T = TypeVar("T")

POLICY = SessionPolicy(lease_ttl_s=2, keepalive_interval_s=0.5)
STEP_S = 0.05


class MemoryHarness(MetadataHarness):
    """Stores on one :class:`MemoryMetadataCluster`; time moves only inside :meth:`wait`."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.cluster = MemoryMetadataCluster(self.clock)
        self.stores: list[MemoryMetadataStore] = []

    async def store(self, policy: SessionPolicy | None = None) -> MetadataStore:
        store = MemoryMetadataStore(self.cluster, policy or POLICY)
        self.stores.append(store)
        await store.start()
        return store

    async def lose_lease(self, store: MetadataStore) -> None:
        assert isinstance(store, MemoryMetadataStore)
        self.cluster.revoke_lease(store.lease_id)

    async def wait(self, awaitable: Awaitable[T], timeout_s: float) -> T:
        task = asyncio.ensure_future(awaitable)
        waited = 0.0
        while True:
            for _ in range(10):
                await asyncio.sleep(0)
                if task.done():
                    return task.result()
            if waited >= timeout_s:
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                raise TimeoutError(f"not done after {timeout_s}s of manual time")
            self.clock.advance(STEP_S)
            waited += STEP_S

    async def close(self) -> None:
        for store in self.stores:
            await store.close()


@pytest.fixture
async def memory_harness() -> AsyncIterator[MemoryHarness]:
    harness = MemoryHarness()
    yield harness
    await harness.close()


class TestMemoryMetadataStore(MetadataStoreContract):
    @pytest.fixture
    def harness(self, memory_harness: MemoryHarness) -> MetadataHarness:
        return memory_harness


async def test_unreachable_cluster_fails_requests_and_pauses_the_session(
    memory_harness: MemoryHarness,
) -> None:
    store = await memory_harness.store()
    async with aclosing(store.session_events()) as events:
        memory_harness.cluster.set_reachable(False)
        with pytest.raises(UnavailableError):
            await store.list_brokers()
        assert (await next_event(memory_harness, events)).kind is SessionEventKind.UNREACHABLE
        memory_harness.cluster.set_reachable(True)
        assert (await next_event(memory_harness, events)).kind is SessionEventKind.REACHABLE


async def test_an_outage_longer_than_the_ttl_ends_in_a_new_lease(
    memory_harness: MemoryHarness,
) -> None:
    store = await memory_harness.store()
    await store.register_broker(BrokerId("a"), b"a")
    renewed = store.last_renewed_monotonic
    async with aclosing(store.session_events()) as events:
        memory_harness.cluster.set_reachable(False)
        assert (await next_event(memory_harness, events)).kind is SessionEventKind.UNREACHABLE
        for _ in range(5):  # let the keepalive go back to sleep
            await asyncio.sleep(0)
        memory_harness.clock.advance(POLICY.lease_ttl_s + 1)
        assert memory_harness.clock.monotonic() - store.last_renewed_monotonic > POLICY.lease_ttl_s
        memory_harness.cluster.set_reachable(True)
        assert (await next_event(memory_harness, events)).kind is SessionEventKind.LEASE_LOST
        assert (await next_event(memory_harness, events)).kind is SessionEventKind.RECONNECTED
    assert store.last_renewed_monotonic > renewed
    assert (await store.list_brokers())[0] == {BrokerId("a"): b"a"}


async def test_watch_resumes_after_an_outage_without_missing_events(
    memory_harness: MemoryHarness,
) -> None:
    writer = await memory_harness.store()
    reader = await memory_harness.store()
    _, revision = await reader.list_brokers()
    async with aclosing(reader.watch_brokers(revision)) as changes:
        await writer.register_broker(BrokerId("a"), b"1")
        assert (await memory_harness.wait(anext(changes), 1)).value == b"1"
        memory_harness.cluster.set_reachable(False)
        pending = asyncio.ensure_future(anext(changes))
        assert await memory_harness.stays_pending(asyncio.shield(pending), 0.5)
        memory_harness.cluster.set_reachable(True)
        await writer.register_broker(BrokerId("a"), b"2")
        assert (await memory_harness.wait(pending, 1)).value == b"2"
