"""The state channel on a persistent Pulsar topic (the :class:`~lbd.ports.channel.ChannelLog` port).

Publishing uses one unbatched producer keyed by bundle id, so every message has its own entry and
its position is known once the broker persisted it. A batch (:meth:`PulsarChannelLog.publish_batch`)
is one message under the reserved key :data:`BATCH_KEY` whose value lists its entries
(:func:`encode_batch`); the index of an entry within it is its position's ``batch_index``. lbd's
own batches, not the Pulsar producer's: the entries share one entry of the ledger, so Pulsar
persists them whole or not at all, and every reader unpacks them in the same order.

Following uses readers only (a second exclusive consumer drops pulsar-lite's whole connection). A
reader starts strictly after the last delivered position by passing that ``MessageId`` to
``create_reader`` (works on pulsar-lite as on Pulsar; ``seek`` does not, so a reader is never
moved, only replaced). Every delivered position is remembered and anything not past it is dropped:
pulsar-lite repeats messages on catch-up, and Pulsar is at-least-once too. Three ways a reader
could lose messages are guarded against:

- a cancelled ``read_next``: the client still completes it with the next message, which is then
  lost to the reader; so a read is never abandoned on a reader that stays in use (no read
  timeouts), only together with its reader;
- the client's own reconnect: a resubscribed reader resumes where the server puts it; rather than
  trust every server to honour the resume position, a reader seen disconnected is replaced by a
  new one started after the last delivered position;
- a position that skips entries of its ledger, the first message read of a ledger included
  (Pulsar numbers a ledger's entries from 0 without gaps, so a skip means a message was not
  delivered, or came out of order): the reader is replaced once to re-read from the last delivered
  position; if the same position follows again, the skip is real (Pulsar's marker entries, which
  readers never see, or ledgers trimmed by retention) and it is accepted.

Bootstrap: pulsar-lite fails ``has_message_available`` on a topic that never had a message, which
:meth:`PulsarChannelLog.catch_up` and :meth:`PulsarChannelLog.last_after` need to find the end of
the log. On that failure it writes one message with the reserved key :data:`BOOTSTRAP_KEY`
(readers skip it) and asks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import Any, Final, TypeVar

from lbd.adapters.pulsar_client import (
    PULSAR_ERRORS,
    PulsarConnection,
    close_quietly,
    is_unknown_error,
    start_id,
    to_position,
    unavailable,
)
from lbd.core.table import ChannelPosition
from lbd.ports.channel import (
    RESERVED_KEY_PREFIX,
    ChannelFormatError,
    ChannelMessage,
    check_publishable_batch,
    check_publishable_key,
)
from lbd.ports.errors import UnavailableError
from lbd.tasks import cancel_and_wait

BOOTSTRAP_KEY: Final = f"{RESERVED_KEY_PREFIX}bootstrap__"
"""Key of the marker written into a never-written channel topic so its end can be found."""
BATCH_KEY: Final = f"{RESERVED_KEY_PREFIX}batch__"
"""Key of a message that carries a batch of entries (:func:`encode_batch`)."""
_BATCH_FORMAT: Final = 1
"""The first byte of a batch's value: the version of its layout."""
_LENGTH = struct.Struct(">I")

_MAX_PENDING_SENDS: Final = 1000
"""Sends in flight per producer (the client's queue size; beyond it the client refuses sends)."""
_WATCH_INTERVAL_S: Final = 0.1
"""How often a waiting follower checks that its reader is still connected."""
_PUMP_QUEUE: Final = 1000
"""Messages a follower's reader reads ahead of the follower at most."""
_END_READ_TIMEOUT_S: Final = 2.0
"""How long a read barrier waits for a message the broker says the topic has past its reader."""
_RETRY_MIN_S: Final = 0.1
_RETRY_MAX_S: Final = 0.5
"""Readers are replaced at most this long apart while Pulsar is away: the follower (and with it
lookups that need an assignment) is back within half a second of Pulsar's return."""

_log = logging.getLogger(__name__)
T = TypeVar("T")


class _ReReadError(Exception):
    """The current reader may have skipped a message: replace it, starting after ``cursor.last``."""


def encode_batch(entries: Sequence[tuple[str, bytes]]) -> bytes:
    """A batch's value: the layout version, then each entry as its key and its value, each
    preceded by its length in 4 bytes (big-endian); the key in UTF-8."""
    parts = [bytes((_BATCH_FORMAT,))]
    for key, value in entries:
        encoded = key.encode()
        parts += (_LENGTH.pack(len(encoded)), encoded, _LENGTH.pack(len(value)), value)
    return b"".join(parts)


def decode_batch(data: bytes) -> list[tuple[str, bytes]]:
    """The entries of a batch's value, in order.

    Raises :class:`ChannelFormatError` for a layout this version does not know, and ValueError
    for a value that is not a batch of the known layout.
    """
    if not data:
        raise ValueError("a batch with no content")
    if data[0] != _BATCH_FORMAT:
        raise ChannelFormatError(
            f"a channel batch in layout {data[0]}, which this version of lbd cannot read "
            f"(it reads layout {_BATCH_FORMAT}): upgrade this sidecar"
        )
    entries: list[tuple[str, bytes]] = []
    offset = 1
    try:
        while offset < len(data):
            parts: list[bytes] = []
            for _ in range(2):
                (length,) = _LENGTH.unpack_from(data, offset)
                offset += _LENGTH.size
                if offset + length > len(data):
                    raise ValueError(f"a length of {length} runs past the end at {offset}")
                parts.append(data[offset : offset + length])
                offset += length
            entries.append((parts[0].decode(), parts[1]))
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"a truncated or garbled batch: {e}") from e
    if not entries:
        raise ValueError("a batch with no entries")
    return entries


class _Cursor:
    """The last position delivered by one reading, and the filter every message passes through."""

    def __init__(self, after: ChannelPosition | None) -> None:
        self.last = after
        self._accepted_skip: ChannelPosition | None = None

    def admit(self, message: Any) -> list[ChannelMessage]:
        """What to deliver of ``message``: its entries past the last delivered position (none
        for a repeat, a malformed batch or a marker); :class:`_ReReadError` on a skip, and
        :class:`ChannelFormatError` for a message this version cannot read."""
        position = to_position(message.message_id())
        last = self.last
        entry = (position.ledger_id, position.entry_id)
        if last is not None and entry < (last.ledger_id, last.entry_id):
            return []
        # A message read again after an entry of its batch: only its later entries are new.
        same_entry = last is not None and entry == (last.ledger_id, last.entry_id)
        if not same_entry and _skips(last, position) and position != self._accepted_skip:
            # Accepted if it comes right after ``last`` again, from a fresh reader.
            self._accepted_skip = position
            after = "the start of the log" if last is None else last
            raise _ReReadError(f"position {position} skips entries after {after}")
        delivered = [m for m in _unpack(position, message) if last is None or m.position > last]
        if delivered:
            self.last = delivered[-1].position
        elif last is None or position > last:
            self.last = position
        return delivered


def _unpack(position: ChannelPosition, message: Any) -> list[ChannelMessage]:
    """The entries one message of the log carries."""
    key = message.partition_key()
    if not key.startswith(RESERVED_KEY_PREFIX):
        return [ChannelMessage(position, key, message.data())]
    if key == BOOTSTRAP_KEY:
        return []
    if key != BATCH_KEY:
        raise ChannelFormatError(
            f"a channel message at {position} with the reserved key {key!r}, which this version "
            "of lbd does not know: upgrade this sidecar"
        )
    try:
        entries = decode_batch(message.data())
    except ValueError as e:
        # Every reader skips it alike, so the tables stay equal; the writer has a bug.
        _log.warning("channel: skipped a malformed batch at %s: %s", position, e)
        return []
    return [
        ChannelMessage(ChannelPosition(position.ledger_id, position.entry_id, index), key, value)
        for index, (key, value) in enumerate(entries)
    ]


def _skips(last: ChannelPosition | None, position: ChannelPosition) -> bool:
    """Whether ``position`` leaves out entries of its ledger that should have come after ``last``.

    The first message read of a ledger, from the start of the log (``last`` None) or after another
    ledger, should be its entry 0: pulsar-lite was seen, rarely and under load, to start a reader
    created at ``earliest`` some entries into the topic.
    """
    if last is None or position.ledger_id != last.ledger_id:
        return position.entry_id > 0
    return position.entry_id > last.entry_id + 1


class _End:
    """The reader :meth:`PulsarChannelLog.last_after` keeps open between read barriers: it reads
    each message of the log once, so finding the end again costs one question (is there more?),
    not a reader made and closed per barrier: a subscription on the broker each time."""

    def __init__(self, reader: Any, start: ChannelPosition | None) -> None:
        self.reader = reader
        self.start = start
        """It has read (or will read) everything after this."""
        self.cursor = _Cursor(start)
        self.last_delivered: ChannelPosition | None = None
        """The last position it delivered past :attr:`start`; None: none yet."""

    def covers(self, after: ChannelPosition | None) -> bool:
        """Whether it reads everything after ``after``: it started there or before."""
        return self.start is None or (after is not None and after >= self.start)

    def last_after(self, after: ChannelPosition | None) -> ChannelPosition | None:
        """The last position it delivered after ``after`` (which it covers)."""
        last = self.last_delivered
        return last if last is not None and (after is None or last > after) else None


class _Pumped:
    """A reader whose messages one task reads ahead into a bounded queue, in order.

    Awaiting the queue costs a follower less per message than a task and a timed wait around
    every ``read_next``: at about 4,000 messages/s, publish-to-delivery p50 went from 185 ms to
    100 ms in one process that publishes and follows. The pump's pending read is cancelled only
    together with the reader, which is then discarded: a message it took off the reader is lost
    with that reader only.
    """

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.queue: asyncio.Queue[Any] = asyncio.Queue(_PUMP_QUEUE)
        self.task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        try:
            while True:
                await self.queue.put(await self.reader.read_next())
        except Exception as e:  # handed to the follower, in order, after every message
            await self.queue.put(e)


class PulsarChannelLog:
    """The state channel on ``topic``, read and written through ``connection``."""

    def __init__(
        self, connection: PulsarConnection, topic: str, *, send_timeout_s: float | None = None
    ) -> None:
        """``send_timeout_s``: how long the client keeps trying to deliver a write before it
        fails it (the connection's operation timeout when None). Give the deadline its callers
        wait (``pulsar.publish_timeout_s``): a write they gave up on while Pulsar was away must
        not land once it returns, long after, where its age makes an assignment look stuck."""
        if send_timeout_s is not None and send_timeout_s <= 0:
            raise ValueError(f"send_timeout_s must be > 0 seconds, got {send_timeout_s}")
        self._connection = connection
        self._topic = topic
        self._send_timeout_s = (
            connection.operation_timeout_s if send_timeout_s is None else send_timeout_s
        )
        self._producer: Any = None
        self._producer_lock = asyncio.Lock()
        self._send_slots = asyncio.Semaphore(_MAX_PENDING_SENDS)
        self._readers: set[Any] = set()
        self._end: _End | None = None
        self._end_lock = asyncio.Lock()
        self._inflight: set[asyncio.Future[Any]] = set()
        self._closing: set[asyncio.Future[None]] = set()
        self._closed = asyncio.Event()

    @property
    def topic(self) -> str:
        """The channel topic."""
        return self._topic

    # -- publishing -------------------------------------------------------------------------

    async def publish(self, key: str, value: bytes) -> ChannelPosition:
        """Append ``value`` under ``key``; its position once persisted (see the port)."""
        check_publishable_key(key)
        return await self._send(key, value)

    async def publish_batch(self, entries: Sequence[tuple[str, bytes]]) -> list[ChannelPosition]:
        """Append ``entries`` as one message; their positions once persisted (see the port)."""
        check_publishable_batch(entries)
        position = await self._send(BATCH_KEY, encode_batch(entries))
        return [
            ChannelPosition(position.ledger_id, position.entry_id, index)
            for index in range(len(entries))
        ]

    async def _send(self, key: str, value: bytes) -> ChannelPosition:
        producer = await self._get_producer()
        async with self._send_slots:
            try:
                message_id = await self._cancel_on_close(producer.send(value, partition_key=key))
            except PULSAR_ERRORS as e:
                await self._drop_producer(producer)
                raise unavailable(f"publishing {key} to {self._topic}", e) from e
        return to_position(message_id)

    async def _drop_producer(self, producer: Any) -> None:
        """Forget a producer whose send failed: the client would retry its connection with a
        backoff that grows to a minute, so the next publish makes a new one at once."""
        async with self._producer_lock:
            if self._producer is not producer:
                return
            self._producer = None
        self._close_in_background(producer, f"the producer of {self._topic}")

    def _close_in_background(self, closeable: Any, what: str) -> None:
        """Close a producer or reader without waiting: closing waits for the broker, which may
        be gone. Reaped at :meth:`close`."""
        closing = asyncio.ensure_future(close_quietly(closeable, what))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def _get_producer(self) -> Any:
        async with self._producer_lock:
            self._check_open()
            if self._producer is None:
                try:
                    self._producer = await self._cancel_on_close(
                        self._connection.client.create_producer(
                            self._topic,
                            batching_enabled=False,
                            send_timeout_millis=round(self._send_timeout_s * 1000),
                            max_pending_messages=_MAX_PENDING_SENDS,
                            block_if_queue_full=False,
                        )
                    )
                except PULSAR_ERRORS as e:
                    raise unavailable(f"creating a producer on {self._topic}", e) from e
            return self._producer

    # -- following --------------------------------------------------------------------------

    async def follow(self, after: ChannelPosition | None) -> AsyncGenerator[ChannelMessage, None]:
        """Every message after ``after``, in order, forever (see the port)."""
        cursor = _Cursor(after)
        while True:
            reader = await self._open_reader_retrying(cursor.last)
            if reader is None:
                return
            pumped = _Pumped(reader)
            try:
                while True:
                    message = await self._read_watched(pumped)
                    if message is None:
                        break
                    try:
                        admitted = cursor.admit(message)
                    except _ReReadError as e:
                        _log.info("channel %s: re-reading: %s", self._topic, e)
                        break
                    for entry in admitted:
                        yield entry
            finally:
                await cancel_and_wait(pumped.task)
                await self._discard_reader(reader)

    async def _open_reader_retrying(self, after: ChannelPosition | None) -> Any:
        """A reader starting after ``after``, retrying until one is made; None once closed."""
        delay = _RETRY_MIN_S
        failures = 0
        while not self._closed.is_set():
            try:
                reader = await self._open_reader(after)
            except UnavailableError as e:
                if self._closed.is_set():
                    break
                failures += 1
                # One warning per outage; the retries in between are routine.
                _log.log(logging.WARNING if failures == 1 else logging.DEBUG, "%s", e)
            else:
                if failures:
                    _log.info("channel %s: reading again after %s", self._topic, after)
                return reader
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._closed.wait()
            delay = min(delay * 2, _RETRY_MAX_S)
        return None

    async def _read_watched(self, pumped: _Pumped) -> Any:
        """The reader's next message; None if the reader lost its connection or failed, or the
        log closed.

        Messages the pump already read are taken without waiting; only an empty queue is
        watched, every :data:`_WATCH_INTERVAL_S`, for a lost connection.
        """
        queue = pumped.queue
        if queue.empty():
            get = asyncio.ensure_future(queue.get())
            self._inflight.add(get)
            try:
                while True:
                    done, _ = await asyncio.wait((get,), timeout=_WATCH_INTERVAL_S)
                    if done:
                        break
                    if self._closed.is_set():
                        return None
                    if not pumped.reader.is_connected():
                        _log.warning(
                            "channel %s: reader lost its connection; replacing it", self._topic
                        )
                        return None
            finally:
                self._inflight.discard(get)
                get.cancel()  # an item a cancelled get took stays in the queue
            if get.cancelled():
                return None
            item = get.result()
        else:
            item = queue.get_nowait()
        if isinstance(item, PULSAR_ERRORS):
            _log.warning("channel %s: reading failed (%s); replacing the reader", self._topic, item)
            return None
        if isinstance(item, Exception):
            raise item
        return item

    # -- catching up ------------------------------------------------------------------------

    async def catch_up(self, after: ChannelPosition | None) -> AsyncGenerator[ChannelMessage, None]:
        """Every message after ``after`` up to the end of the log now, then end (see the port)."""
        cursor = _Cursor(after)
        reader, more = await self._reader_finding_the_end(after)
        try:
            while more:
                message = await self._read_once(reader)
                try:
                    admitted = cursor.admit(message)
                except _ReReadError as e:
                    _log.info("channel %s: re-reading: %s", self._topic, e)
                    await self._discard_reader(reader)
                    reader = None
                    reader = await self._open_reader(cursor.last)
                    admitted = []
                for entry in admitted:
                    yield entry
                more = await self._has_message_available(reader)
        finally:
            if reader is not None:
                await self._discard_reader(reader)

    async def last_after(self, after: ChannelPosition | None) -> ChannelPosition | None:
        """The last position :meth:`catch_up` delivers after ``after`` (see the port).

        One reader stays open from call to call (:class:`_End`) and reads to the end each time,
        filtered as catch-up is (what the log wrote for itself, what it delivered twice): a read
        barrier on a quiet channel is one question to the broker. It is made again for an
        ``after`` before its start (a follower that went back to re-read), when it was seen
        disconnected (a resumed reader may have been put past what came meanwhile), and after a
        failure or a cancellation (a read it abandoned takes a message with it)."""
        async with self._end_lock:
            end = self._end
            if end is not None and not (end.covers(after) and end.reader.is_connected()):
                self._forget_end()
                end = None
            try:
                if end is None:
                    end = await self._open_end(after)
                await self._read_to_end(end)
            except BaseException:
                self._forget_end()
                raise
            return end.last_after(after)

    async def _open_end(self, after: ChannelPosition | None) -> _End:
        """A new :class:`_End` starting after ``after``."""
        reader, _ = await self._reader_finding_the_end(after)
        end = self._end = _End(reader, after)
        return end

    async def _reader_finding_the_end(self, after: ChannelPosition | None) -> tuple[Any, bool]:
        """A reader starting after ``after``, and whether the log has more past it. On a topic
        never written, pulsar-lite cannot tell its end: the bootstrap marker is written first
        and a new reader asks again. A reader that fails is discarded; the caller discards the
        one returned."""
        reader = await self._open_reader(after)
        try:
            try:
                return reader, await self._has_message_available(reader)
            except UnavailableError as e:
                if not is_unknown_error(e.__cause__ or e):
                    raise
            await self._discard_reader(reader)
            await self._bootstrap()
            reader = await self._open_reader(after)
            return reader, await self._has_message_available(reader)
        except BaseException:
            await self._discard_reader(reader)  # a reader discarded already is left alone
            raise

    async def _read_to_end(self, end: _End) -> None:
        """Read what ``end``'s reader has not read yet, up to the end of the log now.

        A message the broker says is there but that does not come within
        :data:`_END_READ_TIMEOUT_S` means a reader the client resumed past it (pulsar-lite puts a
        resumed reader where the topic then ends): it is replaced once, starting after the last
        position it delivered."""
        timed_out = False
        while await self._has_message_available(end.reader):
            try:
                message = await self._read_once(end.reader, _END_READ_TIMEOUT_S)
                admitted = end.cursor.admit(message)
            except (_ReReadError, UnavailableError) as e:
                if isinstance(e, UnavailableError):
                    if timed_out:
                        raise
                    timed_out = True
                _log.info("channel %s: reading to its end again: %s", self._topic, e)
                reader, end.reader = end.reader, None
                await self._discard_reader(reader)
                end.reader = await self._open_reader(end.cursor.last)
                continue
            if admitted:
                end.last_delivered = admitted[-1].position

    def _forget_end(self) -> None:
        """Drop the reader of :meth:`last_after`; it closes in the background, reaped at close."""
        end, self._end = self._end, None
        if end is None or end.reader is None or end.reader not in self._readers:
            return
        self._readers.discard(end.reader)
        self._close_in_background(end.reader, f"a reader of {self._topic}")

    async def _bootstrap(self) -> None:
        position = await self._send(BOOTSTRAP_KEY, b"")
        _log.info("channel %s: wrote the bootstrap marker at %s", self._topic, position)

    async def _has_message_available(self, reader: Any) -> bool:
        try:
            available: bool = await self._cancel_on_close(reader.has_message_available())
        except PULSAR_ERRORS as e:
            raise unavailable(f"looking for the end of {self._topic}", e) from e
        return available

    async def _read_once(self, reader: Any, timeout_s: float | None = None) -> Any:
        """The reader's next message, within ``timeout_s`` (the operation timeout when None, or
        when that is shorter)."""
        limit = self._connection.operation_timeout_s
        if timeout_s is not None:
            limit = min(limit, timeout_s)
        try:
            async with asyncio.timeout(limit):
                return await self._cancel_on_close(reader.read_next())
        except (*PULSAR_ERRORS, TimeoutError) as e:
            raise unavailable(f"reading {self._topic}", e) from e

    # -- readers and lifecycle --------------------------------------------------------------

    async def _open_reader(self, after: ChannelPosition | None) -> Any:
        self._check_open()
        try:
            start, inclusive = start_id(after)
            reader = await self._cancel_on_close(
                self._connection.client.create_reader(
                    self._topic, start, start_message_id_inclusive=inclusive
                )
            )
        except PULSAR_ERRORS as e:
            raise unavailable(f"creating a reader on {self._topic} after {after}", e) from e
        self._readers.add(reader)
        return reader

    async def _discard_reader(self, reader: Any) -> None:
        if reader not in self._readers:
            return
        self._readers.discard(reader)
        await close_quietly(reader, f"a reader of {self._topic}")

    async def _cancel_on_close(self, operation: Awaitable[T]) -> T:
        """Await ``operation``; if the log closes meanwhile, it is cancelled: UnavailableError."""
        self._check_open()
        future = asyncio.ensure_future(operation)
        self._inflight.add(future)
        try:
            return await future
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._closed.is_set() and (current is None or not current.cancelling()):
                raise UnavailableError(f"channel {self._topic} is closed") from None
            raise
        finally:
            self._inflight.discard(future)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise UnavailableError(f"channel {self._topic} is closed")

    async def close(self) -> None:
        """Close the producer and every reader; running followers end. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        for future in list(self._inflight):
            future.cancel()
        readers, self._readers = list(self._readers), set()
        self._end = None
        producer, self._producer = self._producer, None
        for reader in readers:
            await close_quietly(reader, f"a reader of {self._topic}")
        if producer is not None:
            await close_quietly(producer, f"the producer of {self._topic}")
        for closing in list(self._closing):
            await closing
