"""The execution governor: every move of a bundle waits here for a slot (docs/operating.md).

A move asks :meth:`ExecutionGovernor.admit` for a slot before its first write; the call waits,
first come first served within each budget, until the budget's limits (:mod:`lbd.core.admission`)
let it start. The slot is held until the channel shows the bundle settled again (no longer
Releasing or Assigning) after the move's first write, so "in flight" means in flight in the
table, not "in some caller's code". The governor follows the channel's changes for that, and
measures on the way each transfer's unavailability: from the ``Assigning`` its source wrote
right after the broker acknowledged the Release to the ``Owned`` its destination wrote right
after the Own acknowledgement (the writers' clocks; docs/operating.md says what that bounds).

Gauges ``lbd_governor_moves_queued`` and ``lbd_governor_moves_in_flight`` (per budget) and the
counter ``lbd_governor_moves_started_total`` show it at work.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from lbd.core.admission import Governor, MoveKind, Ticket
from lbd.core.ids import BundleId
from lbd.core.settings import GovernorConfig
from lbd.core.state import ServiceUnitState, ServiceUnitStateData
from lbd.core.table import ApplyResult
from lbd.metrics import Metrics
from lbd.ports.clock import Clock
from lbd.services.channel.follower import ChannelFollower
from lbd.tasks import Component, Tasks, cancel_and_wait, guard

_log = logging.getLogger(__name__)

_S = ServiceUnitState

SCAN_LIMIT = 1024
"""Waiters looked at per dispatch: past it, a waiter waits for those before it to move."""

STALE_SLOT_S = 600.0
"""A slot whose bundle never settles is given back after this (the monitor fixes a stuck bundle
within its in-flight timeout; this only keeps a lost slot from shrinking the budget forever)."""


@dataclass(frozen=True, slots=True)
class Settled:
    """How a move's bundle settled."""

    value: ServiceUnitStateData | None
    """Its value once no longer in flight (None: tombstoned)."""
    unavailable_ms: float | None
    """Release ack to Own ack of a transfer; None when the move was not a transfer that
    completed (or the Assigning step was not seen)."""


class Slot:
    """A move's place in the governor, from admission until its bundle settles."""

    def __init__(self, governor: ExecutionGovernor, ticket: Ticket, seen_version: int) -> None:
        self.ticket = ticket
        self._governor = governor
        self._seen_version = seen_version
        self._assigning_ms: int | None = None
        self._settled: asyncio.Future[Settled] = asyncio.get_running_loop().create_future()
        self.admitted_at = governor.clock.monotonic()

    async def settled(self) -> Settled:
        """Wait until the bundle settles after the move's first write (bound it with a timeout:
        the slot stays held until the bundle settles, whatever the caller waits)."""
        return await asyncio.shield(self._settled)

    def release(self) -> None:
        """Give the slot back now: the move wrote nothing (it was skipped or cancelled)."""
        self._governor.give_back(self.ticket.bundle, self)

    def _observe(self, new: ServiceUnitStateData | None) -> bool:
        """Note a change of the bundle; True once it settled after the move's first write."""
        if new is not None and new.version_id <= self._seen_version:
            return False
        if new is not None and new.state is _S.Assigning:
            if new.source_broker is not None and not new.force:
                self._assigning_ms = new.timestamp_ms
            return False
        if new is not None and new.state.is_in_flight:
            return False
        unavailable: float | None = None
        if (
            new is not None
            and new.state is _S.Owned
            and self._assigning_ms
            and new.timestamp_ms
            and new.source_broker is not None
        ):
            unavailable = float(max(0, new.timestamp_ms - self._assigning_ms))
        if not self._settled.done():
            self._settled.set_result(Settled(new, unavailable))
        return True


class ExecutionGovernor(Component):
    """Admits moves under the budgets, holds their slots until their bundles settle."""

    def __init__(
        self,
        follower: ChannelFollower,
        clock: Clock,
        config: GovernorConfig,
        *,
        metrics: Metrics,
    ) -> None:
        self._follower = follower
        self.clock = clock
        self._books = Governor(config)
        self._metrics = metrics
        self._slots: dict[BundleId, Slot] = {}
        self._queues: dict[MoveKind, deque[tuple[Ticket, asyncio.Future[Slot]]]] = {
            k: deque() for k in MoveKind
        }
        self._timers: dict[MoveKind, asyncio.Task[None] | None] = dict.fromkeys(MoveKind)
        self._tasks = Tasks("the execution governor")
        self._freed: dict[MoveKind, asyncio.Event] = {k: asyncio.Event() for k in MoveKind}
        """Set (and replaced) whenever a slot of the kind is given back."""
        for kind in MoveKind:
            # Read when scraped, not set on every move: a repair admits thousands a second.
            metrics.governor_queued_series(kind.value).set_function(
                functools.partial(len, self._queues[kind])
            )
            metrics.governor_in_flight_series(kind.value).set_function(
                functools.partial(self._books.in_flight, kind)
            )

    async def start(self) -> None:
        """Start following the channel (slots are given back as their bundles settle)."""
        if self._tasks:
            return
        self._tasks.spawn(self._follow(self._follower.changes()), name="execution-governor")
        self._tasks.spawn(self._sweep_stale(), name="execution-governor-sweep")

    async def close(self) -> None:
        """Stop following; every waiter is cancelled. Idempotent."""
        await self._tasks.close()
        for timer in list(self._timers.values()):
            await cancel_and_wait(timer)
        for queue in self._queues.values():
            for _, waiter in queue:
                waiter.cancel()
            queue.clear()

    # -- admission ----------------------------------------------------------------------------

    async def admit(self, ticket: Ticket) -> Slot:
        """Wait for a slot for ``ticket`` (cancel the caller to stop waiting).

        Waiters are admitted in order, except that one blocked by a per-broker limit lets later
        ones pass (only the first :data:`SCAN_LIMIT` waiters are looked at per change). The
        bundle's value at admission is the one the move starts from: changes at or below its
        version do not settle the slot.
        """
        queue = self._queues[ticket.kind]
        if self._books.may_start(ticket, self.clock.monotonic()):
            # Nobody waiting can be let in now (each change lets in whom it can): letting this
            # one in does not pass anyone who could start.
            return self._take(ticket)
        waiter: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        entry = (ticket, waiter)
        queue.append(entry)
        if self._books.retry_after_s(ticket.kind, self.clock.monotonic()) is not None:
            self._retry_later(ticket.kind)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                waiter.result().release()  # admitted as the caller gave up: not used
            elif entry in queue:
                queue.remove(entry)
            raise

    def try_admit(self, ticket: Ticket) -> Slot | None:
        """A slot at once if nobody waits in the budget and its limits allow; else None."""
        if self._queues[ticket.kind]:
            return None
        if not self._books.try_start(ticket, self.clock.monotonic()):
            return None  # asked for every orphan a sweep holds back: no explanation built
        return self._slot(ticket)

    def _take(self, ticket: Ticket) -> Slot:
        self._books.start(ticket, self.clock.monotonic())
        return self._slot(ticket)

    def _slot(self, ticket: Ticket) -> Slot:
        """The slot of ``ticket``, whose move the books have just started."""
        value = self._follower.get(ticket.bundle)
        slot = Slot(self, ticket, 0 if value is None else value.version_id)
        self._slots[ticket.bundle] = slot
        self._metrics.governor_started_series(ticket.kind.value).inc()
        return slot

    def _dispatch(self, kind: MoveKind) -> None:
        """Admit every waiter of ``kind`` the limits allow now, in order."""
        queue = self._queues[kind]
        budget = self._books.budget(kind)
        admitted = []
        for index, (ticket, waiter) in enumerate(queue):
            if index >= SCAN_LIMIT:
                break
            if waiter.done():
                continue
            if budget.cluster and self._books.in_flight(kind) >= budget.cluster:
                break
            if self._books.may_start(ticket, self.clock.monotonic()):
                waiter.set_result(self._take(ticket))
                admitted.append((ticket, waiter))
            elif self._books.retry_after_s(kind, self.clock.monotonic()) is not None:
                self._retry_later(kind)
                break
        for entry in admitted:
            queue.remove(entry)

    def _retry_later(self, kind: MoveKind) -> None:
        """Dispatch ``kind`` again once its rate window lets one more move start."""
        if self._timers.get(kind) is not None:
            return
        delay = self._books.retry_after_s(kind, self.clock.monotonic()) or 0.0

        async def later() -> None:
            try:
                await self.clock.sleep(delay + 0.001)
            finally:
                self._timers[kind] = None
            self._dispatch(kind)

        self._timers[kind] = guard(later(), name=f"governor-rate-{kind.value}")

    # -- giving back --------------------------------------------------------------------------

    def give_back(self, bundle: BundleId, slot: Slot | None = None) -> None:
        """Free ``bundle``'s slot (only if it is ``slot``, when given; idempotent). Waiters of
        every budget are looked at again: one may have waited for this very bundle."""
        held = self._slots.get(bundle)
        if held is None or (slot is not None and held is not slot):
            return
        del self._slots[bundle]
        self._books.finish(bundle)
        freed = self._freed[held.ticket.kind]
        self._freed[held.ticket.kind] = asyncio.Event()
        freed.set()
        for kind in MoveKind:
            self._dispatch(kind)

    async def wait_in_flight_at_most(self, kind: MoveKind, limit: int) -> None:
        """Return once at most ``limit`` moves of ``kind`` hold a slot (bound it with a timeout)."""
        while self._books.in_flight(kind) > limit:
            await self._freed[kind].wait()

    def holds(self, bundle: BundleId) -> bool:
        """Whether ``bundle`` holds a slot."""
        return bundle in self._slots

    def in_flight(self, kind: MoveKind) -> int:
        """Moves of ``kind`` holding a slot."""
        return self._books.in_flight(kind)

    def queued(self, kind: MoveKind) -> int:
        """Moves of ``kind`` waiting for a slot."""
        return len(self._queues[kind])

    async def _follow(self, changes: AsyncGenerator[ApplyResult, None]) -> None:
        async with contextlib.aclosing(changes):
            async for change in changes:
                slot = self._slots.get(change.key)
                if slot is not None and slot._observe(change.new):
                    self.give_back(change.key, slot)

    async def _sweep_stale(self) -> None:
        while True:
            await self.clock.sleep(STALE_SLOT_S / 10)
            now = self.clock.monotonic()
            for bundle, slot in list(self._slots.items()):
                if now - slot.admitted_at > STALE_SLOT_S:
                    _log.warning("governor: %s never settled; its slot is given back", bundle)
                    self.give_back(bundle)
