"""The contract of :class:`lbd.ports.loadstore.LoadStore`, run against every implementation.

A concrete test class subclasses :class:`LoadStoreContract` and provides the ``new_store``
fixture: a factory of stores on one fresh topic (each call: another sidecar's store, stamping
receive times with the given clock), all closed by the fixture afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from lbd.adapters.clock import ManualClock
from lbd.core.errors import InvalidInputError
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.ports.loadstore import LoadStore

StoreFactory = Callable[[Clock], LoadStore]

TTL_MS = 60_000
WAIT_S = 10.0


async def wait_until_latest(
    store: LoadStore, clock: Clock, expected: dict[str, bytes], *, ttl_ms: int = TTL_MS
) -> None:
    """Wait until ``store.latest`` equals ``expected`` (delivery may be asynchronous)."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while (got := store.latest(clock.now_ms(), ttl_ms)) != expected:
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"latest() is {got!r}, still not {expected!r} after {WAIT_S}s")
        await asyncio.sleep(0.01)


class LoadStoreContract:
    """What every LoadStore does. Subclasses provide ``new_store``."""

    @pytest.fixture
    def new_store(self) -> StoreFactory:
        raise NotImplementedError("a concrete contract test provides new_store")

    async def test_a_published_value_reaches_every_started_store(
        self, new_store: StoreFactory
    ) -> None:
        clock = ManualClock()
        publisher, first, second = new_store(clock), new_store(clock), new_store(clock)
        await first.start()
        await second.start()
        await publisher.publish("broker-1", b"load-1")
        await publisher.publish("broker-2", b"load-2")
        expected = {"broker-1": b"load-1", "broker-2": b"load-2"}
        await wait_until_latest(first, clock, expected)
        await wait_until_latest(second, clock, expected)
        assert publisher.latest(clock.now_ms(), TTL_MS) == {}

    async def test_the_latest_value_of_a_key_wins(self, new_store: StoreFactory) -> None:
        clock = ManualClock()
        publisher, reader = new_store(clock), new_store(clock)
        await reader.start()
        for i in range(5):
            await publisher.publish("broker-1", b"v%d" % i)
        await publisher.publish("broker-2", b"other")
        await wait_until_latest(reader, clock, {"broker-1": b"v4", "broker-2": b"other"})

    async def test_values_older_than_the_ttl_are_left_out(self, new_store: StoreFactory) -> None:
        clock = ManualClock()
        store = new_store(clock)
        await store.start()
        await store.publish("broker-1", b"old")
        await wait_until_latest(store, clock, {"broker-1": b"old"})
        received_ms = clock.now_ms()

        clock.advance(10)
        await store.publish("broker-2", b"new")
        await wait_until_latest(store, clock, {"broker-1": b"old", "broker-2": b"new"})

        assert store.latest(received_ms + 10_999, ttl_ms=11_000) == {
            "broker-1": b"old",
            "broker-2": b"new",
        }
        assert store.latest(received_ms + 11_000, ttl_ms=11_000) == {"broker-2": b"new"}
        assert store.latest(received_ms + 21_000, ttl_ms=11_000) == {}

    async def test_a_newer_value_refreshes_the_age(self, new_store: StoreFactory) -> None:
        clock = ManualClock()
        store = new_store(clock)
        await store.start()
        await store.publish("broker-1", b"first")
        await wait_until_latest(store, clock, {"broker-1": b"first"})
        clock.advance(30)
        await store.publish("broker-1", b"second")
        await wait_until_latest(store, clock, {"broker-1": b"second"}, ttl_ms=1_000)

    async def test_delete_publishes_a_tombstone(self, new_store: StoreFactory) -> None:
        clock = ManualClock()
        publisher, reader = new_store(clock), new_store(clock)
        await reader.start()
        await publisher.publish("broker-1", b"load")
        await publisher.publish("broker-2", b"load")
        await wait_until_latest(reader, clock, {"broker-1": b"load", "broker-2": b"load"})

        await publisher.delete("broker-1")

        await wait_until_latest(reader, clock, {"broker-2": b"load"})

    async def test_a_store_receives_only_what_is_published_after_its_start(
        self, new_store: StoreFactory
    ) -> None:
        clock = ManualClock()
        publisher, early, late = new_store(clock), new_store(clock), new_store(clock)
        await early.start()
        await publisher.publish("before", b"1")
        await wait_until_latest(early, clock, {"before": b"1"})

        await late.start()
        await publisher.publish("after", b"2")

        await wait_until_latest(early, clock, {"before": b"1", "after": b"2"})
        await wait_until_latest(late, clock, {"after": b"2"})

    @pytest.mark.parametrize(("key", "value"), [("", b"v"), ("broker-1", b"")])
    async def test_empty_keys_and_values_are_refused(
        self, new_store: StoreFactory, key: str, value: bytes
    ) -> None:
        store = new_store(ManualClock())
        with pytest.raises(InvalidInputError):
            await store.publish(key, value)

    async def test_close_is_idempotent_and_stops_publishing(self, new_store: StoreFactory) -> None:
        clock = ManualClock()
        store = new_store(clock)
        await store.start()
        await store.publish("broker-1", b"v")
        await wait_until_latest(store, clock, {"broker-1": b"v"})

        await store.close()
        await store.close()

        with pytest.raises(UnavailableError):
            await store.publish("broker-1", b"w")
        with pytest.raises(UnavailableError):
            await store.start()
