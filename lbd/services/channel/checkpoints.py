"""Checkpoints of the channel table: lbd's own compaction of a channel that has none.

The leader periodically saves the materialised table with the channel position it covers; a
starting sidecar restores the newest one and replays only the channel after that position, and
ends with exactly the table a full replay gives (the table's position check makes the overlap
harmless). :class:`CheckpointDuty` is the leader duty that saves them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging

from lbd.core.errors import InvalidInputError
from lbd.core.state import to_json_object
from lbd.core.table import ChannelPosition, StateTable
from lbd.ports.checkpoint import CheckpointStore, CorruptCheckpointError, StoredCheckpoint
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.services.channel.follower import ChannelFollower
from lbd.tasks import yield_now

_log = logging.getLogger(__name__)


def encode(table: StateTable, leader_term: int) -> StoredCheckpoint | None:
    """The table as a checkpoint; None for a table that has applied nothing yet."""
    position = table.last_position
    if position is None:
        return None
    return StoredCheckpoint(position, leader_term, _serialise(table.snapshot()))


_SEPARATORS = (",", ":")
SERIALISE_SLICE = 1_000
"""Table entries serialised per turn of the event loop when a checkpoint is saved. At 100k
bundles, serialising the whole table at once held the event loop for 300 to 450 ms: in a thread
too, for ``json.dumps`` holds the interpreter lock for as long as it runs."""


def _serialise(snapshot: dict[str, object]) -> bytes:
    return json.dumps(snapshot, separators=_SEPARATORS).encode()


async def serialised(table: StateTable) -> bytes:
    """The bytes :func:`encode` would store for ``table`` as it is now, made
    :data:`SERIALISE_SLICE` entries at a time with the event loop let run in between.

    Each entry is serialised on its own, from a JSON-able value that is dropped at once: a
    table's worth of them alive together set off a full collection of the heap (117 ms at 100k
    bundles) on top of the serialising.
    """
    head, values = table.snapshot_source()
    # ``table`` is the head's last field, empty: its entries go in before the two closing braces.
    opening = json.dumps(head, separators=_SEPARATORS)[: -len("}}")].encode()
    entries = iter(values.items())
    pieces: list[bytes] = []
    while piece := ",".join(
        f"{json.dumps(bundle)}:{json.dumps(to_json_object(data), separators=_SEPARATORS)}"
        for bundle, data in itertools.islice(entries, SERIALISE_SLICE)
    ):
        pieces.append((f",{piece}" if pieces else piece).encode())
        await yield_now()
    return b"".join((opening, *pieces, b"}}"))  # one copy of the megabytes, not one per +


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
    # The snapshot is taken at one position (the values are copied at once, before any turn of
    # the event loop); making it JSON and serialising megabytes of it goes a slice at a time.
    body = await serialised(table)
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
