"""The state channel's read-barrier reader (``PulsarChannelLog.last_after``) against a scripted
client: a reader the client resumed past a message is replaced, not waited on for the whole
operation timeout. (The real pulsar-lite paths are in tests/integration/test_channel_pulsar.py;
this one cannot be provoked there on purpose.)"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from lbd.adapters import pulsar_channel
from lbd.adapters.pulsar_channel import PulsarChannelLog
from lbd.core.table import ChannelPosition
from lbd.ports.errors import UnavailableError

OPERATION_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class _Id:
    ledger: int
    entry: int

    def ledger_id(self) -> int:
        return self.ledger

    def entry_id(self) -> int:
        return self.entry

    def batch_index(self) -> int:
        return -1


@dataclass(frozen=True)
class _Message:
    entry: int

    def message_id(self) -> _Id:
        return _Id(1, self.entry)

    def partition_key(self) -> str:
        return f"t/ns/b{self.entry}"

    def data(self) -> bytes:
        return b"v"


@dataclass(eq=False)
class _Reader:
    """Delivers ``messages`` (entry ids); the broker's topic ends at ``end``. A reader the client
    resumed past some of them (``stalled``) is told more is there but never gets it."""

    messages: list[int]
    end: int
    stalled: bool = False
    delivered: int = -1
    closed: bool = False

    async def has_message_available(self) -> bool:
        return self.delivered < self.end

    async def read_next(self) -> _Message:
        if self.stalled or not self.messages:
            await asyncio.Event().wait()  # what was published meanwhile never comes
        entry = self.messages.pop(0)
        self.delivered = entry
        return _Message(entry)

    def is_connected(self) -> bool:
        return True

    async def close(self) -> None:
        self.closed = True


@dataclass
class _Client:
    readers: list[_Reader]
    starts: list[Any] = field(default_factory=list)

    async def create_reader(self, topic: str, start: Any, **_: Any) -> _Reader:
        self.starts.append((start.ledger_id(), start.entry_id()) if start is not None else None)
        return self.readers.pop(0)


@dataclass
class _Connection:
    client: _Client
    operation_timeout_s: float = OPERATION_TIMEOUT_S


def _position(entry: int) -> ChannelPosition:
    return ChannelPosition(1, entry, -1)


@pytest.fixture(autouse=True)
def short_end_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pulsar_channel, "_END_READ_TIMEOUT_S", 0.05)
    monkeypatch.setattr(
        pulsar_channel, "start_id", lambda after: (after and _Id(1, after.entry_id), False)
    )


async def test_a_reader_resumed_past_the_end_is_replaced_after_the_last_it_delivered() -> None:
    kept = _Reader(messages=[0, 1], end=1)
    client = _Client([kept, _Reader(messages=[2, 3], end=3)])
    channel = PulsarChannelLog(_Connection(client), "t")  # type: ignore[arg-type]

    assert await channel.last_after(None) == _position(1)
    kept.end, kept.stalled = 3, True  # 2 and 3 came while it was away; it resumed past them
    async with asyncio.timeout(5):  # well within the operation timeout
        assert await channel.last_after(_position(1)) == _position(3)
    assert client.starts == [None, (1, 1)]
    assert kept.closed
    await channel.close()


async def test_a_reader_replaced_that_stalls_again_fails_the_barrier_and_is_not_kept() -> None:
    stalled = [_Reader(messages=[], end=0, stalled=True) for _ in range(2)]
    client = _Client([*stalled, _Reader(messages=[0], end=0)])
    channel = PulsarChannelLog(_Connection(client), "t")  # type: ignore[arg-type]

    with pytest.raises(UnavailableError, match="reading t"):
        await channel.last_after(None)
    assert await channel.last_after(None) == _position(0)  # made anew, not the stalled one
    assert client.starts == [None, None, None]
    await channel.close()
