"""The leader's log of recent decisions, for ``lbd ctl decisions`` (docs/operating.md).

Every move the leader decides or carries out is recorded here with its reason and its source: the
shedder's decisions, the monitor's repairs, the moves of plans, drains and admin calls. Only the
newest ``operations.keep_decisions`` are kept, in memory; the history (when enabled) keeps them
all.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from lbd.core.ids import BrokerId, BundleId
from lbd.ports.clock import Clock


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision, as ``ListDecisions`` returns it."""

    at_ms: int
    kind: str
    """unload, transfer, assign, split, orphan, inflight, tombstone."""
    bundle: BundleId
    src: BrokerId | None
    dst: BrokerId | None
    reason: str
    source: str
    """shedder, monitor, admin, plan, drain."""
    operation_id: str | None = None


class DecisionLog:
    """The newest decisions, oldest first."""

    def __init__(self, clock: Clock, *, keep: int) -> None:
        self._clock = clock
        self._decisions: deque[Decision] = deque(maxlen=keep)

    def record(
        self,
        kind: str,
        bundle: BundleId,
        *,
        reason: str,
        source: str,
        src: BrokerId | None = None,
        dst: BrokerId | None = None,
        operation_id: str | None = None,
    ) -> Decision:
        """Record a decision made now."""
        decision = Decision(
            self._clock.now_ms(), kind, bundle, src, dst, reason, source, operation_id
        )
        self._decisions.append(decision)
        return decision

    def since(self, since_ms: int = 0, limit: int = 0) -> list[Decision]:
        """Decisions at or after ``since_ms``, oldest first; the newest ``limit`` (0: all)."""
        out = [d for d in self._decisions if d.at_ms >= since_ms]
        return out[-limit:] if limit > 0 else out

    def __len__(self) -> int:
        return len(self._decisions)
