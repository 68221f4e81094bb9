"""The load-store port: latest value per key with a time-to-live (broker and top-bundles load)."""

from __future__ import annotations

from typing import Protocol


class LoadStore(Protocol):
    """Keyed values where only the latest per key matters and old ones expire.

    The real implementation is a non-persistent Pulsar topic read by every interested sidecar; a
    value is not durable: after a restart, the store is empty until publishers publish again.
    """

    async def publish(self, key: str, value: bytes) -> None:
        """Publish the latest value for ``key`` (fire-and-forget delivery to current readers)."""
        ...

    def latest(self, now_ms: int, ttl_ms: int) -> dict[str, bytes]:
        """The latest value of every key received less than ``ttl_ms`` before ``now_ms``."""
        ...

    async def delete(self, key: str) -> None:
        """Publish a tombstone for ``key`` (e.g. a broker that left)."""
        ...

    async def close(self) -> None:
        """Stop reading and publishing. Idempotent."""
        ...
