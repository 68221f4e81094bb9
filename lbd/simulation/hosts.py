"""The world's hosts and what runs between them: gates that freeze a paused process or cut a
link, each host's own drifting clock, the channel seen through a gate, the channel log that tells
the checks every append, and the CPU a sidecar measures without a broker report. (The traffic the
brokers carry is :class:`lbd.workload.traffic.HashedTopicTraffic`.)"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from lbd.adapters.clock import ManualClock
from lbd.adapters.memory.channel import MemoryChannelLog, MemoryLog
from lbd.core.load import BrokerUsage, ResourceUsage
from lbd.core.table import ChannelPosition
from lbd.ports.channel import ChannelMessage
from lbd.ports.clock import Clock, TimeoutScope
from lbd.tasks import WakeTimeout


class Gate:
    """Closed while its sidecar is paused: everything of the sidecar waits at it."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.paused = False
        """Whether the gate is closed (a plain attribute: every sleep of the world asks)."""

    def set(self, closed: bool) -> None:
        self.paused = closed
        if closed:
            self._open.clear()
        else:
            self._open.set()

    async def wait(self) -> None:
        if self.paused:
            await self._open.wait()


class WakingClock(Clock, Protocol):
    """A clock of the simulated world: the port's, and wake-up futures a callback can wait on
    (:meth:`ManualClock.wake_after`)."""

    def wake_after(self, seconds: float) -> asyncio.Future[None]:
        """A future done once ``seconds`` (> 0) of this clock have passed."""
        ...


class HostClock:
    """One host's clock: the world's, running at ``rate`` (within :data:`MAX_DRIFT` of 1), and
    frozen for the sidecar's tasks while ``gate`` is closed (time runs on, no sleep ends)."""

    def __init__(self, clock: ManualClock, rate: float, gate: Gate | None = None) -> None:
        self._clock = clock
        self._rate = rate
        self._gate = gate
        self._origin = clock.monotonic()

    def now_ms(self) -> int:
        return self._clock.now_ms() + round((self.monotonic() - self._clock.monotonic()) * 1000)

    def monotonic(self) -> float:
        origin = self._origin
        return origin + (self._clock.now - origin) * self._rate

    async def sleep(self, seconds: float) -> None:
        # The world's clock's future, awaited here: every task of the world sleeps through
        # this, so it costs one coroutine, not two.
        if seconds <= 0:
            await asyncio.sleep(0)
        else:
            await self._clock.wake_after(seconds / self._rate)
        gate = self._gate
        if gate is not None and gate.paused:  # _hold, inline on the world's hottest path
            await gate.wait()

    def timeout(self, seconds: float) -> AbstractAsyncContextManager[TimeoutScope]:
        return WakeTimeout(self.wake_after, seconds, self._hold)

    def wake_after(self, seconds: float) -> asyncio.Future[None]:
        """Done once ``seconds`` (> 0) of this host's time have passed, gate or not (a gated
        sleep or timeout waits for the gate after it)."""
        return self._clock.wake_after(seconds / self._rate)

    def _hold(self) -> Awaitable[None] | None:
        """What a timer whose time ran out waits for first: the sidecar's resume, while its
        host is paused."""
        gate = self._gate
        return gate.wait() if gate is not None and gate.paused else None


class GatedChannel:
    """A sidecar's channel client that neither reads nor writes while its gate is closed."""

    def __init__(self, inner: MemoryChannelLog, gate: Gate) -> None:
        self._inner = inner
        self._gate = gate

    async def publish(self, key: str, value: bytes) -> ChannelPosition:
        await self._gate.wait()
        return await self._inner.publish(key, value)

    async def publish_batch(self, entries: Sequence[tuple[str, bytes]]) -> list[ChannelPosition]:
        await self._gate.wait()
        return await self._inner.publish_batch(entries)

    async def follow(self, after: ChannelPosition | None) -> AsyncGenerator[ChannelMessage, None]:
        async with contextlib.aclosing(self._inner.follow(after)) as messages:
            async for message in messages:
                await self._gate.wait()
                yield message

    async def catch_up(self, after: ChannelPosition | None) -> AsyncGenerator[ChannelMessage, None]:
        await self._gate.wait()
        async with contextlib.aclosing(self._inner.catch_up(after)) as messages:
            async for message in messages:
                await self._gate.wait()
                yield message

    async def last_after(self, after: ChannelPosition | None) -> ChannelPosition | None:
        await self._gate.wait()
        return await self._inner.last_after(after)

    async def close(self) -> None:
        await self._inner.close()


class WatchedLog(MemoryLog):
    """The state channel, telling the world of every message as it is appended."""

    def __init__(self, on_append: Callable[[ChannelPosition, str, bytes], None]) -> None:
        super().__init__()
        self._on_append = on_append

    def append(self, key: str, value: bytes) -> ChannelPosition:
        position = super().append(key, value)
        self._on_append(position, key, value)
        return position

    def append_batch(self, entries: Sequence[tuple[str, bytes]]) -> list[ChannelPosition]:
        positions = super().append_batch(entries)
        for position, (key, value) in zip(positions, entries, strict=True):
            self._on_append(position, key, value)
        return positions


class SimulatedHost:
    """The host a sidecar measures while its broker sends no load report: a CPU load that wanders
    with the world's seed (never the machine the simulation runs on)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._cpu = rng.uniform(10.0, 60.0)

    def sample(self, now_s: float) -> BrokerUsage:
        self._cpu = min(95.0, max(1.0, self._cpu + self._rng.uniform(-5.0, 5.0)))
        return BrokerUsage(cpu=ResourceUsage(self._cpu, 100.0))
