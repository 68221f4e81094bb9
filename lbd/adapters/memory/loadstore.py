"""The in-memory twin of the load stores: one :class:`MemoryLoadTopic` shared by several stores.

A publish is delivered at once to every started, open store on the topic, stamped with each store's
own clock, as a non-persistent topic delivers to its current readers only. Tests inject outages with
:meth:`MemoryLoadTopic.go_down`: publishing and starting fail, and nothing is delivered.
"""

from __future__ import annotations

from lbd.core.errors import InvalidInputError
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.ports.loadstore import LatestValues


class MemoryLoadTopic:
    """A non-persistent topic in memory: delivers each publish to the stores reading it now."""

    def __init__(self) -> None:
        self._readers: set[MemoryLoadStore] = set()
        self._available = True

    @property
    def available(self) -> bool:
        """Whether the topic answers (False between :meth:`go_down` and :meth:`come_back`)."""
        return self._available

    def go_down(self) -> None:
        """Start an outage: publishing and subscribing fail."""
        self._available = False

    def come_back(self) -> None:
        """End the outage; started stores receive again."""
        self._available = True

    def _check_available(self) -> None:
        if not self._available:
            raise UnavailableError("the in-memory load topic is down")

    def _subscribe(self, store: MemoryLoadStore) -> None:
        self._check_available()
        self._readers.add(store)

    def _unsubscribe(self, store: MemoryLoadStore) -> None:
        self._readers.discard(store)

    def _publish(self, key: str, value: bytes) -> None:
        self._check_available()
        for reader in self._readers:
            reader._receive(key, value)


class MemoryLoadStore:
    """One client's store on a :class:`MemoryLoadTopic` (the LoadStore port)."""

    def __init__(self, topic: MemoryLoadTopic, clock: Clock) -> None:
        self._topic = topic
        self._clock = clock
        self._values = LatestValues()
        self._closed = False

    async def start(self) -> None:
        """Receive what is published from now on (see the port)."""
        self._check_open()
        self._topic._subscribe(self)

    async def publish(self, key: str, value: bytes) -> None:
        """Publish the latest ``value`` of ``key`` (see the port)."""
        if not value:
            raise InvalidInputError(f"load value of {key!r} is empty: use delete() for a tombstone")
        self._send(key, value)

    async def delete(self, key: str) -> None:
        """Publish a tombstone for ``key``."""
        self._send(key, b"")

    def latest(self, now_ms: int, ttl_ms: int) -> dict[str, bytes]:
        """Latest value of every key received less than ``ttl_ms`` before ``now_ms``."""
        return self._values.fresh(now_ms, ttl_ms)

    async def close(self) -> None:
        """Stop receiving and publishing. Idempotent."""
        self._closed = True
        self._topic._unsubscribe(self)

    def _send(self, key: str, value: bytes) -> None:
        if not key:
            raise InvalidInputError("a load value needs a non-empty key")
        self._check_open()
        self._topic._publish(key, value)

    def _receive(self, key: str, value: bytes) -> None:
        self._values.receive(key, value, self._clock.now_ms())

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError("the in-memory load store is closed")
