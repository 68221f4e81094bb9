"""Group commit for the state channel: values handed over while a write is under way go together.

A sidecar writes many values at once when the leader repairs orphans, when brokers take their
bundles, in bulk assignment and in splits. Published one by one, every value costs a send and a
receipt, and on every sidecar a read: that per-message cost bounded orphan repair
(docs/performance.md). The writer has at most one message on its way; what is handed to it
meanwhile goes out as the next message, one batch (:meth:`ChannelLog.publish_batch`). A value
handed over alone is published alone, at once: a lone write waits for nothing.

Safety (docs/safety.md). A batch carries each value exactly as its writer decided it, in the order
the values were handed over. Readers apply its values one by one in that order, each judged by the
resolver against the table the values before it left, as they would consecutive messages: the
first valid change still wins, and every sidecar applies the same sequence. A batch is persisted
whole or not at all. A value whose writer gave up before it was sent (its deadline, a cancellation)
is not sent.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Final

from lbd.core.errors import DeadlineError
from lbd.core.table import ChannelPosition
from lbd.ports.channel import MAX_BATCH_ENTRIES, ChannelLog, check_publishable_key
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.services.channel.deadlines import within
from lbd.tasks import cancel_and_wait

_log = logging.getLogger(__name__)

MAX_BATCH_BYTES: Final = 512 * 1024
"""Most bytes of values one batch carries (a value larger than this goes alone): well under
Pulsar's 5 MB message limit, so that one batch does not hold the next back for long."""


@dataclass(eq=False, slots=True)
class _Write:
    key: str
    value: bytes
    written: asyncio.Future[ChannelPosition]


class BatchingWriter:
    """Publishes values to the channel, batching those handed over while a message is on its way.

    ``max_values`` bounds a batch (1: every value is a message of its own); a message the channel
    has not taken within ``send_timeout_s`` of ``clock`` time fails every value in it with
    UnavailableError (it may still land later; the resolver judges it then like any other).
    """

    def __init__(
        self, channel: ChannelLog, clock: Clock, *, max_values: int, send_timeout_s: float
    ) -> None:
        if not 1 <= max_values <= MAX_BATCH_ENTRIES:
            raise ValueError(f"max_values must be within 1..{MAX_BATCH_ENTRIES}, got {max_values}")
        self._channel = channel
        self._clock = clock
        self._max_values = max_values
        self._send_timeout_s = send_timeout_s
        self._queue: collections.deque[_Write] = collections.deque()
        self._sender: asyncio.Task[None] | None = None
        self._sending: list[_Write] = []
        self._closed = False
        self.messages_sent = 0
        """Messages sent so far (each one value or one batch)."""

    async def publish(self, key: str, value: bytes) -> ChannelPosition:
        """Publish ``value`` under ``key``, alone or in a batch; its position once persisted.

        Raises :class:`UnavailableError` when the channel does not take it (or the writer is
        closed), and :class:`~lbd.core.errors.InvalidInputError` for a key the channel refuses.
        Cancelling the call before the value was sent withdraws it.
        """
        check_publishable_key(key)  # here, so that a bad key fails alone, not a whole batch
        if self._closed:
            raise UnavailableError("the state-channel writer is closed")
        written: asyncio.Future[ChannelPosition] = asyncio.get_running_loop().create_future()
        self._queue.append(_Write(key, value, written))
        if self._sender is None:
            self._sender = asyncio.ensure_future(self._send_queued())
        return await written

    async def close(self) -> None:
        """Stop sending; values not yet persisted fail with UnavailableError. Idempotent."""
        self._closed = True
        sender, self._sender = self._sender, None
        await cancel_and_wait(sender)
        unsent = [*self._sending, *self._queue]
        self._sending = []
        self._queue.clear()
        for write in unsent:
            if not write.written.done():
                write.written.set_exception(UnavailableError("the state-channel writer closed"))

    async def _send_queued(self) -> None:
        """Send what is queued, a batch at a time, until nothing is; then end."""
        try:
            while self._queue:
                self._sending = self._take()
                if self._sending:
                    await self._send(self._sending)
                self._sending = []
        finally:
            if self._sender is asyncio.current_task():
                self._sender = None

    def _take(self) -> list[_Write]:
        """The next batch: queued values whose writers still wait, within the bounds."""
        batch: list[_Write] = []
        size = 0
        while self._queue and len(batch) < self._max_values:
            write = self._queue[0]
            if write.written.done():  # withdrawn
                self._queue.popleft()
                continue
            if batch and size + len(write.value) > MAX_BATCH_BYTES:
                break
            self._queue.popleft()
            batch.append(write)
            size += len(write.value)
        return batch

    async def _send(self, batch: list[_Write]) -> None:
        try:
            if len(batch) == 1:
                positions = [
                    await within(
                        self._clock,
                        self._send_timeout_s,
                        self._channel.publish(batch[0].key, batch[0].value),
                        "a state-channel write",
                    )
                ]
            else:
                positions = await within(
                    self._clock,
                    self._send_timeout_s,
                    self._channel.publish_batch([(w.key, w.value) for w in batch]),
                    f"a state-channel batch of {len(batch)} values",
                )
        except DeadlineError as e:
            self._fail(batch, UnavailableError(f"the state channel is not taking writes: {e}"))
        except Exception as e:  # UnavailableError, InvalidInputError: every writer hears it
            self._fail(batch, e)
        else:
            self.messages_sent += 1
            for write, position in zip(batch, positions, strict=True):
                if not write.written.done():
                    write.written.set_result(position)

    @staticmethod
    def _fail(batch: list[_Write], error: Exception) -> None:
        if len(batch) > 1:
            _log.debug("a state-channel batch of %d values failed: %s", len(batch), error)
        for write in batch:
            if not write.written.done():
                write.written.set_exception(error)
