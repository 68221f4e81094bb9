"""The load-store port: latest value per key with a time-to-live (broker and top-bundles load)."""

from __future__ import annotations

from typing import Protocol


class LoadStore(Protocol):
    """Keyed values where only the latest per key matters and old ones expire.

    The real implementation is a non-persistent Pulsar topic read by every interested sidecar; a
    value is not durable: after a restart, the store is empty until publishers publish again, and a
    store receives only what is published after its :meth:`start`. An empty value is a tombstone.
    """

    async def start(self) -> None:
        """Subscribe and keep receiving in the background (resubscribing after outages).

        Returns once subscribed. Raises :class:`~lbd.ports.errors.UnavailableError` if the store
        cannot be reached; nothing is left running then, and ``start`` may be called again.
        Publishing does not need ``start``: a publish-only store never calls it.
        """
        ...

    async def publish(self, key: str, value: bytes) -> None:
        """Publish the latest value for ``key`` (fire-and-forget delivery to current readers).

        Raises :class:`~lbd.ports.errors.UnavailableError` when the store cannot be reached, and
        :class:`~lbd.core.errors.InvalidInputError` for an empty key or an empty value (use
        :meth:`delete`).
        """
        ...

    def latest(self, now_ms: int, ttl_ms: int) -> dict[str, bytes]:
        """The latest value of every key received less than ``ttl_ms`` before ``now_ms``.

        Keys whose latest message was a tombstone are absent. Receive times come from the clock
        the store was built with.
        """
        ...

    async def delete(self, key: str) -> None:
        """Publish a tombstone for ``key`` (e.g. a broker that left)."""
        ...

    async def close(self) -> None:
        """Stop reading and publishing. Idempotent."""
        ...


class LatestValues:
    """What every LoadStore keeps: each key's latest value and when it was received.

    An empty value is a tombstone and removes the key. One implementation for every adapter, so
    the TTL rule of :meth:`LoadStore.latest` is the same everywhere.
    """

    def __init__(self) -> None:
        self._values: dict[str, tuple[bytes, int]] = {}

    def receive(self, key: str, value: bytes, received_ms: int) -> None:
        """Keep ``value`` as the latest of ``key`` (an empty value deletes the key)."""
        if value:
            self._values[key] = (value, received_ms)
        else:
            self._values.pop(key, None)

    def fresh(self, now_ms: int, ttl_ms: int) -> dict[str, bytes]:
        """The latest value of every key received less than ``ttl_ms`` before ``now_ms``."""
        return {
            key: value
            for key, (value, received_ms) in self._values.items()
            if now_ms - received_ms < ttl_ms
        }
