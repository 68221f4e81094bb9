"""Start-up's deadline (``cluster.startup_timeout_s``): reading a long state channel takes as long
as it keeps making progress; a channel that stops giving messages fails the start, naming the
step."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator

import pytest
from harness import Harness, Sidecar, settle

from lbd.adapters.clock import ManualClock
from lbd.adapters.memory.channel import MemoryChannelLog, MemoryLog
from lbd.core.ids import BrokerId
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, encode_value
from lbd.core.table import ChannelPosition
from lbd.ports.channel import ChannelMessage
from lbd.ports.errors import UnavailableError

TIMEOUT_S = 0.2
MESSAGES = 24
PER_MESSAGE_S = 0.03
"""A catch-up of MESSAGES takes about 0.7 s of the harness's clock: several start-up timeouts,
with progress all along."""


class _SlowCatchUp(MemoryChannelLog):
    """A channel client whose catch-up gives a message every ``PER_MESSAGE_S`` of ``clock``, and
    none at all after ``stall_after`` messages."""

    def __init__(self, log: MemoryLog, clock: ManualClock, stall_after: int | None = None) -> None:
        super().__init__(log)
        self._clock = clock
        self._stall_after = stall_after

    async def catch_up(self, after: ChannelPosition | None) -> AsyncGenerator[ChannelMessage, None]:
        given = 0
        async for message in super().catch_up(after):
            if self._stall_after is not None and given >= self._stall_after:
                await asyncio.Event().wait()
            await self._clock.sleep(PER_MESSAGE_S)
            given += 1
            yield message


def _harness() -> Harness:
    harness = Harness()
    timings = dataclasses.replace(harness.config.timings, startup_timeout_s=TIMEOUT_S)
    harness.config = dataclasses.replace(harness.config, timings=timings)
    return harness


async def _fill(log: MemoryLog) -> None:
    writer = MemoryChannelLog(log)
    for i in range(MESSAGES):
        value = ServiceUnitStateData(
            state=ServiceUnitState.Owned, version_id=1, dst_broker=BrokerId("elsewhere")
        )
        await writer.publish(f"bench/start/0x{i:08x}_0x{i + 1:08x}", encode_value(value))


async def _add_while_time_runs(h: Harness, channel: _SlowCatchUp) -> tuple[Sidecar, float]:
    """Add a sidecar on ``channel`` while the harness's clock runs; the sidecar and how much of
    that clock its start took."""
    started = h.clock.monotonic()
    adding = asyncio.ensure_future(h.add("broker-a", channel=channel))
    try:
        await settle(h.clock, adding.done, step=0.01)
    finally:
        adding.cancel()
    return adding.result(), h.clock.monotonic() - started


async def test_a_long_channel_is_read_to_its_end_while_every_stretch_gives_messages() -> None:
    async with _harness() as h:
        await _fill(h.log)
        sidecar, took = await _add_while_time_runs(h, _SlowCatchUp(h.log, h.clock))
        assert took > 3 * TIMEOUT_S  # longer than the timeout, and it started all the same
        assert len(sidecar.follower.table) >= MESSAGES


async def test_a_channel_that_stops_giving_messages_fails_the_start_naming_the_step() -> None:
    async with _harness() as h:
        await _fill(h.log)
        started = h.clock.monotonic()
        with pytest.raises(
            UnavailableError,
            match=r"did not start within 0\.2s \(cluster\.startup_timeout_s\): reading the "
            r"state channel from Pulsar did not finish",
        ):
            await _add_while_time_runs(h, _SlowCatchUp(h.log, h.clock, stall_after=5))
        # Five messages of progress, then the timeout without any.
        took = h.clock.monotonic() - started
        assert 5 * PER_MESSAGE_S + TIMEOUT_S <= took < 5 * PER_MESSAGE_S + 2 * TIMEOUT_S
