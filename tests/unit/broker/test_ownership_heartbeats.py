"""What the sidecar's WatchOwnership heartbeats promise, checked on the servicer itself over a
follower of the in-memory channel: a heartbeat claims the instant ``vouched_age_ms`` before it
was written, and every change appended to the channel before that instant came before it.

The stream is read straight from the servicer's generator (no gRPC in between), so an item's
arrival time is within microseconds of when it was written, and a reader that stops reading
holds the generator where it is, as a slow client does."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc
from channel_values import value

from lbd.adapters.memory.channel import MemoryChannelLog, MemoryLog
from lbd.api.loadbalancer import LoadBalancerServicer
from lbd.core.state import ServiceUnitState
from lbd.core.table import ChannelPosition
from lbd.gen.v1 import lbd_pb2
from lbd.ports.channel import ChannelMessage
from lbd.services.channel.follower import ChannelFollower
from tests.unit.broker.scripted import until

NS = "public/default"
ROUNDING_S = 0.001
"""Ages are whole milliseconds, rounded up: a claimed instant may be this much early, not late."""


def bundle(i: int) -> str:
    return f"{NS}/0x{i:08x}_0x{i + 1:08x}"


@dataclass(frozen=True)
class Received:
    message: lbd_pb2.OwnershipChange
    at: float

    @property
    def claims(self) -> float:
        """The instant a heartbeat vouches for, as the reader can compute it."""
        return self.at - self.message.vouched_age_ms / 1000


class SlowChannel:
    """A channel client whose catch-up (what a read barrier asks) waits ``catch_up_delay_s``
    first, and whose follower gets each message ``follow_delay_s`` late (a lagging reader)."""

    def __init__(
        self, inner: MemoryChannelLog, catch_up_delay_s: float, follow_delay_s: float
    ) -> None:
        self._inner = inner
        self._catch_up_delay_s = catch_up_delay_s
        self._follow_delay_s = follow_delay_s

    async def publish(self, key: str, value: bytes) -> ChannelPosition:
        return await self._inner.publish(key, value)

    async def publish_batch(self, entries: Sequence[tuple[str, bytes]]) -> list[ChannelPosition]:
        return await self._inner.publish_batch(entries)

    async def follow(self, after: ChannelPosition | None) -> AsyncGenerator[ChannelMessage, None]:
        async with contextlib.aclosing(self._inner.follow(after)) as messages:
            async for message in messages:
                await asyncio.sleep(self._follow_delay_s)
                yield message

    async def catch_up(self, after: ChannelPosition | None) -> AsyncGenerator[ChannelMessage, None]:
        await asyncio.sleep(self._catch_up_delay_s)
        async with contextlib.aclosing(self._inner.catch_up(after)) as messages:
            async for message in messages:
                yield message

    async def last_after(self, after: ChannelPosition | None) -> ChannelPosition | None:
        await asyncio.sleep(self._catch_up_delay_s)
        return await self._inner.last_after(after)

    async def close(self) -> None:
        await self._inner.close()


class Reader:
    """Reads one WatchOwnership stream of ``servicer`` into :attr:`received`; pausable, and
    slowed down by :attr:`delay_s` per item."""

    def __init__(self, servicer: LoadBalancerServicer, heartbeat_ms: int) -> None:
        request = lbd_pb2.WatchOwnershipRequest(namespace=NS, heartbeat_ms=heartbeat_ms)
        context = cast(grpc.aio.ServicerContext, None)  # WatchOwnership does not use it
        self.stream = cast(AsyncGenerator[lbd_pb2.OwnershipChange, None], None)
        self.stream = servicer.WatchOwnership(request, context)  # type: ignore[assignment]
        self.received: list[Received] = []
        self.reading = asyncio.Event()
        self.reading.set()
        self.delay_s = 0.0
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            await self.reading.wait()
            await asyncio.sleep(self.delay_s)
            message = await anext(self.stream)
            self.received.append(Received(message, time.monotonic()))

    def heartbeats(self) -> list[Received]:
        return [r for r in self.received if r.message.heartbeat]

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self.stream.aclose()


@contextlib.asynccontextmanager
async def serving(
    log: MemoryLog, catch_up_delay_s: float = 0.0, follow_delay_s: float = 0.0
) -> AsyncIterator[Any]:
    """A follower of ``log`` (caught up) and a LoadBalancerServicer over it."""
    client = SlowChannel(MemoryChannelLog(log), catch_up_delay_s, follow_delay_s)
    async with ChannelFollower(client) as follower:
        await asyncio.wait_for(follower.wait_ready(), 5)
        servicer = LoadBalancerServicer(
            lookup=cast(Any, None), follower=follower, link=cast(Any, None)
        )
        yield follower, servicer


async def test_heartbeats_wait_for_a_read_barrier_and_vouch_no_later_than_it_began() -> None:
    log = MemoryLog()
    log.append(bundle(1), value(ServiceUnitState.Assigning, 1, dst="broker-1"))
    async with serving(log, catch_up_delay_s=0.1) as (follower, servicer):
        reader, quiet = Reader(servicer, heartbeat_ms=10), Reader(servicer, heartbeat_ms=0)
        try:
            await until(lambda: any(r.message.snapshot_done for r in reader.received))
            await asyncio.sleep(0.1)
            assert reader.heartbeats() == []  # nothing to vouch with yet
            began = time.monotonic()
            await follower.barrier()  # takes 0.1 s: the claim is when it began, not ended
            await until(lambda: len(reader.heartbeats()) >= 3)
            for beat in reader.heartbeats():
                assert beat.claims <= began + ROUNDING_S
            assert reader.heartbeats()[-1].claims > began - 0.05  # and not much earlier
            assert not any(r.message.heartbeat for r in quiet.received)  # 0: never asked for
            assert [r.message.bundle for r in quiet.received] == [bundle(1), ""]
        finally:
            await reader.close()
            await quiet.close()


async def test_a_heartbeat_comes_after_every_change_it_vouches_for_even_behind_a_backlog() -> None:
    log = MemoryLog()
    async with serving(log) as (follower, servicer):
        reader = Reader(servicer, heartbeat_ms=10)
        try:
            await until(lambda: any(r.message.snapshot_done for r in reader.received))
            await follower.barrier()
            await until(lambda: len(reader.heartbeats()) >= 2)

            reader.reading.clear()  # a slow client: changes pile up behind it
            await asyncio.sleep(0.05)
            appended: dict[str, float] = {}
            for i in range(300):
                log.append(bundle(i), value(ServiceUnitState.Assigning, 1, dst="broker-1"))
                appended[bundle(i)] = time.monotonic()
            await follower.barrier()  # its mark is queued behind the 300 changes
            await asyncio.sleep(0.05)  # heartbeats fall due meanwhile
            reader.delay_s = 0.002  # and while the client reads the backlog, slowly
            reader.reading.set()
            await until(lambda: len(reader.received) > 310)
            reader.delay_s = 0.0
            await asyncio.sleep(0.05)
            await follower.barrier()  # began after the reader caught up again
            last_append = max(appended.values())
            await until(lambda: any(b.claims > last_append for b in reader.heartbeats()))
            check_every_heartbeat_came_after_the_changes_it_claims(reader.received, appended)
        finally:
            await reader.close()


async def test_a_heartbeat_waits_for_the_follower_to_apply_what_the_channel_held() -> None:
    log = MemoryLog()
    async with serving(log, follow_delay_s=0.002) as (follower, servicer):
        reader = Reader(servicer, heartbeat_ms=10)
        try:
            await until(lambda: any(r.message.snapshot_done for r in reader.received))
            await follower.barrier()
            await until(lambda: len(reader.heartbeats()) >= 2)
            appended: dict[str, float] = {}
            for i in range(200):  # the follower needs 0.4 s to apply them
                log.append(bundle(i), value(ServiceUnitState.Assigning, 1, dst="broker-1"))
                appended[bundle(i)] = time.monotonic()
            await asyncio.sleep(0.05)  # heartbeats sample the barrier count meanwhile
            await follower.barrier()  # begun at once, done once all 200 are applied
            last_append = max(appended.values())
            await until(lambda: any(b.claims > last_append for b in reader.heartbeats()))
            check_every_heartbeat_came_after_the_changes_it_claims(reader.received, appended)
        finally:
            await reader.close()


def check_every_heartbeat_came_after_the_changes_it_claims(
    received: list[Received], appended: dict[str, float]
) -> None:
    seen: set[str] = set()
    for item in received:
        if item.message.heartbeat:
            missing = [b for b, at in appended.items() if at < item.claims and b not in seen]
            assert missing == [], f"a heartbeat claims {len(missing)} unsent changes"
        else:
            seen.add(item.message.bundle)
