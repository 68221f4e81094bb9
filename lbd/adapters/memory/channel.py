"""The in-memory twin of the state channel: one :class:`MemoryLog` shared by several clients.

Each :class:`MemoryChannelLog` plays one sidecar's Pulsar client on the shared log. Delivery is
deterministic: no threads, no timers. Tests inject what the real log does to its readers: an outage
(:meth:`MemoryLog.go_down`: publishing fails, followers wait, catch-ups fail) and repeated
deliveries (:meth:`MemoryLog.redeliver`), which callers must drop by position.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from lbd.core.table import ChannelPosition
from lbd.ports.channel import ChannelMessage, check_publishable_batch, check_publishable_key
from lbd.ports.errors import UnavailableError


@dataclass(eq=False, slots=True)
class _FollowerState:
    """What :meth:`MemoryLog.redeliver` asks of one running follower."""

    rewind: int = 0


class MemoryLog:
    """An ordered log in memory; positions are ``(ledger_id, 0, -1)``, ``(ledger_id, 1, -1)``...
    and a batch's ``(ledger_id, n, 0)``, ``(ledger_id, n, 1)``..."""

    def __init__(self, ledger_id: int = 0) -> None:
        self._ledger_id = ledger_id
        self._messages: list[ChannelMessage] = []
        self._entries = 0
        self._available = True
        self._publishes_hang = False
        self._changed = asyncio.Event()
        self._followers: set[_FollowerState] = set()

    @property
    def messages(self) -> tuple[ChannelMessage, ...]:
        """Every message appended so far, in order."""
        return tuple(self._messages)

    def __len__(self) -> int:
        return len(self._messages)

    @property
    def available(self) -> bool:
        """Whether the log answers (False between :meth:`go_down` and :meth:`come_back`)."""
        return self._available

    def go_down(self) -> None:
        """Start an outage: publishing and catching up fail, followers wait."""
        self._available = False
        self._notify()

    def come_back(self) -> None:
        """End the outage: followers resume where they were."""
        self._available = True
        self._notify()

    @property
    def publishes_hang(self) -> bool:
        """Whether a publish waits (as a Pulsar producer does while its broker is down)."""
        return self._publishes_hang

    def hang_publishes(self, hang: bool) -> None:
        """Make every publish wait until this is called with False (then it goes through)."""
        self._publishes_hang = hang
        self._notify()

    def redeliver(self, count: int) -> None:
        """Make every running follower deliver its last ``count`` messages again, next."""
        if count < 1:
            raise ValueError(f"redeliver count must be >= 1, got {count}")
        for follower in self._followers:
            follower.rewind = max(follower.rewind, count)
        self._notify()

    def append(self, key: str, value: bytes) -> ChannelPosition:
        """Append without the client-side checks (for the clients of this module)."""
        if not self._available:
            raise UnavailableError("the in-memory channel is down")
        position = ChannelPosition(self._ledger_id, self._entries)
        self._entries += 1
        self._messages.append(ChannelMessage(position, key, value))
        self._notify()
        return position

    def append_batch(self, entries: Sequence[tuple[str, bytes]]) -> list[ChannelPosition]:
        """Append ``entries`` as one batch, without the client-side checks."""
        if not self._available:
            raise UnavailableError("the in-memory channel is down")
        entry = self._entries
        self._entries += 1
        positions = [ChannelPosition(self._ledger_id, entry, i) for i in range(len(entries))]
        self._messages.extend(
            ChannelMessage(position, key, value)
            for position, (key, value) in zip(positions, entries, strict=True)
        )
        self._notify()
        return positions

    def index_after(self, after: ChannelPosition | None) -> int:
        """Index of the first message whose position is greater than ``after``."""
        if after is None:
            return 0
        messages = self._messages
        if not messages or messages[-1].position <= after:
            return len(messages)  # a reader at the end, the common case (a read barrier)
        return bisect.bisect_right(messages, after, key=lambda m: m.position)

    # Used by the clients of this module only.

    def _message_at(self, index: int) -> ChannelMessage | None:
        return self._messages[index] if index < len(self._messages) else None

    def _notify(self) -> None:
        # Waiters hold the old event; a fresh one collects the next round of waiters.
        self._changed.set()
        self._changed = asyncio.Event()


class MemoryChannelLog:
    """One client of a :class:`MemoryLog` (the :class:`~lbd.ports.channel.ChannelLog` port)."""

    def __init__(self, log: MemoryLog) -> None:
        self._log = log
        self._closed = False

    @property
    def log(self) -> MemoryLog:
        """The shared log this client reads and writes."""
        return self._log

    async def publish(self, key: str, value: bytes) -> ChannelPosition:
        """Append ``value`` under ``key``; its position (see the port)."""
        check_publishable_key(key)
        await self._send_turn()
        return self._log.append(key, value)

    async def publish_batch(self, entries: Sequence[tuple[str, bytes]]) -> list[ChannelPosition]:
        """Append ``entries`` as one batch; their positions (see the port)."""
        check_publishable_batch(entries)
        await self._send_turn()
        return self._log.append_batch(entries)

    async def _send_turn(self) -> None:
        """Wait as a send does, open before and after: a suspension point (concurrent
        publishers interleave), and for as long as publishes hang."""
        self._check_open()
        await asyncio.sleep(0)
        while self._log.publishes_hang:
            await self._log._changed.wait()
        self._check_open()

    async def follow(self, after: ChannelPosition | None) -> AsyncGenerator[ChannelMessage, None]:
        """Every message after ``after``, in order, until closed (see the port)."""
        state = _FollowerState()
        log = self._log
        first = next_index = log.index_after(after)
        log._followers.add(state)
        try:
            while not self._closed:
                changed = log._changed
                if log.available:
                    if state.rewind:
                        next_index = max(first, next_index - state.rewind)
                        state.rewind = 0
                    message = log._message_at(next_index)
                    if message is not None:
                        next_index += 1
                        yield message
                        continue
                await changed.wait()
        finally:
            log._followers.discard(state)

    async def catch_up(self, after: ChannelPosition | None) -> AsyncGenerator[ChannelMessage, None]:
        """Every message after ``after`` up to the end of the log now, then end (see the port)."""
        self._check_open()
        self._check_available()
        end = len(self._log)
        for index in range(self._log.index_after(after), end):
            message = self._log._message_at(index)
            assert message is not None  # the log only grows
            yield message
            await asyncio.sleep(0)
            self._check_open()
            self._check_available()

    async def last_after(self, after: ChannelPosition | None) -> ChannelPosition | None:
        """The last message's position when one lies after ``after`` (see the port)."""
        self._check_open()
        self._check_available()
        log = self._log
        end = len(log)
        if log.index_after(after) >= end:
            return None
        last = log._message_at(end - 1)
        assert last is not None  # the log only grows
        return last.position

    async def close(self) -> None:
        """Close this client; its followers end. Idempotent."""
        if not self._closed:
            self._closed = True
            self._log._notify()

    def _check_open(self) -> None:
        if self._closed:
            raise UnavailableError("the in-memory channel client is closed")

    def _check_available(self) -> None:
        if not self._log.available:
            raise UnavailableError("the in-memory channel is down")
