"""The maintenance view: which brokers are cordoned, draining or decommissioned.

The records live in the metadata store (``maintenance/<broker>``, :mod:`lbd.core.maintenance`),
outside any session lease, so a cordon survives restarts and leader changes and every sidecar
reads the same. Like the registry, the view lists them once at start and then follows the
store's watch, so reading it costs nothing: the assigner asks it on every choice.

Writes (:meth:`MaintenanceView.set`, :meth:`MaintenanceView.clear`) may come from any sidecar
(the Admin calls Cordon and Uncordon) or from the leader (a drain's progress). A write is known
here at once; the watch events older than this sidecar's own last write of a broker's record
are skipped, so the view never goes back to a value it already overwrote. Two operators racing
on one broker's record end with the last write. The leader writes a drain's progress only over
the record it read (``set(..., over=mode)``, a compare-and-swap on the record's revision): an
Uncordon made on another sidecar as the drain ends is not undone by the drain's "cordoned" (see
:mod:`lbd.services.leader.drain`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from lbd.core.errors import InvalidInputError, PreconditionError
from lbd.core.ids import BrokerId
from lbd.core.maintenance import MaintenanceMode, MaintenanceRecord
from lbd.ports.clock import Clock
from lbd.ports.errors import CasConflictError
from lbd.ports.metadata import MetadataStore
from lbd.tasks import Component, Tasks

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MaintenanceChange:
    """A broker's record as the watch delivered it (None: cleared, the broker is in service)."""

    broker: BrokerId
    record: MaintenanceRecord | None


class MaintenanceView(Component):
    """Every broker's maintenance record, kept up to date from the store."""

    def __init__(self, metadata: MetadataStore, clock: Clock, me: BrokerId) -> None:
        """``me`` is this sidecar's broker: the ``who`` of the records it writes."""
        self._metadata = metadata
        self._clock = clock
        self._me = me
        self._records: dict[BrokerId, MaintenanceRecord] = {}
        self._written: dict[BrokerId, int] = {}
        """The store revision of this sidecar's last write of each broker's record."""
        self._revision: dict[BrokerId, int] = {}
        """The mod revision of each record as this view holds it."""
        self._subscribers: set[asyncio.Queue[MaintenanceChange]] = set()
        self._tasks = Tasks(f"the maintenance view of {me}")

    async def start(self) -> None:
        """List the records and start following them (UnavailableError when the store cannot
        be reached)."""
        if self._tasks:
            return
        listed, revision = await self._metadata.list_maintenance()
        for broker, (raw, mod_revision) in listed.items():
            record = _decode(broker, raw)
            if record is not None:
                self._records[broker] = record
                self._revision[broker] = mod_revision
        if self._records:
            _log.info(
                "maintenance: %s",
                ", ".join(f"{b} {r.describe()}" for b, r in sorted(self._records.items())),
            )
        self._tasks.spawn(self._follow(revision), name="maintenance-view")

    async def close(self) -> None:
        """Stop following. Idempotent."""
        await self._tasks.close()

    # -- reading ----------------------------------------------------------------------------

    def records(self) -> Mapping[BrokerId, MaintenanceRecord]:
        """Every broker's record (a read-only snapshot)."""
        return MappingProxyType(dict(self._records))

    def get(self, broker: BrokerId) -> MaintenanceRecord | None:
        """``broker``'s record, or None while it is in service."""
        return self._records.get(broker)

    def mode(self, broker: BrokerId) -> MaintenanceMode | None:
        """``broker``'s mode, or None while it is in service."""
        record = self._records.get(broker)
        return None if record is None else record.mode

    def cordoned(self) -> frozenset[BrokerId]:
        """The brokers no new bundle may go to: every mode cordons."""
        return frozenset(self._records)

    def refuse_cordoned(self, broker: BrokerId, action: str) -> None:
        """Raise PreconditionError naming the cordon when ``broker`` is cordoned; ``action`` says
        what was refused (``transfer of t/ns/0x.._0x.. to broker-2``)."""
        record = self._records.get(broker)
        if record is not None:
            raise PreconditionError(
                f"{action} refused: broker {broker} is {record.describe()}; no new bundle goes "
                f"to it until it is uncordoned"
            )

    def changes(self) -> AsyncGenerator[MaintenanceChange, None]:
        """Every change the watch delivers from the moment of this call on (this sidecar's own
        writes included, once the store echoes them)."""
        queue: asyncio.Queue[MaintenanceChange] = asyncio.Queue()
        self._subscribers.add(queue)
        return self._drain(queue)

    # -- writing ----------------------------------------------------------------------------

    async def set(
        self,
        broker: BrokerId,
        mode: MaintenanceMode,
        reason: str = "",
        *,
        over: MaintenanceMode | None = None,
    ) -> MaintenanceRecord:
        """Write ``broker``'s record in ``mode`` (an empty ``reason`` keeps the old one); the
        record, known here at once. With ``over``, only over the record this view holds, in that
        mode, and only while the store still has it (PreconditionError naming the record else:
        it was cleared or rewritten meanwhile, maybe on another sidecar). UnavailableError when
        the store cannot be reached."""
        old = self._records.get(broker)
        expected: int | None = None
        if over is not None:
            if old is None or old.mode is not over:
                now = "in service" if old is None else old.describe()
                raise PreconditionError(f"{broker} is {now}, not {over.value}: not changing it")
            expected = self._revision.get(broker)
        record = MaintenanceRecord(
            broker,
            mode,
            reason or ("" if old is None else old.reason),
            since_ms=old.since_ms if old is not None and old.mode is mode else self._clock.now_ms(),
            who=self._me,
        )
        try:
            written = await self._metadata.put_maintenance(broker, record.to_json(), expected)
        except CasConflictError:
            raise PreconditionError(
                f"{broker}'s maintenance record changed in the store since it was read as "
                f"{over}: not changing it"
            ) from None
        self._written[broker] = self._revision[broker] = written
        if old is None or old.mode is not mode:
            _log.info("maintenance: %s is now %s", broker, record.describe())
        self._records[broker] = record
        return record

    async def clear(self, broker: BrokerId) -> None:
        """Remove ``broker``'s record: back in service. Idempotent."""
        self._written[broker] = await self._metadata.delete_maintenance(broker)
        self._revision.pop(broker, None)
        if self._records.pop(broker, None) is not None:
            _log.info("maintenance: %s is back in service", broker)

    # -- following --------------------------------------------------------------------------

    async def _drain(
        self, queue: asyncio.Queue[MaintenanceChange]
    ) -> AsyncGenerator[MaintenanceChange, None]:
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers.discard(queue)

    async def _follow(self, revision: int) -> None:
        async for event in self._metadata.watch_maintenance(revision):
            if event.revision < self._written.get(event.broker, 0):
                continue  # older than our own write, which is known here already
            record = None if event.value is None else _decode(event.broker, event.value)
            if record is None:
                self._records.pop(event.broker, None)
                self._revision.pop(event.broker, None)
            else:
                self._records[event.broker] = record
                self._revision[event.broker] = event.revision
            change = MaintenanceChange(event.broker, record)
            for queue in self._subscribers:
                queue.put_nowait(change)


def _decode(broker: BrokerId, raw: bytes) -> MaintenanceRecord | None:
    """The record of ``broker``, or None (logged) when it is unreadable.

    An unreadable record counts as none: a broker is kept out of service only by a record that
    says so."""
    try:
        return MaintenanceRecord.from_json(broker, raw)
    except InvalidInputError as e:
        _log.warning("ignoring the unreadable maintenance record of %s: %s", broker, e)
        return None
