"""The link to this sidecar's broker: the ``BrokerSession`` stream, and Own/Release/Close.

The API layer plugs the broker's gRPC stream into :meth:`BrokerLink.session` (converting
protobuf to the core types of :mod:`lbd.core.broker_info`); everything else in the sidecar talks to
the broker through :meth:`BrokerLink.own`, :meth:`BrokerLink.release` and
:meth:`BrokerLink.close_bundle`, each of which waits for the broker's acknowledgement for a bounded
time (``broker.own_ack_timeout_s`` for Own, ``broker.release_ack_timeout_s`` for the others).

With ``auto_ack`` and no broker attached the link acknowledges every command itself, so a sidecar
can stand alone (demo, benchmarks); it still keeps the set of bundles it "serves". While fenced
(:meth:`BrokerLink.fence`) the link refuses to own anything.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Final

from lbd.core.broker_info import (
    BrokerInfo,
    BrokerMessage,
    CloseCommand,
    Command,
    CommandAck,
    Hello,
    LeaseRequest,
    Leave,
    LoadReport,
    OwnCommand,
    ReleaseCommand,
    ServingLease,
    SidecarMessage,
)
from lbd.core.errors import DeadlineError, InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.probes import probe
from lbd.ports.clock import Clock
from lbd.services.channel.deadlines import within
from lbd.tasks import Mailbox, cancel_and_wait, guard

_log = logging.getLogger(__name__)


class LinkEventKind(enum.Enum):
    """What happened to the broker's session."""

    ATTACHED = "attached"
    """A broker said Hello (a new session, or one replacing the previous session)."""
    DETACHED = "detached"
    """The broker's session ended and no other replaced it."""
    LAPSED = "lapsed"
    """The broker's serving lease ran out: it serves nothing until it is told to Own again."""
    LEAVING = "leaving"
    """The broker is shutting down gracefully and asks for its bundles to be handed over."""


@dataclass(frozen=True, slots=True)
class LinkEvent:
    """A session event, with the broker's info (None when detached)."""

    kind: LinkEventKind
    info: BrokerInfo | None
    detail: str = ""
    """A leave's reason."""


COMMANDS_IN_FLIGHT: Final = 256
"""At most this many commands of one session are sent and await their ack; the others wait their
turn, in the order they were issued, before they are sent. A lease grant (never held back) is
then queued behind at most this many commands, so a burst of thousands (a split's children, a
recovery) cannot delay the broker's lease renewal until its lease runs out."""


OWN_BATCH_MAX: Final = 256
"""Most bundles one Own command carries, to a broker that takes Own batches."""


@dataclass(eq=False)
class _OwnBatch:
    """Owns asked for in one turn of the event loop, sent as one command."""

    bundles: list[BundleId]
    acked: asyncio.Future[CommandAck]


@dataclass(eq=False)
class _Session:
    """One broker session: its outbox and the commands awaiting an ack."""

    info: BrokerInfo
    takes_own_batches: bool = False
    """The broker said in its Hello that it carries out an Own of several bundles."""
    open_batch: _OwnBatch | None = None
    """The Own batch still taking bundles (it is sent at the next turn of the event loop)."""
    batches: set[asyncio.Task[None]] = field(default_factory=set)
    outbox: Mailbox[SidecarMessage | None] = field(default_factory=Mailbox)
    pending: dict[int, asyncio.Future[CommandAck]] = field(default_factory=dict)
    slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(COMMANDS_IN_FLIGHT))
    """A command is sent once it holds a slot; asyncio's semaphore serves waiters in order."""
    ended: bool = False
    error: InvalidInputError | None = None
    """What the broker sent that made the session end, if that is why it ended."""

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        self.outbox.put_nowait(None)
        for future in self.pending.values():
            if not future.done():
                future.set_result(CommandAck(0, ok=False, error="the broker session ended"))
        self.pending.clear()


class BrokerLink:
    """This sidecar's broker: at most one session at a time, commands with bounded acks."""

    def __init__(
        self,
        me: BrokerId,
        *,
        auto_ack: bool,
        own_ack_timeout_s: float,
        release_ack_timeout_s: float,
        clock: Clock,
        serving_lease_s: float = 10.0,
        lease_margin_s: float = 1.0,
        vouch: Callable[[], bool] = lambda: True,
    ) -> None:
        """Own waits ``own_ack_timeout_s`` for its ack; Release and Close wait
        ``release_ack_timeout_s``. The broker's serving lease is granted for ``serving_lease_s``
        whenever it asks and ``vouch()`` says the sidecar can still vouch for its ownership
        (``lease_margin_s`` pads every wait for a granted lease to run out)."""
        self._me = me
        self._serving_lease_ms = round(serving_lease_s * 1000)
        """What every grant gives, in the protocol's whole milliseconds."""
        self._lease_margin_s = lease_margin_s
        self._vouch = vouch
        self._granted_until: float | None = None
        self._withheld = 0
        self._lapses_seen = 0
        self._auto_ack = auto_ack
        self._own_ack_timeout_s = own_ack_timeout_s
        self._release_ack_timeout_s = release_ack_timeout_s
        self._clock = clock
        self._session: _Session | None = None
        self._served: set[BundleId] = set()
        self._owning: Counter[BundleId] = Counter()
        """Bundles with an Own under way (sent or about to be, not answered yet)."""
        self._command_ids = itertools.count(1)
        self._subscribers: set[asyncio.Queue[LinkEvent]] = set()
        self._fenced = False
        self.latest_report: LoadReport | None = None
        """The broker's latest load report (None before the first)."""
        self.latest_report_at: float | None = None
        """When it arrived, on the sidecar's clock."""
        self.last_heard: float | None = None
        """When the attached broker last sent anything, on the sidecar's clock."""

    @property
    def me(self) -> BrokerId:
        """The broker this sidecar stands beside."""
        return self._me

    @property
    def auto_ack(self) -> bool:
        """Whether the link acknowledges commands itself when no broker is attached."""
        return self._auto_ack

    @property
    def attached(self) -> bool:
        """Whether a broker session is open (Hello received, stream not ended)."""
        return self._session is not None

    @property
    def info(self) -> BrokerInfo | None:
        """The attached broker's Hello, or None."""
        return None if self._session is None else self._session.info

    @property
    def fenced(self) -> bool:
        """Whether the link is fenced: it owns nothing until :meth:`unfence`."""
        return self._fenced

    def served(self) -> frozenset[BundleId]:
        """The bundles the broker acknowledged owning and was not told to give up since."""
        return frozenset(self._served)

    def possibly_served(self) -> frozenset[BundleId]:
        """The bundles the broker serves or may serve once what was sent reaches it: those it
        acknowledged an Own for and those with an Own under way, until a Release or Close of
        them is sent (the broker stops serving a bundle when that arrives, before any lease
        granted after it: docs/safety.md)."""
        return frozenset(self._served.union(self._owning))

    def serves(self, bundle: BundleId) -> bool:
        """Whether ``bundle`` is one of :meth:`served` (without copying them all)."""
        return bundle in self._served

    def served_count(self) -> int:
        """How many bundles :meth:`served` holds."""
        return len(self._served)

    # -- commands -------------------------------------------------------------------------

    async def own(self, bundle: BundleId) -> bool:
        """Tell the broker to serve ``bundle``; True once it acknowledged (at once if it does).

        False when it refused, did not answer within the ack timeout, no broker is attached (and
        no auto-ack), or the link is fenced.
        """
        if self._fenced:
            return False
        if bundle in self._served:
            return True
        self._owning[bundle] += 1
        try:
            return await self._own(bundle)
        finally:
            self._owning[bundle] -= 1
            if not self._owning[bundle]:
                del self._owning[bundle]

    async def _own(self, bundle: BundleId) -> bool:
        lapses, session = self._lapses_seen, self._session
        ack = await self._own_ack(bundle, session)
        if ack is None:
            return False  # nobody to send it to
        if session is not None and self._session is not session:
            return False  # that session ended: the broker forgot everything it was told
        doubt = None
        if not ack.ok:
            doubt = f"own not acknowledged: {ack.error or 'refused'}"
        elif self._lapses_seen != lapses:
            # A lapse reported meanwhile may have come before or after the Own reached it.
            doubt = "its serving lease ran out while it was taking it"
        elif self._fenced:
            doubt = "fenced while owning"
        if doubt is not None:
            await self._close_in_doubt(bundle, doubt)
            return False
        self._served.add(bundle)
        return True

    async def _close_in_doubt(self, bundle: BundleId, doubt: str) -> None:
        """Close ``bundle``, whose Own's outcome is in doubt: the broker may hold it all the
        same (an ack that timed out can still come), and the ordered stream delivers the Close
        after the Own, so that no later lease makes it serve a bundle this sidecar does not
        count as served."""
        probe("own.in_doubt")
        await self.close_bundle(bundle, doubt)

    async def _own_ack(self, bundle: BundleId, session: _Session | None) -> CommandAck | None:
        """The broker's answer to an Own of ``bundle``: alone, or in a batch with the Owns
        asked for in the same turn of the event loop when the broker takes Own batches (a
        recovery or a split hands it hundreds at once). The answer is the batch's, as it
        concerns this bundle; everything :meth:`own` decides on it is decided per bundle."""
        if session is None or not session.takes_own_batches:
            return await self._command(OwnCommand(bundle), self._own_ack_timeout_s)
        batch = session.open_batch
        if batch is None or len(batch.bundles) >= OWN_BATCH_MAX:
            batch = _OwnBatch([], asyncio.get_running_loop().create_future())
            session.open_batch = batch
            # Started at the next turn of the loop: the Owns asked for in this one join it.
            sending = asyncio.ensure_future(self._send_own_batch(session, batch))
            session.batches.add(sending)
            sending.add_done_callback(session.batches.discard)
        batch.bundles.append(bundle)
        # Shielded: one caller that gives up does not withdraw the batch from the others.
        ack = await asyncio.shield(batch.acked)
        return ack.of(bundle)

    async def _send_own_batch(self, session: _Session, batch: _OwnBatch) -> None:
        try:
            if session.open_batch is batch:
                session.open_batch = None
            if self._session is not session:
                ack: CommandAck | None = CommandAck(0, ok=False, error="the broker session ended")
            else:
                first, *more = batch.bundles
                ack = await self._command(OwnCommand(first, tuple(more)), self._own_ack_timeout_s)
            if not batch.acked.done():
                batch.acked.set_result(ack or CommandAck(0, ok=False, error="not sent"))
        finally:
            if not batch.acked.done():  # cancelled: the session is over
                batch.acked.set_result(CommandAck(0, ok=False, error="the broker session ended"))

    async def release(self, bundle: BundleId, new_owner: BrokerInfo | None) -> bool:
        """Tell the broker to release ``bundle`` to ``new_owner`` (None: plain unload).

        True once acknowledged; False on refusal, ack timeout or no broker. Either way the
        bundle no longer counts as served: the protocol moves on after the timeout.
        """
        ack = await self._command(
            ReleaseCommand(bundle, new_owner),
            self._release_ack_timeout_s,
            sent=lambda: self._served.discard(bundle),
        )
        self._served.discard(bundle)
        return ack is not None and ack.ok

    async def close_bundle(self, bundle: BundleId, reason: str) -> None:
        """Tell the broker to stop serving ``bundle`` now (the ack is awaited, not required)."""
        ack = await self._command(
            CloseCommand(bundle, reason),
            self._release_ack_timeout_s,
            sent=lambda: self._served.discard(bundle),
        )
        self._served.discard(bundle)
        if ack is not None and not ack.ok:
            _log.warning("broker %s did not close %s: %s", self._me, bundle, ack.error)

    async def close_all(self, reason: str) -> None:
        """Close every served bundle, concurrently."""
        bundles = sorted(self._served)
        await asyncio.gather(*(self.close_bundle(b, reason) for b in bundles))

    async def fence(self, reason: str) -> None:
        """Close every bundle and own nothing more until :meth:`unfence` (self-fencing)."""
        self._fenced = True
        await self.close_all(reason)

    def unfence(self) -> None:
        """Allow owning again (the reactor then re-owns what is still this broker's)."""
        self._fenced = False

    # -- the serving lease --------------------------------------------------------------------

    @property
    def lease_granted_until(self) -> float | None:
        """When the last lease granted runs out at the latest, on this sidecar's clock."""
        return self._granted_until

    async def wait_out_lease(self) -> None:
        """Grant nothing more and wait until every lease granted has surely run out (the broker
        then serves nothing); granting resumes when this returns.

        For moving a bundle on without the broker's acknowledgement: whatever the broker did
        with the command, it no longer serves the bundle once its lease ran out.
        """
        self._withheld += 1
        probe("lease.wait_out")
        try:
            if self._granted_until is not None:
                remaining = self._granted_until - self._clock.monotonic()
                if remaining > -self._lease_margin_s:
                    _log.warning(
                        "broker %s: waiting %.1fs for its serving lease to run out",
                        self._me,
                        remaining + self._lease_margin_s,
                    )
                    await self._clock.sleep(remaining + self._lease_margin_s)
            self._served.clear()
        finally:
            self._withheld -= 1

    def _on_lease_request(self, request: LeaseRequest, session: _Session) -> None:
        if request.lapses != self._lapses_seen:
            # The broker's lease ran out since its last request: it serves nothing now.
            self._lapses_seen = request.lapses
            probe("lease.lapse_reported")
            self._served.clear()
            _log.warning("broker %s: its serving lease ran out; it owns nothing now", self._me)
            self._emit(LinkEvent(LinkEventKind.LAPSED, session.info))
        if self._withheld or self._fenced or not self._vouch():
            return
        # Timed as it is answered: the sidecar bounds what it granted by answer time + duration.
        duration_ms = self._serving_lease_ms
        self._granted_until = self._clock.monotonic() + duration_ms / 1000
        session.outbox.put_nowait(SidecarMessage(0, ServingLease(request.sequence, duration_ms)))

    async def _command(
        self, command: Command, timeout_s: float, *, sent: Callable[[], None] | None = None
    ) -> CommandAck | None:
        """Send ``command`` once it has a slot (:data:`COMMANDS_IN_FLIGHT`) and wait at most
        ``timeout_s`` for its ack; None when there was nobody to send it to. ``sent`` is called
        the moment it is in the session's ordered stream."""
        session = self._session
        if session is None:
            if self._auto_ack:
                return CommandAck(0)
            _log.info("no broker attached: %s not sent", command)
            return None
        async with session.slots:
            if session.ended:
                return CommandAck(0, ok=False, error="the broker session ended")
            command_id = next(self._command_ids)
            future: asyncio.Future[CommandAck] = asyncio.get_running_loop().create_future()
            session.pending[command_id] = future
            session.outbox.put_nowait(SidecarMessage(command_id, command))
            if sent is not None:
                sent()
            try:
                return await within(self._clock, timeout_s, future, f"ack of {command}")
            except DeadlineError as e:
                _log.warning("broker %s: %s", self._me, e)
                return CommandAck(command_id, ok=False, error=str(e))
            finally:
                session.pending.pop(command_id, None)

    # -- the session ----------------------------------------------------------------------

    def events(self) -> AsyncGenerator[LinkEvent, None]:
        """Every attach and detach from the moment of this call on."""
        queue: asyncio.Queue[LinkEvent] = asyncio.Queue()
        self._subscribers.add(queue)
        return self._drain(queue)

    async def _drain(self, queue: asyncio.Queue[LinkEvent]) -> AsyncGenerator[LinkEvent, None]:
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers.discard(queue)

    def _emit(self, event: LinkEvent) -> None:
        for queue in self._subscribers:
            queue.put_nowait(event)

    async def session(
        self, incoming: AsyncIterator[BrokerMessage]
    ) -> AsyncIterator[SidecarMessage]:
        """Serve one broker session: read ``incoming``, yield the commands for the broker.

        The first message must be a :class:`Hello` from this sidecar's broker
        (InvalidInputError otherwise); a later message that is not valid ends the session with
        InvalidInputError too. A new session replaces the open one, which ends. The
        session ends when ``incoming`` ends, when it is replaced, or when the caller closes
        this iterator; pending commands then count as not acknowledged.
        """
        stream = aiter(incoming)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            return
        if not isinstance(first, Hello):
            raise InvalidInputError(
                f"a broker session must start with Hello, got {type(first).__name__}"
            )
        if first.info.broker_id != self._me:
            raise InvalidInputError(
                f"broker {first.info.broker_id!r} said Hello to the sidecar of broker {self._me!r}"
            )
        session = _Session(first.info, takes_own_batches=first.takes_own_batches)
        self.last_heard = self._clock.monotonic()
        previous, self._session = self._session, session
        if previous is not None:
            _log.info("broker %s: a new session replaces the open one", self._me)
            previous.end()
        # What the broker served in an earlier session is unknown: the reactor re-owns.
        self._served.clear()
        self._lapses_seen = 0
        _log.info("broker %s attached", self._me)
        self._emit(LinkEvent(LinkEventKind.ATTACHED, session.info))
        reader = guard(self._read(stream, session), name=f"broker-session-reader-{self._me}")
        try:
            while (message := await session.outbox.get()) is not None:
                yield message
            if session.error is not None:
                raise session.error
        finally:
            session.end()
            await cancel_and_wait(reader)
            for sending in list(session.batches):
                await cancel_and_wait(sending)
            if self._session is session:
                self._session = None
                self._served.clear()
                _log.info("broker %s detached", self._me)
                self._emit(LinkEvent(LinkEventKind.DETACHED, None))

    async def _read(self, stream: AsyncIterator[BrokerMessage], session: _Session) -> None:
        try:
            async for message in stream:
                self.last_heard = now = self._clock.monotonic()
                match message:  # the most frequent first: a request every quarter of a lease
                    case LeaseRequest():
                        self._on_lease_request(message, session)
                    case CommandAck():
                        future = session.pending.get(message.command_id)
                        if future is not None and not future.done():
                            future.set_result(message)
                    case LoadReport():
                        self.latest_report = message
                        self.latest_report_at = now
                    case Leave():
                        _log.info("broker %s is leaving: %s", self._me, message.reason)
                        self._emit(LinkEvent(LinkEventKind.LEAVING, session.info, message.reason))
                    case Hello():
                        _log.warning("broker %s said Hello twice; ignored", self._me)
        except InvalidInputError as e:
            # The broker's fault, not ours: its session ends with the reason, and no traceback.
            _log.info("broker %s sent an invalid message; ending its session: %s", self._me, e)
            session.error = e
        finally:
            session.end()
