"""Checkpoints of the channel table: lbd's own compaction of a channel that has none.

The leader periodically saves the materialised table with the channel position it covers; a
starting sidecar restores the newest one and replays only the channel after that position, and
ends with exactly the table a full replay gives (the table's position check makes the overlap
harmless). :class:`CheckpointDuty` is the leader duty that saves them.
"""

from __future__ import annotations

import asyncio
import json
import logging

from lbd.core.errors import InvalidInputError
from lbd.core.table import ChannelPosition, StateTable
from lbd.ports.checkpoint import CheckpointStore, CorruptCheckpointError, StoredCheckpoint
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.services.channel.follower import ChannelFollower

_log = logging.getLogger(__name__)


def encode(table: StateTable, leader_term: int) -> StoredCheckpoint | None:
    """The table as a checkpoint; None for a table that has applied nothing yet."""
    position = table.last_position
    if position is None:
        return None
    return StoredCheckpoint(position, leader_term, _serialise(table.snapshot()))


def _serialise(snapshot: dict[str, object]) -> bytes:
    return json.dumps(snapshot, separators=(",", ":")).encode()


def decode(checkpoint: StoredCheckpoint) -> StateTable:
    """The table a checkpoint holds; raises InvalidInputError when the body is not one."""
    try:
        table = StateTable.from_snapshot(json.loads(checkpoint.body))
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidInputError(f"checkpoint at {checkpoint.position} is unreadable: {e}") from e
    if table.last_position != checkpoint.position:
        raise InvalidInputError(
            f"checkpoint says it covers {checkpoint.position} but its table is at "
            f"{table.last_position}"
        )
    return table


async def save(
    store: CheckpointStore, table: StateTable, leader_term: int
) -> ChannelPosition | None:
    """Save the table as the newest checkpoint; the position saved, or None when refused/empty."""
    position = table.last_position
    if position is None:
        return None
    # The snapshot is taken here, at one position; making it JSON-able and serialising
    # megabytes of it would stall the event loop, so that part runs in a thread (on a copy of
    # the table's values, which are immutable).
    make = table.snapshot_later()
    body = await asyncio.to_thread(lambda: _serialise(make()))
    checkpoint = StoredCheckpoint(position, leader_term, body)
    if not await store.save(checkpoint):
        _log.info(
            "checkpoint at %s (term %d) refused: a newer one is stored",
            checkpoint.position,
            leader_term,
        )
        return None
    _log.info(
        "checkpoint saved at %s with %d bundles (term %d, %d bytes)",
        checkpoint.position,
        len(table),
        leader_term,
        len(checkpoint.body),
    )
    return checkpoint.position


async def restore(store: CheckpointStore) -> StateTable:
    """The newest checkpoint's table, or an empty table when there is none or it is unreadable.

    An unreadable checkpoint is logged and ignored: a full replay is slower but always right.
    Raises :class:`~lbd.ports.errors.UnavailableError` when the store cannot be reached.
    """
    try:
        checkpoint = await store.load()
        if checkpoint is None:
            return StateTable()
        table = await asyncio.to_thread(decode, checkpoint)
    except (InvalidInputError, CorruptCheckpointError) as e:
        _log.error("ignoring the stored checkpoint, replaying the whole channel: %s", e)
        return StateTable()
    _log.info("restored checkpoint at %s with %d bundles", checkpoint.position, len(table))
    return table


class CheckpointDuty:
    """The leader duty that saves the channel table every ``interval_s`` under its term."""

    name = "checkpoints"
    """The leader duty's name."""

    def __init__(
        self, store: CheckpointStore, follower: ChannelFollower, clock: Clock, *, interval_s: float
    ) -> None:
        self._store = store
        self._follower = follower
        self._clock = clock
        self._interval_s = interval_s

    async def run_leading(self, term: int) -> None:
        """Save a checkpoint every interval until cancelled."""
        while True:
            await self._clock.sleep(self._interval_s)
            if self._follower.table.highest_term > term:
                continue  # deposed: the store would refuse it anyway
            try:
                await save(self._store, self._follower.table, term)
            except UnavailableError as e:
                _log.warning("checkpoint not saved: %s", e)
