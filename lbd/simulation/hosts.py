"""The world's hosts and what runs between them: gates that freeze a paused process or cut a
link, each host's own drifting clock, the channel seen through a gate, the channel log that tells
the checks every append, and the CPU a sidecar measures without a broker report. (The traffic the
brokers carry is :class:`lbd.workload.traffic.HashedTopicTraffic`.)"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import AbstractAsyncContextManager

from lbd.adapters.clock import ManualClock
from lbd.adapters.memory.channel import MemoryChannelLog, MemoryLog
from lbd.core.load import BrokerUsage, ResourceUsage
from lbd.core.table import ChannelPosition
from lbd.ports.channel import ChannelMessage
from lbd.ports.clock import TimeoutScope
from lbd.tasks import sleep_timeout


class Gate:
    """Closed while its sidecar is paused: everything of the sidecar waits at it."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def set(self, closed: bool) -> None:
        if closed:
            self._open.clear()
        else:
            self._open.set()

    async def wait(self) -> None:
        if not self._open.is_set():
            await self._open.wait()


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
        return origin + (self._clock.monotonic() - origin) * self._rate

    async def sleep(self, seconds: float) -> None:
        await self._clock.sleep(seconds / self._rate)
        if self._gate is not None:
            await self._gate.wait()

    def timeout(self, seconds: float) -> AbstractAsyncContextManager[TimeoutScope]:
        return sleep_timeout(self.sleep, seconds)


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
