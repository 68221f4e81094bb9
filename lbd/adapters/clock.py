"""Clocks implementing :class:`lbd.ports.clock.Clock`: the real one and a manual one for tests."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from contextlib import AbstractAsyncContextManager

from lbd.ports.clock import TimeoutScope
from lbd.tasks import WakeTimeout


class SystemClock:
    """The host's clocks: ``time.time`` for wall milliseconds, ``time.monotonic``, asyncio sleep."""

    def now_ms(self) -> int:
        """Wall-clock milliseconds since the epoch."""
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        """``asyncio.sleep(seconds)``."""
        await asyncio.sleep(seconds)

    def timeout(self, seconds: float) -> AbstractAsyncContextManager[TimeoutScope]:
        """``asyncio.timeout(seconds)``: a timer handle, no task."""
        return asyncio.timeout(seconds)


class ManualClock:
    """A clock that moves only when told to: tests and the simulator drive time explicitly.

    :meth:`sleep` returns once :meth:`advance` has moved the clock past its deadline. Wall time and
    monotonic time move together.
    """

    def __init__(self, start_ms: int = 1_700_000_000_000, start_monotonic: float = 1000.0) -> None:
        self._wall_offset_ms = start_ms - round(start_monotonic * 1000)
        self.now = start_monotonic
        """The manual time in seconds (what :meth:`monotonic` returns; an attribute for the
        simulated world's clocks, which read it on every look at the time). Moved only by
        :meth:`advance` and :meth:`advance_to_next`."""
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now_ms(self) -> int:
        """Wall milliseconds, moving with :meth:`monotonic`."""
        return self._wall_offset_ms + round(self.now * 1000)

    def monotonic(self) -> float:
        """The manual time in seconds."""
        return self.now

    async def sleep(self, seconds: float) -> None:
        """Wait until the clock has been advanced by ``seconds`` (at least one loop turn)."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        await self.wake_after(seconds)

    def wake_after(self, seconds: float) -> asyncio.Future[None]:
        """A future done once the clock has been advanced by ``seconds`` (> 0): what
        :meth:`sleep` awaits, for a clock of the simulated world built on this one to await
        without a coroutine of its own per sleep."""
        future: asyncio.Future[None] = asyncio.Future()
        heapq.heappush(self._sleepers, (self.now + seconds, next(self._seq), future))
        return future

    def timeout(self, seconds: float) -> AbstractAsyncContextManager[TimeoutScope]:
        """A scope cancelled once the clock has been advanced by ``seconds``."""
        return WakeTimeout(self.wake_after, seconds)

    @property
    def sleepers(self) -> int:
        """How many sleeps are pending (lets a test wait until a task has gone to sleep)."""
        return sum(1 for _, _, f in self._sleepers if not f.done())

    def next_deadline(self) -> float | None:
        """When the earliest pending sleep ends (None when nothing sleeps): a simulated event loop
        with nothing to run moves the clock straight there."""
        sleepers = self._sleepers
        while sleepers and sleepers[0][2].done():  # cancelled while asleep
            heapq.heappop(sleepers)
        return sleepers[0][0] if sleepers else None

    def advance_to_next(self, limit: float | None = None) -> bool:
        """Move time to the earliest pending sleep's deadline (never past ``limit``, when
        given) and wake what ends then; False when nothing sleeps (time stays)."""
        deadline = self.next_deadline()
        if deadline is None:
            if limit is not None and limit > self.now:
                self.now = limit
            return False
        if limit is not None and limit < deadline:
            self.now = max(self.now, limit)
            return True
        self.advance(max(0.0, deadline - self.now))
        return True

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleep whose deadline has passed."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back: advance({seconds})")
        self.now += seconds
        while self._sleepers and self._sleepers[0][0] <= self.now:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)

    async def run_for(self, seconds: float, step: float = 0.05) -> None:
        """Advance ``seconds`` in steps, letting woken tasks run between steps."""
        remaining = seconds
        while remaining > 0:
            delta = min(step, remaining)
            self.advance(delta)
            remaining -= delta
            for _ in range(5):
                await asyncio.sleep(0)
