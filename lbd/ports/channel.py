"""The channel-log port: the ordered, keyed log every sidecar reads (the state channel).

The real implementation is a persistent Pulsar topic (:mod:`lbd.adapters.pulsar_channel`); the
in-memory twin is :mod:`lbd.adapters.memory.channel`. Delivery is at-least-once: a follower may see
a message again (after a reconnect, or on pulsar-lite's catch-up); callers drop any message whose
position is not greater than the last one they applied.

Keys starting with :data:`RESERVED_KEY_PREFIX` belong to the log itself (the Pulsar adapter writes
a bootstrap marker into a never-written topic): :meth:`ChannelLog.publish` refuses them and readers
never yield them, though such a message still occupies a position.

Batches: :meth:`ChannelLog.publish_batch` appends several keyed values as one message of the log,
persisted whole or not at all. Readers deliver each of its values as a message of its own, in the
listed order, at positions that share the batch's ledger and entry and number the values from 0 in
``batch_index`` (an unbatched message has ``batch_index`` -1). Every reader sees the same order,
so a batch is applied exactly as if its values had been published one after another.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from lbd.core.errors import InvalidInputError
from lbd.core.table import ChannelPosition

RESERVED_KEY_PREFIX: Final = "__lbd_"
"""Prefix of the keys the log writes for itself; never a bundle id (those start with a tenant)."""

MAX_BATCH_ENTRIES: Final = 4096
"""Most entries one batch may carry (their positions' ``batch_index`` stays below it)."""


def check_publishable_key(key: str) -> None:
    """Raise :class:`InvalidInputError` unless ``key`` is publishable: non-empty, not reserved."""
    if not key:
        raise InvalidInputError("a channel message needs a non-empty key")
    if key.startswith(RESERVED_KEY_PREFIX):
        raise InvalidInputError(
            f"channel key {key!r} is reserved: keys starting with {RESERVED_KEY_PREFIX!r} "
            "belong to the channel itself"
        )


def check_publishable_batch(entries: Sequence[tuple[str, bytes]]) -> None:
    """Raise :class:`InvalidInputError` unless ``entries`` may be published as one batch."""
    if not entries:
        raise InvalidInputError("a channel batch needs at least one entry")
    if len(entries) > MAX_BATCH_ENTRIES:
        raise InvalidInputError(
            f"a channel batch carries at most {MAX_BATCH_ENTRIES} entries, got {len(entries)}"
        )
    for key, _ in entries:
        check_publishable_key(key)


class ChannelFormatError(Exception):
    """The log holds a message this version of lbd cannot read (a reserved key it does not
    know, or a batch of a newer format): its writer is newer than this reader. A reader that
    skipped it would diverge from the others, so following stops instead."""


@dataclass(frozen=True, slots=True)
class ChannelMessage:
    """One message of the log: its position, key (a bundle id) and value (empty: a tombstone)."""

    position: ChannelPosition
    key: str
    value: bytes


class ChannelLog(Protocol):
    """Publish keyed messages; follow the log in order from a position.

    Every method raises :class:`~lbd.ports.errors.UnavailableError` (and no other exception) when
    the log cannot be reached, except :meth:`follow`, which waits for the log to come back.
    """

    async def publish(self, key: str, value: bytes) -> ChannelPosition:
        """Append one message and return its position once the log has persisted it.

        Raises :class:`~lbd.ports.errors.UnavailableError` when the log cannot be reached; the
        message may or may not have been appended then (the resolver makes a repeat harmless).
        Raises :class:`~lbd.core.errors.InvalidInputError` for an empty or reserved key.
        """
        ...

    async def publish_batch(self, entries: Sequence[tuple[str, bytes]]) -> list[ChannelPosition]:
        """Append ``entries`` (key, value) as one message; each entry's position, in order, once
        the log has persisted them all (see the module docstring).

        All or none of them are appended. Raises as :meth:`publish` does, and
        :class:`~lbd.core.errors.InvalidInputError` for no entries or more than
        :data:`MAX_BATCH_ENTRIES`.
        """
        ...

    def follow(self, after: ChannelPosition | None) -> AsyncGenerator[ChannelMessage, None]:
        """Every message strictly after ``after`` (from the start when None), in log order.

        Never ends on its own: it waits for new messages, and resumes after outages of the log
        (from the last position it delivered). May deliver a position again; never skips one.
        It ends (without error) when the log is closed. Close the iterator when done with it
        (``contextlib.aclosing``) so its reader is released at once.
        """
        ...

    def catch_up(self, after: ChannelPosition | None) -> AsyncGenerator[ChannelMessage, None]:
        """Every message strictly after ``after`` that the log held at the call, then the end.

        For a starting sidecar (apply everything up to now before serving) and for offline dumps.
        Raises :class:`~lbd.ports.errors.UnavailableError` if the log cannot be reached or stops
        answering partway; delivers each position at most once.
        """
        ...

    async def last_after(self, after: ChannelPosition | None) -> ChannelPosition | None:
        """The position of the last message :meth:`catch_up` would deliver after ``after`` now;
        None when it would deliver none.

        What a read barrier asks (where the log ends), without the messages on the way: a
        follower that applies up to this position has read everything the log held at the
        call. Raises :class:`~lbd.ports.errors.UnavailableError` as :meth:`catch_up` does.
        """
        ...

    async def close(self) -> None:
        """Release producers and readers; running :meth:`follow` iterators end. Idempotent."""
        ...
