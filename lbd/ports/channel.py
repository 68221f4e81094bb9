"""The channel-log port: the ordered, keyed log every sidecar reads (the state channel).

The real implementation is a persistent Pulsar topic (:mod:`lbd.adapters.pulsar`). Delivery is
at-least-once: a follower may see a message again (after a reconnect, or on pulsar-lite's catch-up);
callers drop any message whose position is not greater than the last one they applied.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from lbd.core.table import ChannelPosition


@dataclass(frozen=True, slots=True)
class ChannelMessage:
    """One message of the log: its position, key (a bundle id, or a bootstrap key) and value."""

    position: ChannelPosition
    key: str
    value: bytes


class ChannelLog(Protocol):
    """Publish keyed messages; follow the log in order from a position."""

    async def publish(self, key: str, value: bytes) -> ChannelPosition:
        """Append one message and return its position once the log has persisted it.

        Raises :class:`~lbd.ports.errors.UnavailableError` when the log cannot be reached; the
        message may or may not have been appended then (the resolver makes a repeat harmless).
        """
        ...

    def follow(self, after: ChannelPosition | None) -> AsyncIterator[ChannelMessage]:
        """Every message strictly after ``after`` (from the start when None), in log order.

        Never ends on its own: it waits for new messages, and resumes after outages of the log
        (from the last position it delivered). May deliver a position again; never skips one.
        """
        ...

    async def close(self) -> None:
        """Release producers and readers. Idempotent."""
        ...
