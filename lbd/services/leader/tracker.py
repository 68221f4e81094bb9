"""The leader's operations: plans kept for execution, tracked batches of moves, and their executor.

Every move the leader makes of an Owned bundle (its shedding, a plan's execution, a drain, a
decommission, an admin Transfer or Unload) runs here, as one :class:`~lbd.core.operations.Move`
of an :class:`~lbd.core.operations.Operation`:

1. the destination is chosen if the move has none yet (a drain's: by the
   :class:`~lbd.services.cluster.assigner.Assigner`'s filters, never a cordoned broker, spread
   over the brokers this operation sent the fewest bundles to);
2. the move waits for a slot of the execution governor (balancing budget);
3. if the bundle is still Owned by the move's source, ``Releasing(dst, src)`` is proposed; the
   owners' sidecars do the rest (DESIGN §4), and the governor gives the slot back when the
   bundle has settled, with the transfer's unavailability;
4. the move ends DONE (the bundle is where it should be), SKIPPED (it moved or changed
   meanwhile; nothing was written), FAILED (with why) or CANCELLED (its operation was cancelled
   before it started).

Cancelling an operation stops scheduling: moves still waiting for the governor end CANCELLED,
moves in flight finish. An operation with a *refill* (a drain) asks it for more moves once its
moves have finished, and ends when there are none (the broker is empty). Operations live in the
leader's memory: a new leader starts with none (a drain goes on, since the broker's maintenance
record says so; docs/operating.md).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass

from lbd.core.admission import MoveKind, Ticket
from lbd.core.errors import DeadlineError, LbdError, NotFoundError, PreconditionError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.operations import Move, MoveState, Operation, OperationKind, OperationState, Plan
from lbd.core.settings import OperationsConfig
from lbd.core.state import ServiceUnitState, owner_of, state_of
from lbd.metrics import ADMIN_REASON, FAILURE, SUCCESS, Metrics
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.ports.history import HistoryRecorder
from lbd.services.channel.follower import ChannelFollower
from lbd.services.channel.proposals import Proposer
from lbd.services.cluster.assigner import Assigner
from lbd.services.cluster.checks import RequestChecks
from lbd.services.cluster.registry import BrokerRegistry
from lbd.services.leader.decisions import DecisionLog
from lbd.services.leader.governor import ExecutionGovernor
from lbd.tasks import cancel_and_wait, guard

_log = logging.getLogger(__name__)

_S = ServiceUnitState

Refill = Callable[[Operation], Awaitable[list[Move]]]
"""More moves for an operation whose moves have all finished (none: it is done)."""
Finish = Callable[[Operation], Awaitable[None]]
"""What to do once an operation's moves all succeeded (a decommission deregisters)."""

SOURCES = {
    OperationKind.SHEDDING: "shedder",
    OperationKind.PLAN: "plan",
    OperationKind.DRAIN: "drain",
    OperationKind.DECOMMISSION: "drain",
    OperationKind.ADMIN: "admin",
}
"""The decision log's ``source`` of each kind of operation."""


@dataclass(slots=True)
class _Running:
    op: Operation
    refill: Refill | None
    finish: Finish | None
    task: asyncio.Task[None] | None = None
    moves: dict[int, asyncio.Task[None]] | None = None
    changed: asyncio.Event | None = None
    sent: collections.Counter[BrokerId] = dataclasses.field(default_factory=collections.Counter)
    """Destinations chosen so far by this operation (a drain spreads its bundles by it)."""
    failures: dict[int, LbdError] = dataclasses.field(default_factory=dict)
    """Why each failed move failed (by index), for the caller of an admin move."""
    waiting: set[int] = dataclasses.field(default_factory=set)
    """Moves (by index) choosing a destination or waiting for the governor: only these are
    cancelled; a move past them may have written already and is left to finish."""


class OperationTracker:
    """Keeps plans, runs operations under the governor and tracks them."""

    def __init__(
        self,
        me: BrokerId,
        *,
        follower: ChannelFollower,
        proposer: Proposer,
        registry: BrokerRegistry,
        checks: RequestChecks,
        assigner: Assigner,
        governor: ExecutionGovernor,
        clock: Clock,
        config: OperationsConfig,
        settle_timeout_s: float,
        decisions: DecisionLog,
        history: HistoryRecorder,
        metrics: Metrics,
        cordoned: Callable[[], Collection[BrokerId]] = lambda: (),
    ) -> None:
        """``cordoned()`` names the brokers no move may go to."""
        self._follower = follower
        self._proposer = proposer
        self._registry = registry
        self._checks = checks
        self._assigner = assigner
        self._governor = governor
        self._clock = clock
        self._config = config
        self._settle_timeout_s = settle_timeout_s
        self._decisions = decisions
        self._history = history
        self._metrics = metrics
        self._cordoned = cordoned
        self._ops: dict[str, _Running] = {}
        self._plans: dict[str, Plan] = {}
        self._ids = itertools.count(1)
        self._leading: int | None = None
        self._suffix = hashlib.blake2b(f"{me}@{clock.now_ms()}".encode(), digest_size=3).hexdigest()

    name = "operations"
    """The leader duty's name."""

    @property
    def leading(self) -> bool:
        """Whether this sidecar runs the leader duties now (operations may start)."""
        return self._leading is not None

    async def start(self) -> None:
        """Nothing to start: operations start when asked."""

    async def run_leading(self, term: int) -> None:
        """The leader duty: nothing while leading; when leadership ends, every operation still
        running is cancelled (its in-flight moves finish), so that a deposed leader schedules no
        move beside the new leader's governor."""
        self._leading = term
        try:
            await asyncio.Event().wait()
        finally:
            self._leading = None
            for op in self.active():
                op.error = op.error or f"this sidecar stopped leading (term {term})"
                self.cancel(op.id)

    async def close(self) -> None:
        """Stop every running operation (moves in flight are left to settle). Idempotent."""
        for running in list(self._ops.values()):
            for task in (running.moves or {}).values():
                await cancel_and_wait(task)
            await cancel_and_wait(running.task)

    # -- plans --------------------------------------------------------------------------------

    def keep_plan(self, plan: Plan) -> None:
        """Keep ``plan`` until it expires (expired ones are dropped on the way)."""
        now = self._clock.now_ms()
        self._plans = {i: p for i, p in self._plans.items() if p.expires_at_ms > now}
        self._plans[plan.id] = plan

    def plan(self, plan_id: str) -> Plan:
        """A kept plan; NotFoundError when unknown, PreconditionError when expired."""
        plan = self._plans.get(plan_id)
        if plan is None:
            raise NotFoundError(
                f"no plan {plan_id!r}: plans are kept by the leader that made them, until they "
                "expire (operations.plan_ttl_s); make a new one with `lbd ctl plan`"
            )
        if plan.expires_at_ms <= self._clock.now_ms():
            raise PreconditionError(
                f"plan {plan_id} expired: it rests on load data that is too old; make a new one"
            )
        return plan

    def take_plan(self, plan_id: str) -> Plan:
        """A kept plan, removed so that it runs once."""
        plan = self.plan(plan_id)
        del self._plans[plan_id]
        return plan

    def new_id(self, prefix: str) -> str:
        """A fresh id: unique within this sidecar, and unlikely to repeat across sidecars and
        restarts (a suffix of the sidecar and its start time; the same in a replayed
        simulation)."""
        return f"{prefix}-{next(self._ids)}-{self._suffix}"

    # -- operations ---------------------------------------------------------------------------

    def start_operation(
        self,
        kind: OperationKind,
        description: str,
        moves: list[Move],
        *,
        broker: BrokerId | None = None,
        plan_id: str | None = None,
        refill: Refill | None = None,
        finish: Finish | None = None,
    ) -> Operation:
        """Start an operation of ``moves`` in the background; the operation (it changes).

        Raises UnavailableError unless this sidecar runs the leader duties now: a deposed
        leader starts nothing beside the new leader's governor.
        """
        if self._leading is None:
            raise UnavailableError(
                "this sidecar no longer leads (or does not yet): retry, the call goes to the leader"
            )
        op = Operation(
            id=self.new_id(kind.value),
            kind=kind,
            description=description,
            created_at_ms=self._clock.now_ms(),
            moves=moves,
            broker=broker,
            plan_id=plan_id,
        )
        running = _Running(op, refill, finish, moves={}, changed=asyncio.Event())
        self._ops[op.id] = running
        self._forget_old()
        running.task = guard(self._run(running), name=f"operation-{op.id}")
        self._active_gauge()
        _log.info("operation %s started: %s, %d move(s)", op.id, description, len(moves))
        return op

    async def admin_move(self, bundle: BundleId, dst: BrokerId | None) -> BrokerId:
        """An admin Transfer (to ``dst``) or Unload (``dst`` None) of an Owned bundle, the one path
        every caller takes (the API, the simulated world): the request checked, then run as an
        admin operation of one move under the execution governor and waited for. Returns the
        bundle's source broker once the move is DONE.

        A bad request changes nothing (the errors of
        :class:`~lbd.services.cluster.checks.RequestChecks`). A move that did not complete
        raises PreconditionError naming the operation, or UnavailableError or DeadlineError when
        that is why it failed, so that a client knows to retry.
        """
        if dst is None:
            src, what = await self._checks.unload(bundle), f"unload of {bundle}"
        else:
            src = await self._checks.transfer(bundle, dst)
            what = f"transfer of {bundle} to {dst}"
        move = Move(bundle, src, dst, ADMIN_REASON)
        op = self.start_operation(OperationKind.ADMIN, f"{what} (from {src})", [move])
        op = await self.wait(op.id)
        done = op.moves[0]
        if done.state is MoveState.DONE:
            return src
        message = f"{what} did not complete ({done.state.value}): {done.error} (operation {op.id})"
        cause = self.failure(op.id)
        if isinstance(cause, UnavailableError):
            raise UnavailableError(message)
        if isinstance(cause, DeadlineError):
            raise DeadlineError(message)
        raise PreconditionError(message)

    def get(self, op_id: str) -> Operation:
        """The operation ``op_id``; NotFoundError when this leader does not know it."""
        running = self._ops.get(op_id)
        if running is None:
            raise NotFoundError(
                f"no operation {op_id!r} on this leader (a new leader knows only the operations "
                "started since it leads; finished ones are kept up to operations.keep_finished)"
            )
        return running.op

    def list_operations(self, *, active_only: bool = False) -> list[Operation]:
        """Operations, newest first."""
        ops = [r.op for r in self._ops.values()]
        if active_only:
            ops = [op for op in ops if not op.state.finished]
        return sorted(ops, key=lambda op: (op.created_at_ms, op.id), reverse=True)

    def active(self, kind: OperationKind | None = None) -> list[Operation]:
        """Operations still running (of ``kind``)."""
        return [
            r.op
            for r in self._ops.values()
            if not r.op.state.finished and (kind is None or r.op.kind is kind)
        ]

    def failure(self, op_id: str, index: int = 0) -> LbdError | None:
        """Why move ``index`` of ``op_id`` failed, when it failed with an error."""
        running = self._ops.get(op_id)
        return None if running is None else running.failures.get(index)

    def cancel(self, op_id: str) -> Operation:
        """Stop scheduling ``op_id``'s moves (the in-flight ones finish); the operation."""
        running = self._ops.get(op_id)
        op = self.get(op_id)
        if op.state.finished or op.state is OperationState.CANCELLING:
            return op
        assert running is not None
        op.state = OperationState.CANCELLING
        _log.info("operation %s cancelled: %d move(s) in flight finish", op.id, op.moves_left)
        for index, task in (running.moves or {}).items():
            if index in running.waiting:
                task.cancel()  # still waiting for the governor: nothing written yet
        self._changed(running)
        return op

    async def wait(self, op_id: str) -> Operation:
        """Return once ``op_id`` has finished."""
        async for op in self.watch(op_id):
            if op.state.finished:
                return op
        return self.get(op_id)

    async def watch(self, op_id: str) -> AsyncIterator[Operation]:
        """The operation now, then after each change, until (and including) its end."""
        running = self._ops.get(op_id)
        op = self.get(op_id)
        assert running is not None
        seen = -1
        while True:
            if op.version != seen:
                # What is sent is judged before the yield: the operation may end meanwhile, and
                # its last state must be sent too.
                seen, finished = op.version, op.state.finished
                yield op
                if finished:
                    return
                continue
            assert running.changed is not None
            await running.changed.wait()

    # -- running ------------------------------------------------------------------------------

    async def _run(self, running: _Running) -> None:
        op = running.op
        assert running.moves is not None
        emptied = False
        try:
            while True:
                for index, move in enumerate(op.moves):
                    if move.state is MoveState.PENDING and index not in running.moves:
                        running.moves[index] = guard(
                            self._execute(running, index, move),
                            name=f"move-{op.id}-{move.bundle}",
                        )
                await asyncio.gather(*running.moves.values(), return_exceptions=True)
                if op.state is OperationState.CANCELLING or running.refill is None:
                    break
                more = await running.refill(op)
                if not more:
                    emptied = True
                    break
                if _cancelling(op):
                    break  # cancelled while it looked for more: none of them starts
                op.moves.extend(more)
                self._changed(running)
            state = self._outcome(op, emptied=emptied)
            if state is OperationState.SUCCEEDED and running.finish is not None:
                await running.finish(op)
        except LbdError as e:
            op.error = str(e)
            state = OperationState.FAILED
        except Exception as e:
            _log.exception("operation %s failed", op.id)
            op.error = f"internal error: {e}"
            state = OperationState.FAILED
        except asyncio.CancelledError:
            # The sidecar is stopping (close): its watchers and waiters learn the end too,
            # instead of waiting for an operation nobody runs any more.
            op.error = op.error or "this sidecar stopped; moves in flight settle on their own"
            self._finish(running, OperationState.CANCELLED)
            raise
        self._finish(running, state)

    def _finish(self, running: _Running, state: OperationState) -> None:
        op = running.op
        op.state = state
        op.ended_at_ms = self._clock.now_ms()
        self._changed(running)
        self._active_gauge()
        _log.info(
            "operation %s %s: %d of %d move(s) done%s",
            op.id,
            state.value,
            op.moves_done,
            len(op.moves),
            f" ({op.error})" if op.error else "",
        )

    @staticmethod
    def _outcome(op: Operation, *, emptied: bool) -> OperationState:
        """How ``op`` ended. One with a refill (a drain) succeeded once the refill found nothing
        left to move, whatever earlier rounds' moves failed (later rounds moved those again)."""
        if op.state is OperationState.CANCELLING:
            return OperationState.CANCELLED
        if emptied:
            return OperationState.SUCCEEDED
        failed = [m for m in op.moves if m.state is MoveState.FAILED]
        if failed:
            op.error = op.error or f"{len(failed)} move(s) failed, first: {failed[0].error}"
            return OperationState.FAILED
        return OperationState.SUCCEEDED

    async def _execute(self, running: _Running, index: int, move: Move) -> None:
        op = running.op
        try:
            await self._move(running, index, move)
        except asyncio.CancelledError:
            if move.state is MoveState.PENDING:
                self._end(running, move, MoveState.CANCELLED, "its operation was cancelled")
            raise
        except LbdError as e:
            running.failures[index] = e
            self._end(running, move, MoveState.FAILED, str(e))
        except Exception as e:
            _log.exception("operation %s: move of %s", op.id, move.bundle)
            self._end(running, move, MoveState.FAILED, f"internal error: {e!r}")
        if move.state is MoveState.FAILED:
            _log.warning("operation %s: move of %s failed: %s", op.id, move.bundle, move.error)

    async def _move(self, running: _Running, index: int, move: Move) -> None:
        op = running.op
        running.waiting.add(index)
        try:
            if move.dst is None and op.kind in (OperationKind.DRAIN, OperationKind.DECOMMISSION):
                move.dst = await self._destination(running, move)
                running.sent[move.dst] += 1
                self._changed(running)
            slot = await self._governor.admit(
                Ticket(move.bundle, move.src, move.dst, MoveKind.BALANCING)
            )
        finally:
            running.waiting.discard(index)
        written = False
        try:
            if op.state is OperationState.CANCELLING:
                self._end(running, move, MoveState.CANCELLED, "its operation was cancelled")
                return
            if move.dst is not None and move.dst in self._cordoned():
                # Cordoned while the move waited (a plan kept for minutes, a queued drain move):
                # a drain's next round picks another destination.
                self._end(running, move, MoveState.SKIPPED, f"{move.dst} is cordoned now")
                return
            value = self._follower.get(move.bundle)
            if owner_of(value) != move.src:
                if value is None or value.state is not _S.Owned:
                    why = f"the bundle is {state_of(value).value} now, not Owned"
                else:
                    why = f"the bundle is Owned by {value.dst_broker} now"
                self._end(running, move, MoveState.SKIPPED, why)
                return
            if move.dst is not None and self._registry.get(move.dst) is None:
                self._end(running, move, MoveState.SKIPPED, f"{move.dst} is not registered now")
                return
            move.started_at_ms = self._clock.now_ms()
            try:
                won = await self._proposer.propose_and_wait(
                    move.bundle, _S.Releasing, dst=move.dst, src=move.src
                )
            except UnavailableError:
                raise  # not published: the slot is given back below
            except LbdError:
                # Published, maybe not applied yet: it may still land, so the slot stays held
                # until the bundle settles (or goes stale).
                written = True
                raise
            if not won:
                now_value = self._follower.get(move.bundle)
                self._end(
                    running,
                    move,
                    MoveState.SKIPPED,
                    f"changed meanwhile (now {state_of(now_value).value})",
                )
                return
            written = True
            move.state = MoveState.IN_FLIGHT
            self._changed(running)
            self._record(op, move)
            try:
                async with self._clock.timeout(self._settle_timeout_s):
                    settled = await slot.settled()
            except TimeoutError:
                raise DeadlineError(
                    f"{move.bundle} did not settle within {self._settle_timeout_s:g}s (operation "
                    f"{op.id}; the leader's monitor fixes a move stuck past "
                    "monitor.inflight_timeout_s)"
                ) from None
            move.unavailable_ms = settled.unavailable_ms
            owner = owner_of(settled.value)
            arrived = owner == move.dst if move.dst is not None else owner != move.src
            if arrived:
                self._end(running, move, MoveState.DONE)
            else:
                now = state_of(settled.value).value
                self._end(
                    running,
                    move,
                    MoveState.FAILED,
                    f"the bundle ended {now}"
                    + (f" at {settled.value.dst_broker}" if settled.value is not None else "")
                    + " (the destination may have left during the move)",
                )
        finally:
            if not written:
                slot.release()

    async def _destination(self, running: _Running, move: Move) -> BrokerId:
        """A broker for a drained bundle: the assignment filters, never a cordoned broker or the
        source, preferring the brokers this operation sent the fewest bundles to."""
        excluded = {move.src, *self._cordoned()}
        brokers = {b: i for b, i in self._registry.brokers().items() if b not in excluded}
        if not brokers:
            raise UnavailableError(
                f"no broker can take {move.bundle}: every other broker is cordoned or gone"
            )
        sent = running.sent
        for count in sorted({sent.get(b, 0) for b in brokers}):
            among = {b: i for b, i in brokers.items() if sent.get(b, 0) <= count}
            with contextlib.suppress(UnavailableError):
                selection = await self._assigner.choose(move.bundle, among=among)
                assert selection.broker is not None
                return selection.broker
        selection = await self._assigner.choose(move.bundle, among=brokers)
        assert selection.broker is not None
        return selection.broker

    def _record(self, op: Operation, move: Move) -> None:
        kind = "transfer" if move.dst is not None else "unload"
        self._decisions.record(
            kind,
            move.bundle,
            reason=move.reason,
            source=SOURCES[op.kind],
            src=move.src,
            dst=move.dst,
            operation_id=op.id,
        )
        if op.kind is not OperationKind.SHEDDING:  # the shedder records its own cycles
            self._history.record_decision(
                kind, move.bundle, reason=move.reason, src=move.src, dst=move.dst
            )

    def _end(self, running: _Running, move: Move, state: MoveState, error: str = "") -> None:
        move.state = state
        move.error = error
        move.ended_at_ms = self._clock.now_ms()
        if running.op.kind is not OperationKind.SHEDDING and move.started_at_ms:
            # The shedder counts its own decisions (Metrics.observe_shedding).
            result = SUCCESS if state is MoveState.DONE else FAILURE
            self._metrics.unload_total.labels(result=result, reason=move.reason).inc()
            if state is MoveState.DONE:
                seconds = (move.ended_at_ms - move.started_at_ms) / 1000
                self._metrics.unload_latency.observe(max(0.0, seconds))
        self._changed(running)

    def _changed(self, running: _Running) -> None:
        running.op.version += 1
        assert running.changed is not None
        running.changed.set()
        running.changed = asyncio.Event()

    def _forget_old(self) -> None:
        finished = [r for r in self._ops.values() if r.op.state.finished]
        excess = len(finished) - self._config.keep_finished
        for running in sorted(finished, key=lambda r: r.op.created_at_ms)[: max(0, excess)]:
            del self._ops[running.op.id]

    def _active_gauge(self) -> None:
        self._metrics.operations_active.set(len(self.active()))


def _cancelling(op: Operation) -> bool:
    """Whether ``op`` is being cancelled (a function: its state changes across awaits)."""
    return op.state is OperationState.CANCELLING
