"""A client's producers and consumers as the front serves them, each paired with its handle on
storage.

A handle goes through four states:

- ``OPENING``: the client asked; its storage handle is being opened. It is registered already,
  so that a Release arriving meanwhile fences it too and waits for it.
- ``OPEN``: frames pass through both ways. A SEND or ACK is forwarded only if the front serves
  the topic's bundle *at that instant* (:meth:`Services.accepts`); one that arrives otherwise is
  the first sign that the bundle went, and fences the handle.
- ``FENCED``: nothing more goes to storage and nothing more is delivered; receipts of sends
  written before still reach the client (they were stored while the front served the topic, and
  a client that gets them will not send them again). The client is not told yet.
- ``CLOSED``: the client was told (CLOSE_PRODUCER / CLOSE_CONSUMER, with the new owner's URL
  after a transfer) or closed it itself; the storage handle is closed.

What a handle needs of the rest of the front is the small :class:`Services` protocol, so that
this module knows nothing of the server, the session with the sidecar or the lookups.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from lbd.core.ids import BundleId
from lbd.front.served import Topic
from lbd.front.storage import StorageConsumer, StoragePool, StorageProducer
from lbd.front.traffic import TopicTraffic
from lbd.front.wire import Command, Frame, Type
from lbd.gen.pulsar import pulsar_api_pb2 as api

_log = logging.getLogger(__name__)


class State(enum.Enum):
    OPENING = "opening"
    OPEN = "open"
    FENCED = "fenced"
    CLOSED = "closed"


_COUNTED = frozenset({State.OPEN, State.FENCED})


class Client(Protocol):
    """The client connection a handle belongs to."""

    def write(self, command: Command, payload: bytes | None = None) -> None:
        """Send a frame to the client (dropped when the connection is gone)."""

    def forget(self, handle: Handle) -> None:
        """The handle is closed: drop it from the connection's tables."""

    @property
    def tls(self) -> bool:
        """Whether the client connected with TLS (it is sent the TLS URL of a new owner)."""


class Services(Protocol):
    """What a handle asks of the front."""

    storage: StoragePool

    def accepts(self, handle: Handle) -> bool:
        """Whether the front serves ``handle``'s topic now (updates ``handle.bundle``)."""

    def handle_lost(self, handle: Handle, why: str) -> None:
        """Storage can no longer carry ``handle``: fence it and tell its client."""

    def unserved(self, handle: Handle) -> None:
        """``accepts`` said no: fence ``handle``, and tell its client unless the Release or
        Close already received for its bundle will."""

    def traffic(self, topic: Topic) -> TopicTraffic:
        """The topic's traffic counters."""

    def repeat_dropped(self) -> None:
        """A consumer dropped a repeat storage sent."""

    def unreceipted(self, handle: Handle, accepted_ns: list[int]) -> None:
        """``handle`` stops with sends written to storage and never receipted (accepted from
        the client at ``accepted_ns``): its client sends them again elsewhere, and storage may
        have stored some of them already (the receipt was what did not come back)."""


@dataclass(frozen=True, slots=True)
class Redirect:
    """Where a closed handle's client should reconnect (PIP-307's assigned broker URL)."""

    service_url: str
    service_url_tls: str


class Handle:
    """What producers and consumers share; see the module docstring."""

    kind = "handle"

    def __init__(
        self, client: Client, services: Services, client_id: int, topic: Topic, bundle: BundleId
    ) -> None:
        self.client = client
        self.services = services
        self.client_id = client_id
        self.topic = topic
        self.bundle = bundle
        """The served bundle holding the topic (a split's child once its parent is closed)."""
        self.state = State.OPENING
        self.traffic = services.traffic(topic)
        self._settled = asyncio.Event()
        """Set once the open has ended, one way or the other."""

    def __repr__(self) -> str:
        return f"{self.kind} {self.client_id} on {self.topic.name} ({self.state.value})"

    @property
    def open(self) -> bool:
        """Whether frames pass through now."""
        return self.state is State.OPEN

    def _set(self, state: State) -> None:
        """Move to ``state``, keeping the topic's count of producers or consumers (a handle
        counts from its open to its close)."""
        counted = self.state in _COUNTED
        self.state = state
        if counted != (state in _COUNTED):
            self._count(1 if state in _COUNTED else -1)

    def _count(self, delta: int) -> None:
        raise NotImplementedError

    def fence(self) -> None:
        """Stop forwarding at once; idempotent, and nothing for a closed handle."""
        if self.state in (State.OPENING, State.OPEN):
            self._set(State.FENCED)

    def opened(self) -> bool:
        """The storage handle is open: the handle opens, unless it was fenced meanwhile (then
        False, and its storage handle is closed)."""
        self._settled.set()
        if self.state is State.OPENING:
            self._set(State.OPEN)
            return True
        self._set(State.CLOSED)
        self.close_storage()
        return False

    def unfence(self) -> None:
        """Forward again: the topic is served after all (a split's child of a closed parent)."""
        if self.state is State.FENCED:
            self._set(State.OPEN)

    def open_failed(self) -> None:
        """The storage handle could not be opened."""
        self._settled.set()
        self._set(State.CLOSED)

    async def stop_storage(self, drain_s: float) -> None:
        """Once the handle is fenced: wait for an open in progress, let storage confirm what it
        has (receipts of the sends written, the consumer's close), then close the storage
        handle."""
        await self._settled.wait()
        await self._stop_storage(drain_s)

    async def _stop_storage(self, drain_s: float) -> None:
        self.close_storage()

    def close_storage(self) -> None:
        """Close the storage handle at once."""

    def tell_client(self, redirect: Redirect | None) -> None:
        """Close the handle and tell its client, naming where to reconnect (None: the client
        looks the topic up again)."""
        if self.state is State.CLOSED:
            return
        self._set(State.CLOSED)
        self.close_storage()
        self.client.forget(self)
        url, url_tls = (redirect.service_url, redirect.service_url_tls) if redirect else ("", "")
        self.client.write(self._close_command(url, url_tls))

    def client_closed(self) -> None:
        """The client closed the handle, or its connection is gone."""
        self._set(State.CLOSED)
        self.close_storage()

    def _close_command(self, url: str, url_tls: str) -> Command:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class _Send:
    """A send written to storage, as its receipt will need it."""

    sequence_id: int
    highest_sequence_id: int
    accepted_ns: int


class ClientProducer(Handle):
    """A client's producer, writing through a :class:`StorageProducer`."""

    kind = "producer"

    def __init__(
        self,
        client: Client,
        services: Services,
        command: api.CommandProducer,
        topic: Topic,
        bundle: BundleId,
        name: str,
        on_write: Callable[[ClientProducer, int, api.MessageIdData], None],
    ) -> None:
        super().__init__(client, services, command.producer_id, topic, bundle)
        self.name = name
        self._on_write = on_write
        self.storage = StorageProducer(services.storage, topic.name, self._receipt, self._lost)

    def _count(self, delta: int) -> None:
        self.traffic.producers += delta

    def send(self, send: api.CommandSend, payload: bytes | None) -> bool:
        """Forward one SEND if the front serves the topic now; False when it was dropped (the
        handle is fenced then, and its client will be told to reconnect)."""
        if self.state is not State.OPEN:
            return False
        if not self.services.accepts(self):
            self.services.unserved(self)
            return False
        if payload is None:
            payload = b""
        num = send.num_messages
        highest = send.highest_sequence_id or send.sequence_id + num - 1
        self.storage.send(num, payload, _Send(send.sequence_id, highest, time.monotonic_ns()))
        self.traffic.sent(num, len(payload))
        return True

    def _receipt(self, token: object, message_id: api.MessageIdData) -> None:
        assert isinstance(token, _Send)
        if self.state is State.CLOSED:
            return
        receipt = api.CommandSendReceipt(
            producer_id=self.client_id,
            sequence_id=token.sequence_id,
            highest_sequence_id=token.highest_sequence_id,
        )
        receipt.message_id.CopyFrom(message_id)
        self.client.write(Command(type=Type.SEND_RECEIPT, send_receipt=receipt))
        self._on_write(self, token.accepted_ns, message_id)

    def _lost(self, why: str) -> None:
        if self.state in (State.OPEN, State.OPENING):
            self.services.handle_lost(self, why)

    async def _stop_storage(self, drain_s: float) -> None:
        if self.storage.pending and not await self.storage.drain(drain_s):
            _log.warning(
                "%s: %d sends not receipted by storage within %g s; the client will send them "
                "again",
                self,
                self.storage.pending,
                drain_s,
            )
            tokens = self.storage.pending_tokens()
            self.services.unreceipted(self, [t.accepted_ns for t in tokens if isinstance(t, _Send)])
        self.close_storage()

    def close_storage(self) -> None:
        self.storage.close()

    def _close_command(self, url: str, url_tls: str) -> Command:
        close = api.CommandCloseProducer(producer_id=self.client_id, request_id=0)
        if url:
            close.assignedBrokerServiceUrl = url
        if url_tls:
            close.assignedBrokerServiceUrlTls = url_tls
        return Command(type=Type.CLOSE_PRODUCER, close_producer=close)


_ORDERED = frozenset({api.CommandSubscribe.Exclusive, api.CommandSubscribe.Failover})

REMEMBERED = 1024
"""Entries a consumer remembers having delivered, to tell a repeat."""

TOP_UP_INTERVAL_S = 0.1
"""At most this often a consumer gives storage back the permits of dropped repeats on its own."""


class ClientConsumer(Handle):
    """A client's consumer, reading through a :class:`StorageConsumer`.

    A first delivery (redelivery count 0) of an entry this consumer was delivered already, on an
    Exclusive or Failover subscription, is a repeat, which a pulsar-lite catching up sends
    (DESIGN §1): after a restart of storage, about once per FLOW. The consumer drops it and
    counts it. Apache Pulsar never sends one; its own redeliveries (a count above 0, or after
    the client asked for them) pass. Only the :data:`REMEMBERED` latest entries are
    remembered: the repeats seen are of the last one or two.

    A dropped repeat used a permit the client does not know of. It goes back with the client's
    next FLOW, not at once: a permit returned alone makes pulsar-lite resume, and repeat, again.
    Only when storage has no permit left while the client still waits for messages is it
    returned on its own, at most every :data:`TOP_UP_INTERVAL_S`.
    """

    kind = "consumer"

    def __init__(
        self,
        client: Client,
        services: Services,
        command: api.CommandSubscribe,
        topic: Topic,
        bundle: BundleId,
    ) -> None:
        super().__init__(client, services, command.consumer_id, topic, bundle)
        self.subscription = command.subscription
        self.storage = StorageConsumer(services.storage, command, self._delivered, self._lost)
        self._ordered = command.subType in _ORDERED
        self._recent: dict[tuple[int, int], None] = {}
        """The latest entries delivered (ordered subscriptions), oldest first; emptied when the
        client asks for a redelivery."""
        self.repeats_dropped = 0
        self._waiting = 0
        """Messages the client gave permits for and has not received."""
        self._budget = 0
        """Permits storage holds (given it, less what it delivered, repeats included)."""
        self._owed = 0
        """Permits of dropped repeats not given back yet."""
        self._topped_up = 0.0
        self._top_up: asyncio.TimerHandle | None = None
        self.top_ups = 0
        self._reported = False

    def _count(self, delta: int) -> None:
        self.traffic.consumers += delta

    def flow(self, permits: int) -> None:
        """Pass the client's permits on (with those of the repeats dropped since the last)."""
        if self.state is State.OPEN:
            self._waiting += permits
            self._give(permits + self._owed)
            self._owed = 0

    def _give(self, permits: int) -> None:
        self._budget += permits
        self.storage.flow(permits)

    def ack(self, ack: api.CommandAck) -> bool:
        """Forward an acknowledgement if the front serves the topic now; False when dropped
        (the message will be delivered again, by the next owner)."""
        if self.state is not State.OPEN:
            return False
        if not self.services.accepts(self):
            self.services.unserved(self)
            return False
        self.storage.ack(ack)
        return True

    def redeliver(self, redeliver: api.CommandRedeliverUnacknowledgedMessages) -> None:
        """Pass a redelivery request on."""
        if self.state is State.OPEN:
            self._recent.clear()  # what comes next is delivered again on purpose
            self.storage.redeliver(redeliver)

    def rewound(self) -> None:
        """The subscription was moved (a seek): deliveries start over."""
        self._recent.clear()

    def _delivered(self, frame: Frame) -> None:
        if self.state is not State.OPEN:
            return  # not acknowledged: storage delivers it again to the next consumer
        command = frame.command
        kind = frame.type
        if kind == Type.MESSAGE:
            message = command.message
            if self._ordered and not message.redelivery_count:
                entry = (message.message_id.ledgerId, message.message_id.entryId)
                if entry in self._recent:
                    self._repeat()
                    return
                self._recent[entry] = None
                if len(self._recent) > REMEMBERED:
                    del self._recent[next(iter(self._recent))]
            self._budget -= 1
            self._waiting -= 1
            if self._owed:
                self._check_starving()
            message.consumer_id = self.client_id
            payload = frame.payload or b""
            self.traffic.delivered(len(payload))
            self.client.write(command, payload)
        elif kind == Type.ACTIVE_CONSUMER_CHANGE:
            command.active_consumer_change.consumer_id = self.client_id
            self.client.write(command)
        elif kind == Type.REACHED_END_OF_TOPIC:
            command.reachedEndOfTopic.consumer_id = self.client_id
            self.client.write(command)

    def _repeat(self) -> None:
        self.repeats_dropped += 1
        self.services.repeat_dropped()
        self._budget -= 1
        self._owed += 1
        self._check_starving()

    def _check_starving(self) -> None:
        """Storage has used its last permit while the client still waits and permits are owed:
        they go back soon (a delivery or a repeat may be the one that used it)."""
        if self._budget <= 0 < self._waiting and self._owed and self._top_up is None:
            wait = self._topped_up + TOP_UP_INTERVAL_S - time.monotonic()
            self._top_up = asyncio.get_running_loop().call_later(max(wait, 0.0), self._give_owed)

    def _give_owed(self) -> None:
        """Storage holds no permit while the client waits: give back the repeats' permits."""
        self._top_up = None
        self._topped_up = time.monotonic()
        if self.state is State.OPEN and self._owed and self._budget <= 0 < self._waiting:
            self.top_ups += 1
            self._give(self._owed)
            self._owed = 0

    def _lost(self, why: str) -> None:
        if self.state in (State.OPEN, State.OPENING):
            self.services.handle_lost(self, why)

    async def _stop_storage(self, drain_s: float) -> None:
        # Storage must have let go of an Exclusive or Failover subscription before the client
        # is sent to the next owner, or the client would get ConsumerBusy there, which it does
        # not retry.
        try:
            async with asyncio.timeout(drain_s):
                await self.storage.close_gracefully()
        except TimeoutError:
            _log.warning("%s: storage did not confirm the close within %g s", self, drain_s)
        self.close_storage()

    def close_storage(self) -> None:
        if self._top_up is not None:
            self._top_up.cancel()
            self._top_up = None
        if self.repeats_dropped and not self._reported:
            self._reported = True
            _log.info(
                "%s: %d repeats dropped (%d permits given back alone); at close storage held "
                "%d permits, the client waited for %d messages, %d permits owed",
                self,
                self.repeats_dropped,
                self.top_ups,
                self._budget,
                self._waiting,
                self._owed,
            )
        self.storage.close()

    def _close_command(self, url: str, url_tls: str) -> Command:
        close = api.CommandCloseConsumer(consumer_id=self.client_id, request_id=0)
        if url:
            close.assignedBrokerServiceUrl = url
        if url_tls:
            close.assignedBrokerServiceUrlTls = url_tls
        return Command(type=Type.CLOSE_CONSUMER, close_consumer=close)
