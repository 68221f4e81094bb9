"""The contract of :class:`lbd.ports.checkpoint.CheckpointStore`, for every adapter.

A concrete test class subclasses :class:`CheckpointStoreContract` and provides ``make_store``: a
factory of stores on one shared backend (a second store is a restarted or another sidecar).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from lbd.core.table import ChannelPosition
from lbd.ports.checkpoint import CheckpointStore, StoredCheckpoint

StoreFactory = Callable[[], CheckpointStore]


def checkpoint(term: int, entry: int, body: bytes = b"table") -> StoredCheckpoint:
    """A checkpoint at ledger 1, ``entry``, written by the leader of ``term``."""
    return StoredCheckpoint(ChannelPosition(1, entry), term, body)


class CheckpointStoreContract:
    """Behaviour every :class:`CheckpointStore` adapter must show."""

    @pytest.fixture
    def make_store(self) -> StoreFactory:
        raise NotImplementedError("a concrete contract test provides the make_store fixture")

    async def test_nothing_saved_loads_none(self, make_store: StoreFactory) -> None:
        assert await make_store().load() is None

    async def test_saved_checkpoint_is_loaded_by_another_store(
        self, make_store: StoreFactory
    ) -> None:
        saved = checkpoint(3, 10, b'{"bundle": "owned"}')
        assert await make_store().save(saved)
        assert await make_store().load() == saved

    async def test_a_large_body_round_trips(self, make_store: StoreFactory) -> None:
        # Incompressible and above etcd's 1.5 MiB request limit: it must be cut into parts.
        body = os.urandom(3 * 1024 * 1024 + 17)
        store = make_store()
        assert await store.save(checkpoint(1, 1, body))
        loaded = await store.load()
        assert loaded is not None
        assert loaded.body == body

    async def test_newer_position_or_term_replaces(self, make_store: StoreFactory) -> None:
        store = make_store()
        assert await store.save(checkpoint(1, 10, b"a"))
        assert await store.save(checkpoint(1, 11, b"b"))
        assert await store.load() == checkpoint(1, 11, b"b")
        assert await store.save(checkpoint(2, 5, b"c")), "a new leader's term wins over position"
        assert await store.load() == checkpoint(2, 5, b"c")

    async def test_older_or_equal_checkpoint_is_refused(self, make_store: StoreFactory) -> None:
        store = make_store()
        assert await store.save(checkpoint(2, 10, b"kept"))
        assert not await store.save(checkpoint(2, 10, b"same position"))
        assert not await store.save(checkpoint(2, 9, b"older position"))
        assert not await store.save(checkpoint(1, 99, b"deposed leader"))
        assert await store.load() == checkpoint(2, 10, b"kept")

    async def test_empty_body_round_trips(self, make_store: StoreFactory) -> None:
        store = make_store()
        assert await store.save(checkpoint(1, 0, b""))
        assert await store.load() == checkpoint(1, 0, b"")
