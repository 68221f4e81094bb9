"""Plans, operations and their moves, as the leader tracks them (docs/operating.md).

A :class:`Plan` is what ``Rebalance`` proposes: moves with their reasons, the load's spread now
and as predicted once every move is done. An :class:`Operation` is a tracked batch of moves (a
plan's execution, a drain, a decommission, an admin move, a shedding cycle) with a state, one
:class:`Move` per bundle and its times. Plain data: the services change them, the API converts
them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from lbd.core.ids import BrokerId, BundleId
from lbd.core.settings import SheddingConfig
from lbd.core.shedding import LoadSnapshot, ShedderState, UnloadDecision, mean_and_std
from lbd.core.shedding.model import usable_load
from lbd.core.shedding.planner import estimate


class MoveState(enum.Enum):
    """Where a move is (the proto's ``MoveState``)."""

    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """Whether the move will not change any more."""
        return self not in (MoveState.PENDING, MoveState.IN_FLIGHT)


class OperationState(enum.Enum):
    """Where an operation is (the proto's ``OperationState``)."""

    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """Whether the operation will not change any more."""
        return self not in (OperationState.RUNNING, OperationState.CANCELLING)


class OperationKind(enum.StrEnum):
    """What an operation is for."""

    PLAN = "plan"
    DRAIN = "drain"
    DECOMMISSION = "decommission"
    ADMIN = "admin"
    SHEDDING = "shedding"


@dataclass(slots=True)
class Move:
    """One bundle's move: planned, then carried out by the executor."""

    bundle: BundleId
    src: BrokerId
    dst: BrokerId | None
    """None: a plain unload, or (in a drain) chosen when the move starts."""
    reason: str
    state: MoveState = MoveState.PENDING
    error: str = ""
    started_at_ms: int = 0
    ended_at_ms: int = 0
    unavailable_ms: float | None = None
    """From the source's Release ack to the destination's Own ack (transfers only)."""
    msg_throughput: float = 0.0
    """Bytes/s the bundle carried when planned (0: not in the top-bundles report)."""
    sessions: int = 0
    """Producers plus consumers when planned."""

    def copy(self) -> Move:
        """A copy to change without touching this one."""
        return Move(
            self.bundle,
            self.src,
            self.dst,
            self.reason,
            self.state,
            self.error,
            self.started_at_ms,
            self.ended_at_ms,
            self.unavailable_ms,
            self.msg_throughput,
            self.sessions,
        )


@dataclass(frozen=True, slots=True)
class Plan:
    """Moves proposed by the shedding strategy, kept until executed or expired."""

    id: str
    strategy: str
    moves: tuple[Move, ...]
    avg: float
    std_before: float
    std_after: float
    """Predicted once every move is done."""
    created_at_ms: int
    expires_at_ms: int

    @property
    def bytes_to_move(self) -> float:
        """Bytes/s carried by the bundles to move."""
        return sum(m.msg_throughput for m in self.moves)

    @property
    def sessions_to_move(self) -> int:
        """Producers plus consumers of the bundles to move."""
        return sum(m.sessions for m in self.moves)


@dataclass(slots=True)
class Operation:
    """A tracked batch of moves."""

    id: str
    kind: OperationKind
    description: str
    created_at_ms: int
    moves: list[Move] = field(default_factory=list)
    state: OperationState = OperationState.RUNNING
    ended_at_ms: int = 0
    error: str = ""
    broker: BrokerId | None = None
    """The broker a drain or decommission empties."""
    plan_id: str | None = None
    version: int = 0
    """Bumped on every change (watchers compare it)."""

    @property
    def moves_done(self) -> int:
        """Moves in DONE."""
        return sum(1 for m in self.moves if m.state is MoveState.DONE)

    @property
    def moves_left(self) -> int:
        """Moves not finished yet."""
        return sum(1 for m in self.moves if not m.state.finished)


def moves_of(decisions: Iterable[UnloadDecision], snapshot: LoadSnapshot) -> tuple[Move, ...]:
    """The planned moves of ``decisions``, with each bundle's traffic and sessions from the
    top-bundles reports of ``snapshot`` (0 when a bundle is not reported)."""
    reported = {b.bundle: b for top in snapshot.top_bundles.values() for b in top}
    moves = []
    for d in decisions:
        load = reported.get(d.bundle)
        moves.append(
            Move(
                d.bundle,
                d.src,
                d.dst,
                d.reason.value,
                msg_throughput=0.0 if load is None else load.msg_throughput,
                sessions=0 if load is None else load.sessions,
            )
        )
    return tuple(moves)


def predicted_spread(
    snapshot: LoadSnapshot,
    config: SheddingConfig,
    state: ShedderState,
    now_ms: int,
    decisions: tuple[UnloadDecision, ...],
) -> tuple[float, float, float] | None:
    """``(avg, std now, std once the decisions are done)`` of the brokers' estimated current
    loads (cluster_planner's estimate: each broker's own load per byte/s, its latest sample);
    a plain unload's bundle is counted on the least loaded broker, where the next lookup most
    likely assigns it. None when no broker with usable load carries traffic."""
    loads = usable_load(snapshot, config, now_ms).loads
    est = estimate(snapshot, loads, state)
    if est is None:
        return None
    throughput: Mapping[BundleId, float] = {
        b.bundle: b.msg_throughput for top in snapshot.top_bundles.values() for b in top
    }
    after = est.after(
        tuple(
            d
            for d in decisions
            if d.dst in est.loads and d.src in est.loads and d.bundle in throughput
        ),
        throughput,
    )
    for d in decisions:
        if d.dst is None and d.src in after and len(after) > 1:
            t = throughput.get(d.bundle, 0.0)
            after[d.src] -= t * est.per_byte[d.src]
            target = min((b for b in after if b != d.src), key=lambda b: after[b])
            after[target] += t * est.per_byte[target]
    avg, before = mean_and_std(est.loads.values())
    _, predicted = mean_and_std(after.values())
    return avg, before, predicted
