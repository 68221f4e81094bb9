"""The ChannelLog contract on the in-memory twin, plus the faults tests can inject into it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from lbd.adapters.memory.channel import MemoryChannelLog, MemoryLog
from lbd.ports.errors import UnavailableError
from tests.contract.channel_suite import ChannelFactory, ChannelLogContract, catch_up_all, take


@pytest.fixture
def memory_log() -> MemoryLog:
    return MemoryLog()


@pytest.fixture
async def memory_channels(memory_log: MemoryLog) -> AsyncIterator[ChannelFactory]:
    channels: list[MemoryChannelLog] = []

    def make() -> MemoryChannelLog:
        channel = MemoryChannelLog(memory_log)
        channels.append(channel)
        return channel

    yield make
    for channel in channels:
        await channel.close()


class TestMemoryChannel(ChannelLogContract):
    @pytest.fixture
    def new_channel(self, memory_channels: ChannelFactory) -> ChannelFactory:
        return memory_channels


async def test_an_outage_fails_publishing_and_stalls_followers_until_it_ends(
    memory_log: MemoryLog, memory_channels: ChannelFactory
) -> None:
    writer, reader = memory_channels(), memory_channels()
    first = await writer.publish("t/ns/a", b"1")
    async with contextlib.aclosing(reader.follow(None)) as follower:
        assert [m.position for m in await take(follower, 1)] == [first]

        memory_log.go_down()
        with pytest.raises(UnavailableError, match="down"):
            await writer.publish("t/ns/a", b"2")
        with pytest.raises(UnavailableError, match="down"):
            await catch_up_all(reader, None)
        with pytest.raises(UnavailableError, match="down"):
            await reader.last_after(None)
        pending = asyncio.ensure_future(take(follower, 1))
        await asyncio.sleep(0)
        assert not pending.done()

        memory_log.come_back()
        second = await writer.publish("t/ns/a", b"3")
        assert [(m.position, m.value) for m in await pending] == [(second, b"3")]


async def test_an_outage_during_catch_up_fails_it(
    memory_log: MemoryLog, memory_channels: ChannelFactory
) -> None:
    channel = memory_channels()
    for i in range(3):
        await channel.publish("t/ns/a", b"%d" % i)
    async with contextlib.aclosing(channel.catch_up(None)) as messages:
        first = await anext(messages)
        assert first.value == b"0"
        memory_log.go_down()
        with pytest.raises(UnavailableError):
            await anext(messages)


async def test_redeliver_repeats_the_last_messages_to_running_followers(
    memory_log: MemoryLog, memory_channels: ChannelFactory
) -> None:
    channel = memory_channels()
    positions = [await channel.publish("t/ns/a", b"%d" % i) for i in range(4)]
    async with contextlib.aclosing(channel.follow(positions[0])) as follower:
        delivered = [(await anext(follower)).position for _ in range(3)]
        assert delivered == positions[1:]

        memory_log.redeliver(5)
        newest = await channel.publish("t/ns/a", b"4")

        # Never before where the follower started, and every repeat in order again.
        repeated = [(await anext(follower)).position for _ in range(4)]
        assert repeated == [*positions[1:], newest]


def test_redeliver_needs_a_positive_count(memory_log: MemoryLog) -> None:
    with pytest.raises(ValueError, match="count must be >= 1"):
        memory_log.redeliver(0)
