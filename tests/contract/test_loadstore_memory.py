"""The LoadStore contract on the in-memory twin, plus the outage tests can inject into it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from lbd.adapters.clock import ManualClock
from lbd.adapters.memory.loadstore import MemoryLoadStore, MemoryLoadTopic
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from tests.contract.loadstore_suite import LoadStoreContract, StoreFactory


@pytest.fixture
def memory_topic() -> MemoryLoadTopic:
    return MemoryLoadTopic()


@pytest.fixture
async def memory_stores(memory_topic: MemoryLoadTopic) -> AsyncIterator[StoreFactory]:
    stores: list[MemoryLoadStore] = []

    def make(clock: Clock) -> MemoryLoadStore:
        store = MemoryLoadStore(memory_topic, clock)
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()


class TestMemoryLoadStore(LoadStoreContract):
    @pytest.fixture
    def new_store(self, memory_stores: StoreFactory) -> StoreFactory:
        return memory_stores


async def test_an_outage_fails_publishing_and_starting_until_it_ends(
    memory_topic: MemoryLoadTopic, memory_stores: StoreFactory
) -> None:
    clock = ManualClock()
    publisher, reader, late = memory_stores(clock), memory_stores(clock), memory_stores(clock)
    await reader.start()

    memory_topic.go_down()
    with pytest.raises(UnavailableError, match="down"):
        await publisher.publish("broker-1", b"lost")
    with pytest.raises(UnavailableError, match="down"):
        await late.start()
    assert reader.latest(clock.now_ms(), 1000) == {}

    memory_topic.come_back()
    await late.start()
    await publisher.publish("broker-1", b"kept")
    assert reader.latest(clock.now_ms(), 1000) == {"broker-1": b"kept"}
    assert late.latest(clock.now_ms(), 1000) == {"broker-1": b"kept"}
