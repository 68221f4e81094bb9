"""The execution governor's bookkeeping: which moves may start now (docs/operating.md).

Every move of a bundle (the leader's shedding, a plan, a drain, an admin transfer or unload, the
repair of an orphan) asks for a slot before its first write and gives it back once the bundle has
settled. A move holds its slot at both ends: its source (unless the source is gone, as an
orphan's is) and its destination (unless it is a plain unload). Each kind of move has its own
budget (:class:`lbd.core.settings.Budget`): concurrent moves per broker and per cluster, and moves
started in any 60 s; recovery never waits for balancing, nor balancing for recovery.

This module is pure: the caller passes the time (monotonic seconds). The asynchronous queue
around it is :class:`lbd.services.leader.governor.ExecutionGovernor`.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass

from lbd.core.ids import BrokerId, BundleId
from lbd.core.settings import Budget, GovernorConfig

RATE_WINDOW_S = 60.0
"""The window of the per-minute limits."""


class MoveKind(enum.Enum):
    """The budget a move draws on."""

    BALANCING = "balancing"
    """Shedding, plans, drains, admin moves: the bundle is served until it moves."""
    RECOVERY = "recovery"
    """The repair of an orphan: nobody serves it until it is Owned again."""

    def __hash__(self) -> int:
        # Enum's hashes the member's name in Python on every lookup; a member is its only
        # instance, so its identity does (the governor's books are keyed by kind).
        return object.__hash__(self)


@dataclass(frozen=True, slots=True)
class Ticket:
    """One move asking for (or holding) a slot."""

    bundle: BundleId
    src: BrokerId | None
    """The broker it leaves; None when none counts (an orphan's gone broker)."""
    dst: BrokerId | None
    """The broker it goes to; None for a plain unload (or not chosen yet)."""
    kind: MoveKind

    @property
    def brokers(self) -> tuple[BrokerId, ...]:
        """The brokers whose per-broker limit the move counts against."""
        src, dst = self.src, self.dst
        if src is None:
            return () if dst is None else (dst,)
        return (src,) if dst is None or dst == src else (src, dst)


class _Books:
    """Slots held and recent starts of one budget."""

    __slots__ = ("budget", "held", "per_broker", "starts")

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.held: dict[BundleId, Ticket] = {}
        self.per_broker: Counter[BrokerId] = Counter()
        self.starts: deque[float] = deque()


class Governor:
    """Which moves may start, under the configured budgets."""

    def __init__(self, config: GovernorConfig) -> None:
        self._books = {
            MoveKind.BALANCING: _Books(config.balancing),
            MoveKind.RECOVERY: _Books(config.recovery),
        }

    def blocked_by(self, ticket: Ticket, now_s: float) -> str | None:
        """Why ``ticket`` may not start now (the limit it would break), or None when it may.

        A bundle already holding a slot may not start a second move.
        """
        books = self._books[ticket.kind]
        budget = books.budget
        if self.holds(ticket.bundle):
            return f"{ticket.bundle} is already moving"
        if budget.cluster and len(books.held) >= budget.cluster:
            return f"{len(books.held)} {ticket.kind.value} moves in flight (cluster limit)"
        for broker in ticket.brokers:
            count = books.per_broker[broker]
            if budget.per_broker and count >= budget.per_broker:
                return f"{count} {ticket.kind.value} moves in flight at {broker} (broker limit)"
        if budget.per_minute:
            self._expire(books, now_s)
            if len(books.starts) >= budget.per_minute:
                return f"{len(books.starts)} {ticket.kind.value} moves started in 60s (rate limit)"
        return None

    def may_start(self, ticket: Ticket, now_s: float) -> bool:
        """Whether ``ticket`` may start now (:meth:`blocked_by` is None), without building the
        explanation: the governor asks this for every waiter it looks at."""
        books = self._books[ticket.kind]
        budget = books.budget
        if ticket.bundle in books.held or self.holds(ticket.bundle):
            return False
        if budget.cluster and len(books.held) >= budget.cluster:
            return False
        if budget.per_broker and any(
            books.per_broker[b] >= budget.per_broker for b in ticket.brokers
        ):
            return False
        if budget.per_minute:
            self._expire(books, now_s)
            if len(books.starts) >= budget.per_minute:
                return False
        return True

    def retry_after_s(self, kind: MoveKind, now_s: float) -> float | None:
        """Seconds until the rate limit of ``kind`` lets one more move start (None: it does
        now, or only a finished move can free a slot)."""
        books = self._books[kind]
        if not books.budget.per_minute:
            return None
        self._expire(books, now_s)
        if len(books.starts) < books.budget.per_minute:
            return None
        return max(0.0, books.starts[0] + RATE_WINDOW_S - now_s)

    def start(self, ticket: Ticket, now_s: float) -> None:
        """Take the slot of ``ticket`` (ValueError when :meth:`blocked_by` says no)."""
        if not self.try_start(ticket, now_s):
            reason = self.blocked_by(ticket, now_s)
            raise ValueError(f"move of {ticket.bundle} may not start: {reason}")

    def try_start(self, ticket: Ticket, now_s: float) -> bool:
        """Take the slot of ``ticket`` if it may start now (:meth:`may_start`); whether it did."""
        if not self.may_start(ticket, now_s):
            return False
        books = self._books[ticket.kind]
        books.held[ticket.bundle] = ticket
        books.per_broker.update(ticket.brokers)
        if books.budget.per_minute:  # only a rate limit reads them
            books.starts.append(now_s)
        return True

    def finish(self, bundle: BundleId) -> Ticket | None:
        """Give back the slot ``bundle`` holds; the ticket, or None when it held none."""
        for books in self._books.values():
            ticket = books.held.pop(bundle, None)
            if ticket is not None:
                for broker in ticket.brokers:
                    left = books.per_broker.get(broker, 0) - 1
                    if left > 0:
                        books.per_broker[broker] = left
                    else:
                        books.per_broker.pop(broker, None)
                return ticket
        return None

    def holds(self, bundle: BundleId) -> bool:
        """Whether ``bundle`` holds a slot."""
        return any(bundle in books.held for books in self._books.values())

    def held(self, kind: MoveKind) -> tuple[Ticket, ...]:
        """The moves of ``kind`` holding a slot."""
        return tuple(self._books[kind].held.values())

    def in_flight(self, kind: MoveKind, broker: BrokerId | None = None) -> int:
        """Moves of ``kind`` holding a slot (at ``broker``, when given)."""
        books = self._books[kind]
        return len(books.held) if broker is None else books.per_broker[broker]

    def budget(self, kind: MoveKind) -> Budget:
        """The budget of ``kind``."""
        return self._books[kind].budget

    @staticmethod
    def _expire(books: _Books, now_s: float) -> None:
        while books.starts and books.starts[0] <= now_s - RATE_WINDOW_S:
            books.starts.popleft()
