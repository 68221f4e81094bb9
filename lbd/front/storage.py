"""The front's connections to the storage server: one producer or one consumer each.

The brokers of a cluster keep their topics in one shared storage server that speaks Pulsar's
binary protocol (a pulsar-lite in the dev cluster, the role BookKeeper plays in Apache Pulsar).
For each client producer or consumer it serves, the front opens a :class:`StorageProducer` or
:class:`StorageConsumer` on a connection of its own (:class:`StorageLink`), and forwards what the
client sends and what storage delivers.

Why a connection per handle: pulsar-lite drops a whole connection when a second consumer joins
an Exclusive subscription (a consumer a paused former owner still holds, say); on a connection
of its own only that subscription's open fails, and its client retries. Closing a handle closes
its socket, which storage notices at once.

Errors: :class:`StorageUnavailableError` when storage cannot be reached, does not answer within
the timeout, or the connection drops; :class:`StorageRefusedError` (with Pulsar's server error
code) when storage answered with an error. Neither ever escapes a callback: a lost connection
is reported to the handle's ``on_lost``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import secrets
import socket
import ssl
import struct
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from lbd import __version__
from lbd.core.errors import LbdError
from lbd.front import wire
from lbd.front.wire import Command, Frame, FrameDecoder, FrameError, Type
from lbd.gen.pulsar import pulsar_api_pb2 as api

_log = logging.getLogger(__name__)

CLOSE_WAIT_S = 5.0
"""How long a closing storage connection waits for storage to close its side."""

LINGER_AT_CLOSE_S = 1.0
"""How long closing the pool (at shutdown) waits for the connections still closing."""

_LINGERING: weakref.WeakKeyDictionary[asyncio.Transport, asyncio.AbstractEventLoop] = (
    weakref.WeakKeyDictionary()
)
"""Storage connections shut for writing whose socket waits for storage to close its side (held
weakly: one its loop left behind is collected, and warned about, as before)."""

PROTOCOL_VERSION = 20
"""The protocol version the front speaks to storage (and announces to clients at most)."""


def _handle_id() -> int:
    """A producer or consumer id for a new storage handle, unique across the cluster's brokers.

    Each link carries one handle, so an id unique per link would do for Apache Pulsar. But
    pulsar-lite keys consumers by id within a subscription: a second consumer of id 1 on the
    subscription (a former owner's, not yet gone) is refused by closing its whole connection."""
    return secrets.randbits(62) + 1


REWIND_NAME = " !lbd-rewind"
"""The name of the consumer a broker adds to a Failover subscription and removes at once, after
subscribing one of its own (:meth:`StorageConsumer.open`): it sorts before any name a client
gives (a space sorts below every printable character)."""


_STAMP_BASE = 10**20
"""Above any wall time in nanoseconds: the stamp is this less the time, 20 digits."""


def newest_first_name(name: str) -> str:
    """The name a client consumer's storage consumer subscribes with: the client's name, then a
    stamp that falls as wall time goes on.

    A Failover subscription's active consumer is the one whose name sorts first, and pulsar-lite
    breaks a tie of names by the lower consumer id. A storage consumer left behind by a broker
    killed with data unread (DESIGN §1) has the client's name too; with the same name and a
    random id it would stay active over the client's new consumer half of the time, and take
    every message it has permits for. With the stamp the newest storage consumer of one client
    consumer sorts first, while consumers of different names keep their order (a space sorts
    below any printable character)."""
    return f"{name} {_STAMP_BASE - time.time_ns():020d}"


class StorageUnavailableError(LbdError):
    """Storage cannot be reached, did not answer in time, or the connection dropped."""


class StorageRefusedError(LbdError):
    """Storage answered a request with an error."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"storage refused: {api.ServerError.Name(code)}: {message}")
        self.code = code


@dataclass(frozen=True, slots=True)
class StorageAddress:
    """Where the storage server listens, and how to reach it."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 10.0

    @classmethod
    def parse(cls, url: str, **kwargs: Any) -> StorageAddress:
        """``pulsar://host:port`` (or ``pulsar+ssl://`` with ``tls`` given)."""
        scheme, sep, rest = url.partition("://")
        host, colon, port = rest.rstrip("/").rpartition(":")
        if not sep or scheme not in ("pulsar", "pulsar+ssl") or not colon or not port.isdigit():
            raise LbdError(f"storage URL must be pulsar://HOST:PORT, got {url!r}")
        if scheme == "pulsar+ssl" and kwargs.get("tls") is None:
            raise LbdError(f"storage URL {url!r} is TLS: give the front a CA for storage")
        return cls(host.strip("[]"), int(port), **kwargs)


class StorageLink(asyncio.Protocol):
    """One connection to storage: requests answered by request id, fire-and-forget frames, and
    every other frame handed to ``on_frame``. ``on_lost`` is called once when the connection
    ends for any reason other than :meth:`close`."""

    def __init__(
        self,
        address: StorageAddress,
        on_frame: Callable[[Frame], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self._address = address
        self._on_frame = on_frame
        self._on_lost: Callable[[str], None] | None = on_lost
        self._decoder = FrameDecoder()
        self._transport: asyncio.Transport | None = None
        self._out: wire.Coalescer | None = None
        self._requests: dict[int, asyncio.Future[Frame]] = {}
        self._request_ids = itertools.count(1)
        self._connected: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._closed = False

    @classmethod
    async def open(
        cls,
        address: StorageAddress,
        on_frame: Callable[[Frame], None],
        on_lost: Callable[[str], None],
    ) -> StorageLink:
        """Connect and complete the handshake; StorageUnavailableError when it fails."""
        loop = asyncio.get_running_loop()
        link = cls(address, on_frame, on_lost)
        try:
            async with asyncio.timeout(address.connect_timeout_s):
                await loop.create_connection(
                    lambda: link, address.host, address.port, ssl=address.tls
                )
                link._write(
                    Command(
                        type=Type.CONNECT,
                        connect=api.CommandConnect(
                            client_version=f"lbd-front/{__version__}",
                            protocol_version=PROTOCOL_VERSION,
                        ),
                    )
                )
                await link._connected
        except (OSError, TimeoutError) as e:
            link.close()
            why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or str(e))
            raise StorageUnavailableError(
                f"storage {address.host}:{address.port} unreachable: {why}"
            ) from None
        except BaseException:
            link.close()  # cancelled: no connection is left behind
            raise
        return link

    def adopt(self, on_frame: Callable[[Frame], None], on_lost: Callable[[str], None]) -> None:
        """Hand an idle link to the handle that takes it."""
        self._on_frame = on_frame
        self._on_lost = on_lost

    @property
    def open_now(self) -> bool:
        """Whether the connection is up."""
        return self._transport is not None and not self._closed

    @property
    def buffered(self) -> int:
        """Bytes written but not yet taken by the kernel."""
        return self._transport.get_write_buffer_size() if self._transport is not None else 0

    def send(self, command: Command, payload: bytes | None = None) -> None:
        """Write a frame that expects no answer by request id (SEND, FLOW, ACK...)."""
        self._write(command, payload)

    async def request(self, command: Command) -> Frame:
        """Write a request, giving it a request id, and wait for its answer (SUCCESS,
        PRODUCER_SUCCESS, ... or ERROR, raised as StorageRefusedError)."""
        if not self.open_now:
            raise StorageUnavailableError("storage connection closed")
        request_id = next(self._request_ids)
        getattr(command, _REQUESTS[command.type]).request_id = request_id
        future: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self._requests[request_id] = future
        try:
            self._write(command)
            async with asyncio.timeout(self._address.request_timeout_s):
                frame = await future
        except TimeoutError:
            raise StorageUnavailableError(
                f"storage did not answer {wire.type_name(command.type)} within "
                f"{self._address.request_timeout_s:g} s"
            ) from None
        finally:
            self._requests.pop(request_id, None)
        if frame.type == Type.ERROR:
            raise StorageRefusedError(frame.command.error.error, frame.command.error.message)
        return frame

    def close(self, *, reset: bool = False) -> None:
        """End the connection (no ``on_lost`` call, no more frames handed on); idempotent.

        With ``reset``: at once, with a reset, so that the kernel drops whatever it still holds
        for storage (a producer's sends storage never receipted: none of them may land later,
        after another broker took the topic over, when a partition heals).

        Without a reset: the front's side is shut for writing, what storage still sends is read
        and dropped, and the socket closes once storage has closed its side (at most
        :data:`CLOSE_WAIT_S` later). A socket closed with data unread makes the kernel reset the
        connection, and pulsar-lite keeps the consumers of a connection that ends with a reset:
        an Exclusive or Failover subscription would stall behind the dead consumer, with the
        messages storage sent it, until storage restarts (docs/broker-contract.md)."""
        already = self._closed
        self._closed = True
        self._on_lost = None
        transport = self._transport
        if reset and transport is not None and not transport.is_closing():
            _reset(transport)
        elif transport is not None and not already and not transport.is_closing():
            if self._out is not None:
                self._out.flush()
            if transport.can_write_eof():
                transport.write_eof()
                loop = asyncio.get_running_loop()
                _LINGERING[transport] = loop
                loop.call_later(CLOSE_WAIT_S, _abort_if_open, transport)
            else:
                transport.close()  # TLS: its own close handshake ends it
        self._fail_requests("storage connection closed")

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._transport = cast(asyncio.Transport, transport)
        self._out = wire.Coalescer(self._transport)
        if self._closed:
            transport.close()

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return  # closing: read and dropped, so that the socket closes without a reset
        try:
            frames = self._decoder.feed(data)
        except FrameError as e:
            self._lost(f"unreadable frame from storage: {e}")
            return
        for frame in frames:
            self._dispatch(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            _LINGERING.pop(self._transport, None)
        self._transport = None
        self._lost(f"connection to storage lost: {exc}" if exc else "storage closed the connection")

    # -- internals -----------------------------------------------------------------------------

    def _write(self, command: Command, payload: bytes | None = None) -> None:
        if self._out is None or self._closed:
            return
        self._out.write(wire.encode(command, payload))

    def _dispatch(self, frame: Frame) -> None:
        kind = frame.type
        if kind == Type.CONNECTED:
            if not self._connected.done():
                self._connected.set_result(None)
        elif kind == Type.PING:
            self._write(Command(type=Type.PONG, pong=api.CommandPong()))
        elif kind == Type.PONG:
            pass
        elif (request_id := _request_id(frame)) is not None:
            future = self._requests.get(request_id)
            if future is not None and not future.done():
                future.set_result(frame)
        else:
            self._on_frame(frame)

    def _lost(self, why: str) -> None:
        if self._transport is not None:
            self._transport.close()
        if not self._connected.done():
            self._connected.set_exception(OSError(why))
        self._fail_requests(why)
        callback, self._on_lost = self._on_lost, None
        if callback is not None and not self._closed:
            self._closed = True
            callback(why)

    def _fail_requests(self, why: str) -> None:
        for future in self._requests.values():
            if not future.done():
                future.set_exception(StorageUnavailableError(why))
        self._requests.clear()


def _reset(transport: asyncio.Transport) -> None:
    """Abort ``transport`` with a reset (SO_LINGER 0): unsent data is dropped, not sent."""
    sock = transport.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    _LINGERING.pop(transport, None)
    transport.abort()


def _abort_if_open(transport: asyncio.Transport) -> None:
    _LINGERING.pop(transport, None)
    if not transport.is_closing():
        transport.abort()


def _lingering_in(loop: asyncio.AbstractEventLoop) -> list[asyncio.Transport]:
    return [t for t, owner in _LINGERING.items() if owner is loop]


async def _settle_lingering(timeout_s: float) -> None:
    """Wait, at most ``timeout_s``, for this loop's closing storage connections to end; abort
    the rest (the loop may stop before their own timer fires, and leave their sockets open)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    # connection_lost sets no event: polled, for one second at most, at shutdown only
    while _lingering_in(loop) and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    for transport in _lingering_in(loop):
        _abort_if_open(transport)


class StoragePool:
    """Links to storage kept connected and idle, so that a producer or consumer opened when
    its client arrives (after a transfer, say) skips the connect and the handshake. Each link
    taken is the handle's own, as any other; the pool opens another behind it."""

    def __init__(self, address: StorageAddress, size: int = 4) -> None:
        self.address = address
        self._size = size
        self._idle: list[StorageLink] = []
        self._filling: asyncio.Task[None] | None = None
        self._closed = False

    async def connect(
        self, on_frame: Callable[[Frame], None], on_lost: Callable[[str], None]
    ) -> StorageLink:
        """A connected link for one handle; StorageUnavailableError when storage is away."""
        while self._idle:
            link = self._idle.pop()
            if link.open_now:
                link.adopt(on_frame, on_lost)
                self._fill()
                return link
        link = await StorageLink.open(self.address, on_frame, on_lost)
        self._fill()
        return link

    def _fill(self) -> None:
        if self._filling is None and not self._closed and self._size:
            self._filling = asyncio.get_running_loop().create_task(self._open_idle())

    async def _open_idle(self) -> None:
        try:
            while len(self._idle) < self._size and not self._closed:
                slot: list[StorageLink] = []
                link = await StorageLink.open(
                    self.address, _ignore, functools.partial(self._drop, slot)
                )
                slot.append(link)
                self._idle.append(link)
        except StorageUnavailableError:
            pass  # storage is away: the next handle's own open says so, and fills again
        finally:
            self._filling = None

    def _drop(self, slot: list[StorageLink], why: str) -> None:
        """An idle link was lost: it leaves the pool."""
        if slot and slot[0] in self._idle:
            self._idle.remove(slot[0])

    async def close(self) -> None:
        """Close the idle links, and wait (at most LINGER_AT_CLOSE_S) for the closing ones to
        end; idempotent."""
        self._closed = True
        if self._filling is not None:
            self._filling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._filling
        for link in self._idle:
            link.close()
        self._idle.clear()
        await _settle_lingering(LINGER_AT_CLOSE_S)


def _ignore(frame: Frame) -> None:
    """What an idle link does with a frame storage sends it unasked (nothing is open on it)."""


_REQUESTS = {
    Type.PRODUCER: "producer",
    Type.SUBSCRIBE: "subscribe",
    Type.CLOSE_CONSUMER: "close_consumer",
    Type.GET_LAST_MESSAGE_ID: "getLastMessageId",
    Type.SEEK: "seek",
    Type.UNSUBSCRIBE: "unsubscribe",
}
"""The field of each request the front sends storage (where its request id goes)."""

_ANSWERS = {
    Type.SUCCESS: "success",
    Type.ERROR: "error",
    Type.PRODUCER_SUCCESS: "producer_success",
    Type.GET_LAST_MESSAGE_ID_RESPONSE: "getLastMessageIdResponse",
}


_CONSUMER_FIELDS = {
    Type.MESSAGE: "message",
    Type.ACTIVE_CONSUMER_CHANGE: "active_consumer_change",
    Type.REACHED_END_OF_TOPIC: "reachedEndOfTopic",
    Type.CLOSE_CONSUMER: "close_consumer",
}


def _consumer_of(frame: Frame) -> int | None:
    """The consumer id a frame storage sends unasked is for; None for any other frame."""
    field = _CONSUMER_FIELDS.get(frame.type)  # type: ignore[call-overload]
    if field is None:
        return None
    return int(getattr(frame.command, field).consumer_id)


def _request_id(frame: Frame) -> int | None:
    """The request id of an answer to a request, None for any other frame."""
    field = _ANSWERS.get(frame.type)  # type: ignore[call-overload]
    if field is None:
        return None
    return int(getattr(frame.command, field).request_id)


class StorageProducer:
    """A producer on storage for one client producer.

    Sends are written in the order :meth:`send` is called; storage receipts them in that order,
    and each receipt is handed to ``on_receipt`` with the token its send was given.
    ``on_lost(why)`` is called once when the producer can write no more (the connection dropped,
    storage closed it, or storage failed a send): the sends still pending may or may not be
    stored.
    """

    def __init__(
        self,
        pool: StoragePool,
        topic: str,
        on_receipt: Callable[[object, api.MessageIdData], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self._pool = pool
        self._topic = topic
        self._on_receipt = on_receipt
        self._on_lost: Callable[[str], None] | None = on_lost
        self._link: StorageLink | None = None
        self._id = _handle_id()
        self._sequence = itertools.count()
        self._pending: collections.deque[tuple[int, object]] = collections.deque()
        self._drained: asyncio.Event = asyncio.Event()
        self._drained.set()

    @property
    def pending(self) -> int:
        """Sends written and not receipted yet."""
        return len(self._pending)

    def pending_tokens(self) -> list[object]:
        """The tokens of the sends written and not receipted yet, oldest first."""
        return [token for _, token in self._pending]

    @property
    def buffered(self) -> int:
        """Bytes written but not yet taken by the kernel."""
        return self._link.buffered if self._link is not None else 0

    async def open(self) -> None:
        """Create the producer on storage; StorageUnavailableError or StorageRefusedError."""
        self._link = await self._pool.connect(self._frame, self._lost)
        producer = api.CommandProducer(topic=self._topic, producer_id=self._id, request_id=0)
        try:
            await self._link.request(Command(type=Type.PRODUCER, producer=producer))
        except BaseException:
            self.close()
            raise

    def send(self, num_messages: int, payload: bytes, token: object) -> None:
        """Write one SEND (a message or a batch of ``num_messages``) with its payload part."""
        if self._link is None:
            raise StorageUnavailableError("storage producer not open")
        sequence = next(self._sequence)
        self._pending.append((sequence, token))
        self._drained.clear()
        self._link.send(
            Command(
                type=Type.SEND,
                send=api.CommandSend(
                    producer_id=self._id, sequence_id=sequence, num_messages=num_messages
                ),
            ),
            payload,
        )

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every send written so far was receipted; False when it took longer than
        ``timeout_s`` or the producer was lost first."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._drained.wait()
        return not self._pending and self._on_lost is not None

    def close(self) -> None:
        """Close the producer's connection (storage drops the producer); idempotent. With
        sends not receipted, the connection is reset (:meth:`StorageLink.close`)."""
        self._on_lost = None
        if self._link is not None:
            self._link.close(reset=bool(self._pending))
        self._drained.set()

    def _frame(self, frame: Frame) -> None:
        kind = frame.type
        if kind == Type.SEND_RECEIPT:
            receipt = frame.command.send_receipt
            if not self._pending or self._pending[0][0] != receipt.sequence_id:
                head = self._pending[0][0] if self._pending else None
                self._lost(f"receipt for send {receipt.sequence_id} out of order (expected {head})")
                return
            _, token = self._pending.popleft()
            if not self._pending:
                self._drained.set()
            self._on_receipt(token, receipt.message_id)
        elif kind == Type.SEND_ERROR:
            error = frame.command.send_error
            name = api.ServerError.Name(error.error)
            self._lost(f"storage failed a send: {name}: {error.message}")
        elif kind == Type.CLOSE_PRODUCER:
            self._lost("storage closed the producer")
        else:
            _log.debug("storage producer on %s ignores %s", self._topic, wire.type_name(kind))

    def _lost(self, why: str) -> None:
        callback, self._on_lost = self._on_lost, None
        if self._link is not None:
            self._link.close()
        self._drained.set()
        if callback is not None:
            callback(why)


class StorageConsumer:
    """A consumer on storage for one client consumer: its subscription, permits, acks and
    redeliveries pass through; each MESSAGE, ACTIVE_CONSUMER_CHANGE and REACHED_END_OF_TOPIC
    storage sends is handed to ``on_frame`` (the consumer id in it is storage's, not the
    client's). ``on_lost(why)`` is called once when storage can deliver no more."""

    def __init__(
        self,
        pool: StoragePool,
        subscribe: api.CommandSubscribe,
        on_frame: Callable[[Frame], None],
        on_lost: Callable[[str], None],
    ) -> None:
        self._pool = pool
        self._subscribe = api.CommandSubscribe()
        self._subscribe.CopyFrom(subscribe)
        self._id = _handle_id()
        self._subscribe.consumer_id = self._id
        self._subscribe.consumer_name = newest_first_name(subscribe.consumer_name)
        self._on_frame = on_frame
        self._on_lost: Callable[[str], None] | None = on_lost
        self._link: StorageLink | None = None

    async def open(self) -> None:
        """Subscribe on storage; StorageUnavailableError or StorageRefusedError."""
        self._link = await self._pool.connect(self._frame, self._lost)
        try:
            await self._link.request(Command(type=Type.SUBSCRIBE, subscribe=self._subscribe))
            if self._subscribe.subType == api.CommandSubscribe.Failover:
                await self._rewind(self._link)
        except BaseException:
            self.close()
            raise

    async def _rewind(self, link: StorageLink) -> None:
        """Have storage dispatch the subscription again from its first unacknowledged message,
        before the client gives any permit.

        Apache Pulsar rewinds a Failover subscription whenever its active consumer changes.
        pulsar-lite does when the active consumer leaves, not when a new one takes over, so the
        messages it sent a consumer left behind by a killed broker would stay with that one. A
        consumer named to sort first (active while it is there, with no permit) joins and
        leaves."""
        probe = api.CommandSubscribe()
        probe.CopyFrom(self._subscribe)
        probe.consumer_id = _handle_id()
        probe.consumer_name = REWIND_NAME
        try:
            await link.request(Command(type=Type.SUBSCRIBE, subscribe=probe))
        except StorageRefusedError as e:
            _log.warning("%s: no rewind of the subscription: %s", self._subscribe.topic, e)
            return
        close = api.CommandCloseConsumer(consumer_id=probe.consumer_id, request_id=0)
        await link.request(Command(type=Type.CLOSE_CONSUMER, close_consumer=close))

    def flow(self, permits: int) -> None:
        """Let storage deliver ``permits`` more messages."""
        self._send(
            Command(
                type=Type.FLOW,
                flow=api.CommandFlow(consumer_id=self._id, messagePermits=permits),
            )
        )

    def ack(self, ack: api.CommandAck) -> None:
        """Acknowledge on storage what the client acknowledged (an ack receipt's request id is
        dropped: the front answers the client itself)."""
        out = api.CommandAck()
        out.CopyFrom(ack)
        out.consumer_id = self._id
        out.ClearField("request_id")
        self._send(Command(type=Type.ACK, ack=out))

    def redeliver(self, redeliver: api.CommandRedeliverUnacknowledgedMessages) -> None:
        """Ask storage to deliver the client's unacknowledged messages again."""
        out = api.CommandRedeliverUnacknowledgedMessages()
        out.CopyFrom(redeliver)
        out.consumer_id = self._id
        self._send(
            Command(
                type=Type.REDELIVER_UNACKNOWLEDGED_MESSAGES, redeliverUnacknowledgedMessages=out
            )
        )

    async def last_message_id(self) -> api.CommandGetLastMessageIdResponse:
        """Storage's answer to GET_LAST_MESSAGE_ID for this consumer."""
        inner = api.CommandGetLastMessageId(consumer_id=self._id, request_id=0)
        frame = await self._link_now().request(
            Command(type=Type.GET_LAST_MESSAGE_ID, getLastMessageId=inner)
        )
        return frame.command.getLastMessageIdResponse

    async def seek(self, seek: api.CommandSeek) -> None:
        """Reset the subscription as the client asked."""
        inner = api.CommandSeek()
        inner.CopyFrom(seek)
        inner.consumer_id = self._id
        await self._link_now().request(Command(type=Type.SEEK, seek=inner))

    async def unsubscribe(self, force: bool) -> None:
        """Delete the subscription on storage."""
        inner = api.CommandUnsubscribe(consumer_id=self._id, request_id=0, force=force)
        await self._link_now().request(Command(type=Type.UNSUBSCRIBE, unsubscribe=inner))

    async def close_gracefully(self) -> None:
        """Close the consumer on storage and wait for storage to confirm it (so that an Exclusive
        or Failover subscription is free for the next owner), then drop the connection."""
        link = self._link
        self._on_lost = None
        if link is not None and link.open_now:
            inner = api.CommandCloseConsumer(consumer_id=self._id, request_id=0)
            with contextlib.suppress(LbdError):
                await link.request(Command(type=Type.CLOSE_CONSUMER, close_consumer=inner))
        self.close()

    def close(self) -> None:
        """Drop the consumer's connection (storage drops the consumer); idempotent."""
        self._on_lost = None
        if self._link is not None:
            self._link.close()

    def _link_now(self) -> StorageLink:
        if self._link is None or not self._link.open_now:
            raise StorageUnavailableError("storage consumer not open")
        return self._link

    def _send(self, command: Command) -> None:
        if self._link is not None:
            self._link.send(command)

    def _frame(self, frame: Frame) -> None:
        if _consumer_of(frame) not in (self._id, None):
            return  # the rewind's consumer
        if frame.type == Type.CLOSE_CONSUMER:
            self._lost("storage closed the consumer")
        else:
            self._on_frame(frame)

    def _lost(self, why: str) -> None:
        callback, self._on_lost = self._on_lost, None
        if self._link is not None:
            self._link.close()
        if callback is not None:
            callback(why)
