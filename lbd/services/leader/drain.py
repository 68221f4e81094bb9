"""Broker maintenance: cordon, uncordon, drain and decommission (docs/operating.md).

- **Cordon** writes the broker's maintenance record (:mod:`lbd.core.maintenance`): from then on
  no new bundle goes to it (the assigner, the shedder's destinations and a drain's choice all
  skip cordoned brokers). Any sidecar may do it: the record is in the metadata store.
- **Drain** (on the leader) cordons the broker in mode ``draining`` and starts a DRAIN operation
  of the :class:`~lbd.services.leader.tracker.OperationTracker`: one move per bundle the broker
  owns, each to a destination the tracker picks, each under the execution governor. When a round
  of moves has finished, the operation is refilled with what the broker still owns (a bundle that
  was in flight to it when the cordon landed, a split's children), after waiting for what is
  still in flight at it; it succeeds once the broker owns nothing and nothing is moving at it,
  and the record becomes ``cordoned`` again (drained, still kept empty). It fails after
  :data:`MAX_IDLE_ROUNDS` rounds in a row that moved nothing.
- **Decommission** is a drain in mode ``decommissioning`` whose end writes ``decommissioned``:
  the broker's own sidecar then deregisters its broker and keeps it deregistered
  (:mod:`lbd.services.sidecar.registration`); the operation succeeds once the registry shows it
  gone.
- **Uncordon** removes the record (on any sidecar) and stops a drain or decommission in progress:
  directly when this sidecar leads, else when the leader's duty sees the record go.

As a leader duty (:meth:`Drainer.run_leading`), a new leader resumes every drain and
decommission the records ask for: operations live in the leader's memory, the records in the
store.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import cast

from lbd.core.errors import DeadlineError, NotFoundError, PreconditionError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.maintenance import MaintenanceMode, MaintenanceRecord
from lbd.core.operations import Move, MoveState, Operation, OperationKind, OperationState
from lbd.core.state import ServiceUnitStateData
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.ports.metadata import RegistryEvent
from lbd.services.channel.deadlines import within
from lbd.services.channel.follower import ChannelFollower
from lbd.services.channel.proposals import Predicate, Proposer
from lbd.services.cluster.maintenance_view import MaintenanceView
from lbd.services.cluster.registry import BrokerRegistry
from lbd.services.leader.tracker import OperationTracker

_log = logging.getLogger(__name__)

_M = MaintenanceMode

DRAIN_REASON = "Drain"
"""The reason of every move a drain or decommission makes."""

MAX_IDLE_ROUNDS = 5
"""A drain gives up after this many rounds in a row in which no move got done."""

_KINDS = {_M.DRAINING: OperationKind.DRAIN, _M.DECOMMISSIONING: OperationKind.DECOMMISSION}


@dataclass(slots=True)
class _Progress:
    """How a drain is going, between rounds of moves."""

    broker: BrokerId
    round_start: int = 0
    """Index in the operation's moves where the latest round began."""
    idle_rounds: int = 0
    """Rounds in a row that got no move done (or waits for a bundle in flight that timed out)."""


class Drainer:
    """Cordons, uncordons, drains and decommissions brokers; as the leader duty ``drains``,
    resumes what the maintenance records ask for."""

    name = "drains"

    def __init__(
        self,
        me: BrokerId,
        *,
        maintenance: MaintenanceView,
        registry: BrokerRegistry,
        follower: ChannelFollower,
        proposer: Proposer,
        tracker: OperationTracker,
        clock: Clock,
        settle_timeout_s: float,
        retry_s: float,
    ) -> None:
        """``settle_timeout_s`` bounds each wait for a bundle in flight at the broker and for
        a decommissioned broker's deregistration; ``retry_s`` is the pause after a round of
        moves that got nothing done."""
        self._me = me
        self._maintenance = maintenance
        self._registry = registry
        self._follower = follower
        self._proposer = proposer
        self._tracker = tracker
        self._clock = clock
        self._settle_timeout_s = settle_timeout_s
        self._retry_s = retry_s

    # -- on any sidecar ---------------------------------------------------------------------

    async def cordon(self, broker: BrokerId, reason: str = "") -> MaintenanceRecord:
        """Keep new bundles off ``broker``; its record. A broker already in maintenance keeps
        its mode (a cordon never stops a drain); a ``reason`` replaces the old one."""
        self._known(broker)
        record = self._maintenance.get(broker)
        if record is not None and not reason:
            return record
        mode = _M.CORDONED if record is None else record.mode
        return await self._maintenance.set(broker, mode, reason)

    async def uncordon(self, broker: BrokerId) -> None:
        """Put ``broker`` back in service; a drain or decommission of it stops (moves in flight
        finish). A decommissioned broker's sidecar registers it again."""
        self._known(broker)
        await self._maintenance.clear(broker)
        self._stop(broker)

    # -- on the leader ------------------------------------------------------------------------

    async def drain(self, broker: BrokerId) -> Operation:
        """Cordon ``broker`` and move every bundle off it; the operation (it changes).

        A drain already running is returned as is. NotFoundError for an unknown broker,
        PreconditionError when no other broker can take its bundles or it is (being)
        decommissioned.
        """
        return await self._start(broker, _M.DRAINING)

    async def decommission(self, broker: BrokerId) -> Operation:
        """Drain ``broker``, then have it deregistered for good (until uncordoned); the
        operation. A drain running takes this one's place (it is cancelled; its moves in flight
        finish and the decommission moves what is left)."""
        return await self._start(broker, _M.DECOMMISSIONING)

    async def run_leading(self, term: int) -> None:
        """Resume every drain and decommission the records ask for, then follow the records:
        one written elsewhere is resumed, one cleared stops its operation."""
        changes = self._maintenance.changes()  # subscribed before reading the records
        async with contextlib.aclosing(changes):
            for record in self._maintenance.records().values():
                self._resume(record)
            async for change in changes:
                if change.record is None:
                    self._stop(change.broker)
                else:
                    self._resume(change.record)

    # -- drains -----------------------------------------------------------------------------

    async def _start(self, broker: BrokerId, mode: MaintenanceMode) -> Operation:
        self._known(broker)
        kind = _KINDS[mode]
        running = self._running(broker)
        if running is not None and running.kind is kind:
            return running
        record = self._maintenance.get(broker)
        if record is not None and record.mode is _M.DECOMMISSIONED:
            raise PreconditionError(
                f"broker {broker} is {record.describe()}; uncordon it to bring it back first"
            )
        if mode is _M.DRAINING and record is not None and record.mode is _M.DECOMMISSIONING:
            raise PreconditionError(
                f"broker {broker} is {record.describe()}; uncordon it to stop that first"
            )
        self._others(broker)
        await self._maintenance.set(broker, mode, kind.value if record is None else "")
        running = self._running(broker)
        if running is not None:
            if running.kind is kind:
                return running  # the duty resumed it from the record meanwhile
            _log.info("%s of %s: the %s %s stops", kind, broker, running.kind, running.id)
            self._tracker.cancel(running.id)
        return self._launch(broker, kind)

    def _resume(self, record: MaintenanceRecord) -> None:
        kind = _KINDS.get(record.mode)
        if kind is None or self._running(record.broker) is not None:
            return
        _log.info("resuming the %s of %s (%s)", kind, record.broker, record.describe())
        try:
            self._launch(record.broker, kind)
        except UnavailableError as e:  # leadership ending as the record changed
            _log.warning("the %s of %s is not resumed here: %s", kind, record.broker, e)

    def _stop(self, broker: BrokerId) -> None:
        running = self._running(broker)
        if running is not None:
            _log.info("%s is uncordoned: its %s %s stops", broker, running.kind, running.id)
            self._tracker.cancel(running.id)

    def _launch(self, broker: BrokerId, kind: OperationKind) -> Operation:
        progress = _Progress(broker)

        async def refill(op: Operation) -> list[Move]:
            return await self._refill(op, progress)

        async def finish(op: Operation) -> None:
            await self._finish(op, broker)

        return self._tracker.start_operation(
            kind,
            f"{kind} {broker}",
            self._moves(broker),
            broker=broker,
            refill=refill,
            finish=finish,
        )

    def _moves(self, broker: BrokerId) -> list[Move]:
        owned = sorted(b for b, owner in self._follower.table.owners().items() if owner == broker)
        return [Move(bundle, broker, None, DRAIN_REASON) for bundle in owned]

    def _in_flight_at(self, broker: BrokerId) -> list[BundleId]:
        """Bundles in flight to or from ``broker``: they may yet end up Owned by it."""
        return sorted(
            bundle
            for bundle, value in self._follower.table.items()
            if value.state.is_in_flight and broker in (value.dst_broker, value.source_broker)
        )

    async def _refill(self, op: Operation, progress: _Progress) -> list[Move]:
        """The next round: what the broker owns now, after what is in flight at it settled;
        none once it is empty."""
        broker = progress.broker
        latest = op.moves[progress.round_start :]
        if any(m.state is MoveState.DONE for m in latest):
            progress.idle_rounds = 0
        elif latest:
            progress.idle_rounds += 1
        while op.state is OperationState.RUNNING:
            if progress.idle_rounds >= MAX_IDLE_ROUNDS:
                raise PreconditionError(
                    f"{op.kind} of {broker} gave up: {progress.idle_rounds} rounds in a row moved "
                    f"nothing, {len(self._moves(broker))} bundle(s) still on it"
                    + _first_error(latest)
                )
            if progress.idle_rounds:
                await self._clock.sleep(self._retry_s)
            moves = self._moves(broker)
            if moves:
                progress.round_start = len(op.moves)
                _log.info("%s %s: %d more bundle(s) to move", op.kind, op.id, len(moves))
                return moves
            moving = self._in_flight_at(broker)
            if not moving:
                return []
            try:
                await self._proposer.settle(
                    moving[0], _not_in_flight_at(broker), self._settle_timeout_s
                )
            except DeadlineError as e:
                progress.idle_rounds += 1
                latest = []
                _log.info("%s %s: %s", op.kind, op.id, e)
        return []  # cancelled meanwhile: no new move starts

    async def _finish(self, op: Operation, broker: BrokerId) -> None:
        """The broker is empty: a drain leaves it cordoned; a decommission deregisters it."""
        record = self._maintenance.get(broker)
        expected = _M.DRAINING if op.kind is OperationKind.DRAIN else _M.DECOMMISSIONING
        if record is None or record.mode is not expected:
            now = "in service" if record is None else record.describe()
            raise PreconditionError(
                f"{broker} is empty, but its maintenance record changed meanwhile (it is {now} "
                "now): not changing it"
            )
        # Only over the record read here: an Uncordon on another sidecar may have cleared it
        # since, and this view not seen it yet (a compare-and-swap on its revision).
        if op.kind is OperationKind.DRAIN:
            # A broker's own leave keeps its reason: the broker's return clears the record.
            reason = "" if record.leave else f"drained by {op.id}"
            await self._maintenance.set(broker, _M.CORDONED, reason, over=expected)
            return
        await self._maintenance.set(
            broker, _M.DECOMMISSIONED, f"decommissioned by {op.id}", over=expected
        )
        try:
            await within(
                self._clock,
                self._settle_timeout_s,
                self._deregistered(broker),
                f"the deregistration of {broker}",
            )
        except DeadlineError:
            raise PreconditionError(
                f"{broker} is empty and decommissioned, but still registered after "
                f"{self._settle_timeout_s:g}s: its sidecar did not deregister it"
            ) from None
        _log.info("%s is decommissioned: empty and deregistered", broker)

    async def _deregistered(self, broker: BrokerId) -> None:
        changes = cast(AsyncGenerator[RegistryEvent, None], self._registry.changes())
        async with contextlib.aclosing(changes):
            if self._registry.get(broker) is None:
                return
            async for event in changes:
                if event.broker == broker and event.value is None:
                    return

    # -- checks -----------------------------------------------------------------------------

    def _running(self, broker: BrokerId) -> Operation | None:
        """The drain or decommission of ``broker`` this sidecar runs, if any."""
        return next(
            (
                op
                for op in self._tracker.active()
                # One being cancelled is on its way out: a new drain may start beside it.
                if op.broker == broker
                and op.kind in _KINDS.values()
                and op.state is OperationState.RUNNING
            ),
            None,
        )

    def _known(self, broker: BrokerId) -> None:
        if not broker:
            raise NotFoundError("no broker named: give a broker id")
        if (
            self._registry.get(broker) is None
            and self._maintenance.get(broker) is None
            and broker not in self._follower.table.holders().values()
        ):
            raise NotFoundError(
                f"broker {broker} is not registered, holds no bundle and has no maintenance record"
            )

    def _others(self, broker: BrokerId) -> None:
        """PreconditionError unless some other registered broker may take bundles."""
        if not self._registry.reachable:
            raise UnavailableError(
                f"metadata store unreachable (safe mode): cannot drain {broker} now"
            )
        others = sorted(b for b in self._registry.brokers() if b != broker)
        cordoned = self._maintenance.cordoned()
        if not [b for b in others if b not in cordoned]:
            why = (
                "it is the only registered broker"
                if not others
                else f"every other broker is cordoned ({', '.join(others)})"
            )
            raise PreconditionError(
                f"cannot drain {broker}: no other broker can take its bundles ({why})"
            )


def _not_in_flight_at(broker: BrokerId) -> Predicate:
    def settled(value: ServiceUnitStateData | None) -> bool:
        return (
            value is None
            or not value.state.is_in_flight
            or broker not in (value.dst_broker, value.source_broker)
        )

    return settled


def _first_error(moves: list[Move]) -> str:
    failed = next((m for m in moves if m.error), None)
    return "" if failed is None else f"; last round's first error: {failed.error}"
