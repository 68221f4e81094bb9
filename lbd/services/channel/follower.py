"""The channel follower: applies the state channel to a table, in order, for the whole sidecar.

It first catches up with the channel as it is (from the table's position: empty, or a checkpoint),
then follows it forever. It serves the current value of each bundle, a change feed (optionally
marked with the read barriers it completed) and waiters ("until this bundle is Owned, or the
deadline"). A malformed message is skipped, logged once and counted: it never crashes the
follower nor stalls the channel. Repeated or out-of-order deliveries are refused by the table's
position check.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass

from lbd.core.ids import BundleId
from lbd.core.probes import probe
from lbd.core.state import ServiceUnitStateData
from lbd.core.table import ApplyResult, ChannelPosition, Outcome, StateTable
from lbd.ports.channel import ChannelLog, ChannelMessage
from lbd.ports.errors import UnavailableError
from lbd.tasks import Component, Tasks

_log = logging.getLogger(__name__)

Predicate = Callable[[ServiceUnitStateData | None], bool]


@dataclass(frozen=True, slots=True)
class ReadBarrier:
    """A mark in a change feed: read barrier ``number`` completed here. Every change accepted
    from what the channel held when that barrier began came before this mark in the feed."""

    number: int
    """The barrier's number, counted from 1 as barriers begin (see
    :attr:`ChannelFollower.barriers_begun`)."""


@dataclass(slots=True)
class FollowerStats:
    """Counts of what the follower did with each message, by outcome."""

    accepted: int = 0
    rejected: int = 0
    duplicate: int = 0
    malformed: int = 0

    def count(self, outcome: Outcome) -> None:
        """Count one message."""
        name = outcome.value
        setattr(self, name, getattr(self, name) + 1)


class ChannelFollower(Component):
    """Keeps a :class:`StateTable` equal to the channel, and tells who waits what changed."""

    def __init__(
        self,
        log: ChannelLog,
        table: StateTable | None = None,
        *,
        name: str = "channel-follower",
        on_death: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        self._log = log
        self._table = table if table is not None else StateTable()
        self._name = name
        self._on_death = on_death
        self._tasks = Tasks("the channel follower")
        self._ready = asyncio.Event()
        self._subscribers: set[asyncio.Queue[ApplyResult]] = set()
        self._marked_subscribers: set[asyncio.Queue[ApplyResult | ReadBarrier]] = set()
        self._barriers_begun = 0
        self._waiters: dict[BundleId, list[tuple[Predicate, asyncio.Future[None]]]] = {}
        self._position_waiters: list[tuple[ChannelPosition, int, asyncio.Future[None]]] = []
        """A heap of waiters by position: each applied message wakes only those it covers."""
        self._waiter_numbers = itertools.count()
        self.stats = FollowerStats()

    @property
    def table(self) -> StateTable:
        """The materialised table (read it; never write it)."""
        return self._table

    @property
    def is_ready(self) -> bool:
        """Whether the follower has caught up with the channel as it was at start."""
        return self._ready.is_set()

    def get(self, bundle: BundleId) -> ServiceUnitStateData | None:
        """The bundle's current value (None: Init)."""
        return self._table.get(bundle)

    @property
    def barriers_begun(self) -> int:
        """How many read barriers began so far. Whoever reads n here knows that a barrier whose
        :class:`ReadBarrier` mark carries a number above n began after this read."""
        return self._barriers_begun

    async def start(self, table: StateTable | None = None) -> None:
        """Start following, from ``table`` when given (a restored checkpoint) instead of the
        table it was built with; returns at once (:meth:`wait_ready` waits for the catch-up)."""
        if not self._tasks:
            if table is not None:
                self._table = table
            self._tasks.spawn(self._run(), name=self._name, on_death=self._on_death)

    async def wait_ready(self) -> None:
        """Wait until the channel as it was at start is applied (bound it with the clock's
        ``timeout``)."""
        await self._ready.wait()

    async def close(self) -> None:
        """Stop following; waiters get :class:`UnavailableError` (a caller that was not
        cancelled itself, an admin split waiting for its bundle to settle, say, gets an error it
        can answer with, not a cancellation). Idempotent."""
        await self._tasks.close()
        futures = [future for waiters in self._waiters.values() for _, future in waiters]
        futures += [future for _, _, future in self._position_waiters]
        for future in futures:
            if not future.done():
                future.set_exception(
                    UnavailableError(f"{self._name}: the channel follower stopped")
                )
                future.exception()  # retrieved here: a waiter without a task awaits nothing
        self._waiters.clear()
        self._position_waiters.clear()

    def changes(self) -> AsyncGenerator[ApplyResult, None]:
        """Every change accepted from the moment of this call on, in channel order.

        Subscribes at once, not at the first iteration: a caller that reads the table right
        after this call misses no change and sees none twice. Iterate promptly (the feed is
        unbounded) and close the iterator when done.
        """
        queue: asyncio.Queue[ApplyResult] = asyncio.Queue()
        self._subscribers.add(queue)
        return self._drain(queue)

    def change_batches(self) -> AsyncGenerator[list[ApplyResult], None]:
        """As :meth:`changes`, but each step gives every change queued by then, in channel
        order: a consumer whose work per change is mostly the same bookkeeping does it once per
        batch (a repair applies thousands of changes a second)."""
        queue: asyncio.Queue[ApplyResult] = asyncio.Queue()
        self._subscribers.add(queue)
        return self._drain_batches(queue)

    def changes_and_barriers(self) -> AsyncGenerator[ApplyResult | ReadBarrier, None]:
        """As :meth:`changes`, with a :class:`ReadBarrier` mark where each read barrier
        completed: once a consumer has read a mark, it has read every change the barrier
        covers (what lets a sidecar vouch for what it sent; a time alone would not say whether
        the changes are still queued)."""
        queue: asyncio.Queue[ApplyResult | ReadBarrier] = asyncio.Queue()
        self._marked_subscribers.add(queue)
        return self._drain_marked(queue)

    async def _drain(self, queue: asyncio.Queue[ApplyResult]) -> AsyncGenerator[ApplyResult, None]:
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers.discard(queue)

    async def _drain_batches(
        self, queue: asyncio.Queue[ApplyResult]
    ) -> AsyncGenerator[list[ApplyResult], None]:
        try:
            while True:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                yield batch
        finally:
            self._subscribers.discard(queue)

    async def _drain_marked(
        self, queue: asyncio.Queue[ApplyResult | ReadBarrier]
    ) -> AsyncGenerator[ApplyResult | ReadBarrier, None]:
        try:
            while True:
                yield await queue.get()
        finally:
            self._marked_subscribers.discard(queue)

    async def wait_for(self, bundle: BundleId, predicate: Predicate) -> ServiceUnitStateData | None:
        """The bundle's value once ``predicate`` holds for it (at once if it holds now).

        Bound the wait with the clock's ``timeout``; leaving early cleans the waiter up.
        """
        if predicate(self._table.get(bundle)):
            return self._table.get(bundle)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._waiting(bundle, predicate, future):
            await future
        return self._table.get(bundle)

    def watching(
        self, bundle: BundleId, observer: Predicate
    ) -> contextlib.AbstractContextManager[None]:
        """Within the block, show ``observer`` every value of ``bundle`` as it is applied (its
        answer is ignored): a waiter without a task of its own."""
        return self._waiting(bundle, observer, asyncio.get_running_loop().create_future())

    @contextlib.contextmanager
    def _waiting(
        self, bundle: BundleId, predicate: Predicate, future: asyncio.Future[None]
    ) -> Iterator[None]:
        """``predicate`` is shown each value of ``bundle`` applied within the block, until it
        holds (``future`` is then set)."""
        entry = (predicate, future)
        self._waiters.setdefault(bundle, []).append(entry)
        try:
            yield
        finally:
            waiters = self._waiters.get(bundle)
            if waiters is not None and entry in waiters:
                waiters.remove(entry)
                if not waiters:
                    del self._waiters[bundle]

    async def wait_applied(self, position: ChannelPosition) -> None:
        """Return once the table covers ``position`` (read-your-writes after a publish)."""
        last = self._table.last_position
        if last is not None and last >= position:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # A waiter that leaves early stays in the heap until its position is applied (or the
        # follower closes): dropping it now would cost a search of the heap.
        heapq.heappush(self._position_waiters, (position, next(self._waiter_numbers), future))
        try:
            await future
        finally:
            future.cancel()

    async def barrier(self) -> None:
        """Return once the table covers every message the channel held when this was called.

        A read barrier: it asks the channel where it ends past the table's position
        (:meth:`~lbd.ports.channel.ChannelLog.last_after`), and waits until the follower has
        applied up to there. Raises
        :class:`~lbd.ports.errors.UnavailableError` when the channel cannot be asked; bound it
        with the clock's ``timeout``. When it completes, the feeds of
        :meth:`changes_and_barriers` get its :class:`ReadBarrier` mark.
        """
        self._barriers_begun += 1
        number = self._barriers_begun
        last = await self._log.last_after(self._table.last_position)
        if last is not None:
            await self.wait_applied(last)
        mark = ReadBarrier(number)
        for queue in self._marked_subscribers:
            queue.put_nowait(mark)

    async def _run(self) -> None:
        async with contextlib.aclosing(self._log.catch_up(self._table.last_position)) as backlog:
            async for message in backlog:
                self._apply(message)
        self._ready.set()
        _log.info(
            "%s: caught up at %s with %d bundles",
            self._name,
            self._table.last_position,
            len(self._table),
        )
        async with contextlib.aclosing(self._log.follow(self._table.last_position)) as stream:
            async for message in stream:
                self._apply(message)

    def _apply(self, message: ChannelMessage) -> None:
        result = self._table.apply(message.position, BundleId(message.key), message.value)
        self.stats.count(result.outcome)
        if result.outcome is Outcome.MALFORMED:
            _log.warning(
                "%s: skipped a malformed value for %s at %s: %s",
                self._name,
                message.key,
                message.position,
                result.reason,
            )
        elif result.outcome is Outcome.REJECTED:
            _log.debug(
                "%s: rejected %s at %s: %s",
                self._name,
                message.key,
                message.position,
                result.reason,
            )
        elif result.outcome is Outcome.ACCEPTED:
            for queue in self._subscribers:
                queue.put_nowait(result)
            for marked in self._marked_subscribers:
                marked.put_nowait(result)
            self._wake(result.key)
        if result.outcome is not Outcome.DUPLICATE:
            self._wake_positions()
        else:
            probe("channel.duplicate")

    def _wake(self, bundle: BundleId) -> None:
        value = self._table.get(bundle)
        for predicate, future in self._waiters.get(bundle, ()):
            if not future.done() and predicate(value):
                future.set_result(None)

    def _wake_positions(self) -> None:
        last = self._table.last_position
        waiters = self._position_waiters
        if last is None:
            return
        while waiters and waiters[0][0] <= last:
            _, _, future = heapq.heappop(waiters)
            if not future.done():
                future.set_result(None)
