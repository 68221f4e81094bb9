"""The checkpoint-store port: where the newest channel checkpoint is kept.

A checkpoint is the materialised channel table plus the channel position it covers (DESIGN §4):
lbd keeps its own compaction because the channel topic has none. A starting sidecar loads the newest
checkpoint and replays the channel after its position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from lbd.core.errors import LbdError
from lbd.core.table import ChannelPosition


class CorruptCheckpointError(LbdError):
    """The stored checkpoint is unreadable (a missing part, a hash mismatch, a bad manifest)."""


@dataclass(frozen=True, slots=True)
class StoredCheckpoint:
    """An opaque checkpoint body with the metadata needed to pick and fence it."""

    position: ChannelPosition
    """The last channel position the body covers."""
    leader_term: int
    """The term of the leader that wrote it."""
    body: bytes
    """The encoded table (the store does not look inside)."""


def supersedes(new: StoredCheckpoint, old: StoredCheckpoint) -> bool:
    """Whether ``new`` may replace ``old`` (the rule of :meth:`CheckpointStore.save`).

    Only ``position`` and ``leader_term`` are compared; the bodies are not looked at.
    """
    if new.leader_term != old.leader_term:
        return new.leader_term > old.leader_term
    return new.position > old.position


class CheckpointStore(Protocol):
    """Keeps the newest checkpoint. Durable across restarts of etcd and of the Pulsar server.

    Raises :class:`~lbd.ports.errors.UnavailableError` when the store cannot be reached.
    """

    async def save(self, checkpoint: StoredCheckpoint) -> bool:
        """Store ``checkpoint`` as the newest, atomically: a reader sees the old or the new one
        whole.

        Refused (returns False, nothing written) when the stored one has a higher leader term, or
        the same term and a position not older than this one: a deposed leader cannot roll back a
        newer checkpoint.
        """
        ...

    async def load(self) -> StoredCheckpoint | None:
        """The newest checkpoint, or None when none was ever saved.

        Raises :class:`CorruptCheckpointError` when it exists but cannot be read back whole.
        """
        ...
