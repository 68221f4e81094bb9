"""One client's connection to the front: the Pulsar commands a producer, consumer or reader uses.

Frames are read as they come and handled in order. What needs no waiting (SEND, FLOW, ACK, PING)
is handled at once on the event loop; what does (LOOKUP, PRODUCER, SUBSCRIBE, a close, a seek)
runs in a task of its own and answers by request id, as the client expects. A frame that is not
Pulsar's, or a command a client never sends, ends the connection with a reason in the log and a
count in ``lbd_front_bad_frames_total``; every other connection carries on.

What the connection asks of the front (serving, lookups, refusals) is :class:`FrontServices`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Coroutine
from typing import Any, Protocol, cast

from lbd.core.errors import InvalidInputError, LbdError
from lbd.core.ids import BundleId
from lbd.front import wire
from lbd.front.handles import ClientConsumer, ClientProducer, Handle, Services, State
from lbd.front.served import Topic
from lbd.front.storage import PROTOCOL_VERSION, StorageRefusedError, StorageUnavailableError
from lbd.front.wire import Command, Frame, FrameDecoder, FrameError, Type
from lbd.gen.pulsar import pulsar_api_pb2 as api

_log = logging.getLogger(__name__)

E = api.ServerError
RECENTLY_CLOSED = 1024
"""Ids of handles closed lately whose stray frames are ignored (a client keeps sending on a
producer until it reads the close)."""


class Answer(Protocol):
    """A lookup's answer, as the front decided it."""

    @property
    def response(self) -> int:
        """``CommandLookupTopicResponse.LookupType``."""

    @property
    def service_url(self) -> str: ...
    @property
    def service_url_tls(self) -> str: ...
    @property
    def authoritative(self) -> bool: ...
    @property
    def error(self) -> int:
        """A ``ServerError`` when the response is Failed."""

    @property
    def message(self) -> str: ...


class FrontServices(Services, Protocol):
    """What a connection asks of the front, beyond what a handle asks."""

    broker_id: str
    max_message_size: int

    def serving_bundle(self, topic: Topic) -> BundleId | None:
        """The bundle the front serves ``topic`` in now; None when it serves no bundle of it."""

    async def lookup(self, topic: str, authoritative: bool) -> Answer:
        """Where the client should produce to or consume ``topic``."""

    def not_served(self, topic: Topic) -> str:
        """Why ``topic`` is not served here, for a refusal's message."""

    def register(self, handle: Handle) -> None:
        """A handle begins opening."""

    def unregister(self, handle: Handle) -> None:
        """A handle is gone."""

    def producer_written(self, producer: ClientProducer, accepted_ns: int, message_id: Any) -> None:
        """Storage receipted a send the producer's client made."""

    def count_bad_frame(self, reason: str) -> None:
        """A connection sent something it should not have."""

    def count_refusal(self, what: str) -> None:
        """A PRODUCER or SUBSCRIBE was refused because the front does not serve the topic."""

    def connection_closed(self, connection: ClientConnection) -> None:
        """The connection is gone."""


class Gate(Protocol):
    """Who counts connections in and out (the server's limits)."""

    def admit(self, connection: ClientConnection) -> bool:
        """Count a new connection in; False to refuse it (it is closed at once)."""

    def release(self, connection: ClientConnection) -> None:
        """A connection that was admitted is gone."""


class _BadFrame(LbdError):
    """Ends the connection: what the peer sent is not something a Pulsar client sends."""


_FROM_SERVER = frozenset(
    {
        Type.CONNECTED,
        Type.SEND_RECEIPT,
        Type.SEND_ERROR,
        Type.MESSAGE,
        Type.SUCCESS,
        Type.ERROR,
        Type.PRODUCER_SUCCESS,
        Type.PARTITIONED_METADATA_RESPONSE,
        Type.LOOKUP_RESPONSE,
        Type.GET_LAST_MESSAGE_ID_RESPONSE,
        Type.ACTIVE_CONSUMER_CHANGE,
        Type.REACHED_END_OF_TOPIC,
        Type.ACK_RESPONSE,
    }
)
"""Commands only a server sends: a client that sends one is not speaking the protocol."""

_ids = itertools.count(1)


class ClientConnection(asyncio.Protocol):
    """The server side of one client connection."""

    def __init__(
        self,
        front: FrontServices,
        *,
        tls: bool,
        max_frame_size: int,
        gate: Gate | None = None,
    ) -> None:
        self.front = front
        self._gate = gate
        self._admitted = False
        self.id = next(_ids)
        self._tls = tls
        self._decoder = FrameDecoder(max_frame_size)
        self._transport: asyncio.Transport | None = None
        self._out: wire.Coalescer | None = None
        self.peer = "?"
        self.connected = False
        self.opened_at = time.monotonic()
        self.last_heard = self.opened_at
        self.pinged = False
        self._producers: dict[int, ClientProducer] = {}
        self._consumers: dict[int, ClientConsumer] = {}
        self._recently_closed: dict[tuple[str, int], None] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._producer_names = itertools.count(1)

    def __repr__(self) -> str:
        return f"connection {self.id} from {self.peer}"

    @property
    def tls(self) -> bool:
        """Whether the client connected with TLS."""
        return self._tls

    @property
    def handles(self) -> list[Handle]:
        """The connection's producers and consumers."""
        return [*self._producers.values(), *self._consumers.values()]

    # -- writing -------------------------------------------------------------------------------

    def write(self, command: Command, payload: bytes | None = None) -> None:
        """Send a frame to the client (at the end of this turn of the loop, with the others);
        dropped once the connection is closing."""
        if self._out is not None and not self._closed:
            self._out.write(wire.encode(command, payload))

    def forget(self, handle: Handle) -> None:
        """Drop a closed handle from the connection's tables (its stray frames are ignored)."""
        table: dict[int, Any] = self._producers if handle.kind == "producer" else self._consumers
        if table.get(handle.client_id) is handle:
            del table[handle.client_id]
        self._recently_closed[(handle.kind, handle.client_id)] = None
        if len(self._recently_closed) > RECENTLY_CLOSED:
            del self._recently_closed[next(iter(self._recently_closed))]
        self.front.unregister(handle)

    def close(self, reason: str) -> None:
        """Close the connection; its handles close with it."""
        if self._closed:
            return
        _log.info("%s closed: %s", self, reason)
        self._closed = True
        if self._transport is not None:
            if self._out is not None:
                self._out.flush()  # an ERROR written just before goes out first
            self._transport.close()
        self._end()

    def ping(self) -> None:
        """Ask the client for a sign of life (the server's keepalive)."""
        self.pinged = True
        self.write(Command(type=Type.PING, ping=api.CommandPing()))

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._transport = cast(asyncio.Transport, transport)
        self._out = wire.Coalescer(self._transport)
        peer = self._transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if self._gate is not None:
            if not self._gate.admit(self):
                self._closed = True
                transport.close()
                return
            self._admitted = True

    def data_received(self, data: bytes) -> None:
        self.last_heard = time.monotonic()
        self.pinged = False
        try:
            frames = self._decoder.feed(data)
            for frame in frames:
                if self._closed:
                    return
                self._handle(frame)
        except (FrameError, _BadFrame) as e:
            reason = "unreadable frame" if isinstance(e, FrameError) else "bad command"
            self.front.count_bad_frame(reason)
            _log.warning("%s: %s: %s", self, reason, e)
            self.close(f"{reason}: {e}")

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if not self._closed:
            self._closed = True
            _log.debug("%s lost: %s", self, exc or "closed by the client")
            self._end()

    def _end(self) -> None:
        for task in self._tasks:
            task.cancel()
        for handle in self.handles:
            handle.client_closed()
            self.forget(handle)
        self.front.connection_closed(self)
        if self._admitted and self._gate is not None:
            self._admitted = False
            self._gate.release(self)

    # -- commands ------------------------------------------------------------------------------

    def _handle(self, frame: Frame) -> None:
        kind = frame.type
        command = frame.command
        if not self.connected:
            if kind != Type.CONNECT:
                raise _BadFrame(f"{wire.type_name(kind)} before CONNECT")
            self._connect(command.connect)
        elif kind == Type.SEND:
            self._send(command.send, frame.payload)
        elif kind == Type.FLOW:
            consumer = self._consumer(command.flow.consumer_id)
            if consumer is not None:
                consumer.flow(command.flow.messagePermits)
        elif kind == Type.ACK:
            self._ack(command.ack)
        elif kind == Type.PING:
            self.write(Command(type=Type.PONG, pong=api.CommandPong()))
        elif kind == Type.PONG:
            pass
        elif kind == Type.LOOKUP:
            self._spawn(self._lookup(command.lookupTopic), "lookup")
        elif kind == Type.PARTITIONED_METADATA:
            self._partitioned_metadata(command.partitionMetadata)
        elif kind == Type.PRODUCER:
            self._spawn(self._producer(command.producer), "producer")
        elif kind == Type.SUBSCRIBE:
            self._spawn(self._subscribe(command.subscribe), "subscribe")
        elif kind == Type.REDELIVER_UNACKNOWLEDGED_MESSAGES:
            redeliver = command.redeliverUnacknowledgedMessages
            consumer = self._consumer(redeliver.consumer_id)
            if consumer is not None:
                consumer.redeliver(redeliver)
        elif kind == Type.CLOSE_PRODUCER:
            self._spawn(self._close_producer(command.close_producer), "close producer")
        elif kind == Type.CLOSE_CONSUMER:
            self._spawn(self._close_consumer(command.close_consumer), "close consumer")
        elif kind == Type.GET_LAST_MESSAGE_ID:
            self._spawn(self._last_message_id(command.getLastMessageId), "last message id")
        elif kind == Type.SEEK:
            self._spawn(self._seek(command.seek), "seek")
        elif kind == Type.UNSUBSCRIBE:
            self._spawn(self._unsubscribe(command.unsubscribe), "unsubscribe")
        elif kind == Type.CONNECT:
            raise _BadFrame("a second CONNECT")
        elif kind in _FROM_SERVER:
            raise _BadFrame(f"{wire.type_name(kind)} is sent by servers, not clients")
        else:
            # Known to Pulsar but not served here (schemas, stats, transactions...): the client
            # gets an error it can show, and the connection stays.
            self.front.count_bad_frame("unsupported command")
            _log.info("%s: %s is not supported", self, wire.type_name(kind))
            self._error(0, E.NotAllowedError, f"{wire.type_name(kind)} is not supported")

    def _connect(self, connect: api.CommandConnect) -> None:
        self.connected = True
        version = min(connect.protocol_version, PROTOCOL_VERSION)
        _log.debug("%s: CONNECT from %s (protocol %d)", self, connect.client_version, version)
        self.write(
            Command(
                type=Type.CONNECTED,
                connected=api.CommandConnected(
                    server_version=f"lbd-front/{self.front.broker_id}",
                    protocol_version=version,
                    max_message_size=self.front.max_message_size,
                ),
            )
        )

    def _send(self, send: api.CommandSend, payload: bytes | None) -> None:
        producer = self._producers.get(send.producer_id)
        if producer is None:
            if ("producer", send.producer_id) in self._recently_closed:
                return  # the client has not read the close yet; it will send it again
            raise _BadFrame(f"SEND on producer {send.producer_id}, which was never opened here")
        if producer.state is State.OPENING:
            raise _BadFrame(f"SEND on producer {send.producer_id} before it was created")
        producer.send(send, payload)

    def _ack(self, ack: api.CommandAck) -> None:
        consumer = self._consumer(ack.consumer_id)
        taken = consumer is not None and consumer.ack(ack)
        if ack.HasField("request_id"):
            response = api.CommandAckResponse(
                consumer_id=ack.consumer_id, request_id=ack.request_id
            )
            if not taken:
                response.error = E.ServiceNotReady
                response.message = "the acknowledgement was not taken: the topic is moving"
            self.write(Command(type=Type.ACK_RESPONSE, ackResponse=response))

    def _consumer(self, consumer_id: int) -> ClientConsumer | None:
        """The consumer a FLOW, ACK or redelivery names. One that is not open here is ignored,
        as Apache Pulsar does: the official client acknowledges on the connection it last
        subscribed on, even when that subscription was refused."""
        consumer = self._consumers.get(consumer_id)
        if consumer is None and ("consumer", consumer_id) not in self._recently_closed:
            self.front.count_bad_frame("unknown consumer")
        return consumer

    def _partitioned_metadata(self, request: api.CommandPartitionedTopicMetadata) -> None:
        response = api.CommandPartitionedTopicMetadataResponse(request_id=request.request_id)
        try:
            Topic.parse(request.topic)
        except InvalidInputError as e:
            response.response = api.CommandPartitionedTopicMetadataResponse.Failed
            response.error = E.InvalidTopicName
            response.message = str(e)
        else:
            # Every topic is a topic of its own: lbd keeps no partitioned-topic metadata (a
            # partition `-partition-N` is a topic to lbd, as to Pulsar's bundles).
            response.response = api.CommandPartitionedTopicMetadataResponse.Success
            response.partitions = 0
        self.write(
            Command(type=Type.PARTITIONED_METADATA_RESPONSE, partitionMetadataResponse=response)
        )

    async def _lookup(self, request: api.CommandLookupTopic) -> None:
        answer = await self.front.lookup(request.topic, request.authoritative)
        response = api.CommandLookupTopicResponse(
            request_id=request.request_id,
            response=answer.response,  # type: ignore[arg-type]
            authoritative=answer.authoritative,
        )
        if answer.response == api.CommandLookupTopicResponse.Failed:
            response.error = answer.error  # type: ignore[assignment]
            response.message = answer.message
        else:
            if answer.service_url:
                response.brokerServiceUrl = answer.service_url
            if answer.service_url_tls:
                response.brokerServiceUrlTls = answer.service_url_tls
        self.write(Command(type=Type.LOOKUP_RESPONSE, lookupTopicResponse=response))

    async def _producer(self, request: api.CommandProducer) -> None:
        topic = self._topic(request.request_id, request.topic)
        if topic is None:
            return
        existing = self._producers.get(request.producer_id)
        if existing is not None:
            if existing.state is State.OPEN and existing.topic == topic:
                self._producer_success(request, existing.name)  # the client asked again
            else:
                self._error(
                    request.request_id,
                    E.ServiceNotReady,
                    f"producer {request.producer_id} is already present on the connection",
                )
            return
        bundle = self.front.serving_bundle(topic)
        if bundle is None:
            self.front.count_refusal("producer")
            self._error(request.request_id, E.ServiceNotReady, self.front.not_served(topic))
            return
        name = request.producer_name or (
            f"{self.front.broker_id}-{self.id}-{next(self._producer_names)}"
        )
        producer = ClientProducer(
            self, self.front, request, topic, bundle, name, self.front.producer_written
        )
        self._producers[request.producer_id] = producer
        if await self._open(producer, request.request_id):
            self._producer_success(request, name)

    def _producer_success(self, request: api.CommandProducer, name: str) -> None:
        self.write(
            Command(
                type=Type.PRODUCER_SUCCESS,
                producer_success=api.CommandProducerSuccess(
                    request_id=request.request_id,
                    producer_name=name,
                    last_sequence_id=-1,
                    producer_ready=True,
                ),
            )
        )

    async def _subscribe(self, request: api.CommandSubscribe) -> None:
        topic = self._topic(request.request_id, request.topic)
        if topic is None:
            return
        if request.consumer_id in self._consumers:
            existing = self._consumers[request.consumer_id]
            if existing.state is State.OPEN and existing.topic == topic:
                self._success(request.request_id)
            else:
                self._error(
                    request.request_id,
                    E.ServiceNotReady,
                    f"consumer {request.consumer_id} is already present on the connection",
                )
            return
        bundle = self.front.serving_bundle(topic)
        if bundle is None:
            self.front.count_refusal("consumer")
            self._error(request.request_id, E.ServiceNotReady, self.front.not_served(topic))
            return
        consumer = ClientConsumer(self, self.front, request, topic, bundle)
        self._consumers[request.consumer_id] = consumer
        if await self._open(consumer, request.request_id):
            self._success(request.request_id)

    async def _open(self, handle: ClientProducer | ClientConsumer, request_id: int) -> bool:
        """Open the handle's storage side; answer the client's request when it fails."""
        self.front.register(handle)
        try:
            await handle.storage.open()
        except (StorageUnavailableError, StorageRefusedError) as e:
            handle.open_failed()
            self.forget(handle)
            # Pulsar's errors a client gives up on (ConsumerBusy, ProducerBusy...) would end
            # the client's handle for good: everything storage refuses is retryable here.
            _log.info("%s: %s", handle, e)
            self._error(request_id, E.ServiceNotReady, f"{handle.kind} not opened: {e}")
            return False
        except BaseException:
            handle.open_failed()
            self.forget(handle)
            raise
        if not handle.opened():
            self.forget(handle)
            self.front.count_refusal(handle.kind)
            self._error(
                request_id,
                E.ServiceNotReady,
                f"{handle.topic.name} moved while the {handle.kind} was opening; look it up again",
            )
            return False
        return True

    def _topic(self, request_id: int, text: str) -> Topic | None:
        try:
            return Topic.parse(text)
        except InvalidInputError as e:
            self._error(request_id, E.InvalidTopicName, str(e))
            return None

    async def _close_producer(self, request: api.CommandCloseProducer) -> None:
        producer = self._producers.get(request.producer_id)
        if producer is not None:
            producer.client_closed()
            self.forget(producer)
        self._success(request.request_id)

    async def _close_consumer(self, request: api.CommandCloseConsumer) -> None:
        consumer = self._consumers.get(request.consumer_id)
        if consumer is not None:
            consumer.fence()
            self.forget(consumer)
            await consumer.stop_storage(drain_s=5.0)
            consumer.client_closed()
        self._success(request.request_id)

    async def _last_message_id(self, request: api.CommandGetLastMessageId) -> None:
        consumer = self._consumers.get(request.consumer_id)
        if consumer is None or not consumer.open:
            self._error(request.request_id, E.ConsumerNotFound, "no such consumer")
            return
        try:
            answer = await consumer.storage.last_message_id()
        except (StorageUnavailableError, StorageRefusedError) as e:
            self._error(request.request_id, E.ServiceNotReady, str(e))
            return
        response = api.CommandGetLastMessageIdResponse()
        response.CopyFrom(answer)
        response.request_id = request.request_id
        self.write(
            Command(type=Type.GET_LAST_MESSAGE_ID_RESPONSE, getLastMessageIdResponse=response)
        )

    async def _seek(self, request: api.CommandSeek) -> None:
        consumer = self._consumers.get(request.consumer_id)
        if consumer is None or not consumer.open:
            self._error(request.request_id, E.ConsumerNotFound, "no such consumer")
            return
        try:
            await consumer.storage.seek(request)
        except StorageRefusedError as e:
            self._error(request.request_id, e.code, str(e))
        except StorageUnavailableError as e:
            self._error(request.request_id, E.ServiceNotReady, str(e))
        else:
            consumer.rewound()
            self._success(request.request_id)

    async def _unsubscribe(self, request: api.CommandUnsubscribe) -> None:
        consumer = self._consumers.get(request.consumer_id)
        if consumer is None or not consumer.open:
            self._error(request.request_id, E.ConsumerNotFound, "no such consumer")
            return
        try:
            await consumer.storage.unsubscribe(request.force)
        except StorageRefusedError as e:
            self._error(request.request_id, e.code, str(e))
            return
        except StorageUnavailableError as e:
            self._error(request.request_id, E.ServiceNotReady, str(e))
            return
        consumer.client_closed()
        self.forget(consumer)
        self._success(request.request_id)

    def _success(self, request_id: int) -> None:
        self.write(Command(type=Type.SUCCESS, success=api.CommandSuccess(request_id=request_id)))

    def _error(self, request_id: int, code: int, message: str) -> None:
        self.write(
            Command(
                type=Type.ERROR,
                error=api.CommandError(request_id=request_id, error=code, message=message),  # type: ignore[arg-type]
            )
        )

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=f"{self} {what}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            _log.error("%s: %s failed", self, task.get_name(), exc_info=error)
            self.close(f"internal error: {error}")
