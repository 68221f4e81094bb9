"""The checkpoint contract against the in-memory twin."""

from __future__ import annotations

import pytest

from lbd.adapters.memory import MemoryCheckpointStore
from lbd.ports.errors import UnavailableError
from tests.contract.checkpoint_suite import CheckpointStoreContract, StoreFactory, checkpoint


class TestMemoryCheckpointStore(CheckpointStoreContract):
    @pytest.fixture
    def make_store(self) -> StoreFactory:
        shared = MemoryCheckpointStore()
        return lambda: shared


async def test_unreachable_store_raises_and_keeps_its_checkpoint() -> None:
    store = MemoryCheckpointStore()
    assert await store.save(checkpoint(1, 1))
    store.reachable = False
    with pytest.raises(UnavailableError):
        await store.save(checkpoint(1, 2))
    with pytest.raises(UnavailableError):
        await store.load()
    store.reachable = True
    assert await store.load() == checkpoint(1, 1)
    assert store.saves == 1
