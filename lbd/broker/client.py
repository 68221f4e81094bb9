"""The broker side of ``BrokerSession`` (docs/broker-contract.md), for a broker to run as it is.

:class:`BrokerClient` holds the session with the sidecar: it says Hello, keeps the serving lease
(:mod:`lbd.core.lease`), hands each Own, Release and Close to the broker's
:class:`BrokerHandler` and sends the ack, and sends the load reports the handler makes. The
broker asks :meth:`BrokerClient.may_serve` before it serves a bundle; the answer is true only
while the bundle was given to it by an Own, the session is open and the lease is valid *now* on
the broker's monotonic clock (so a broker that was paused itself learns at once that its lease is
gone). When the session ends or the lease runs out the client forgets every bundle and calls
:meth:`BrokerHandler.stop_all`: a broker cut off from its sidecar cannot know whether its bundles
were handed to someone else.

Commands are applied one at a time, in the order they came, by a worker of their own, so that a
slow handler never delays the lease grants read beside them.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from lbd.broker.backoff import Backoff
from lbd.broker.credentials import INSECURE, ClientCredentials
from lbd.core.broker_info import ServingLease
from lbd.core.bundles import parse_bundle_id
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.lease import BrokerLease
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc

_log = logging.getLogger(__name__)
_REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)

FIRST_LEASE_RETRY_S = 0.25
"""How often the broker asks for a lease while it has been granted none in this session."""

SESSION_LOST = "session lost"
"""The reason given to :meth:`BrokerHandler.stop_all` when the session ended."""

LEASE_RAN_OUT = "serving lease ran out"
"""The reason given to :meth:`BrokerHandler.stop_all` (and to a late Own's undo) when the lease
ran out."""

Outbox = asyncio.Queue[lbd_pb2.BrokerMessage | None]


@dataclass(frozen=True, slots=True)
class NewOwner:
    """Where a released bundle went: the broker to redirect its clients to."""

    broker_id: BrokerId
    service_url: str
    service_url_tls: str
    web_service_url: str


class BrokerHandler(abc.ABC):
    """What the broker does when its sidecar tells it to; implemented by the broker.

    The command methods answer None when done and otherwise why not (sent as the ack's
    ``error``); an exception counts as a refusal with its message. They are called one at a time
    and must be idempotent: the sidecar may repeat a command. A bundle stops being servable
    (:meth:`BrokerClient.may_serve`) the moment its Release or Close arrives, whatever the
    handler answers; it becomes servable once :meth:`own` succeeded.
    """

    @abc.abstractmethod
    async def own(self, bundle: BundleId) -> str | None:
        """Get ready to serve ``bundle`` (load its topics); serve it while ``may_serve`` says so."""

    @abc.abstractmethod
    async def release(self, bundle: BundleId, new_owner: NewOwner | None) -> str | None:
        """Stop serving ``bundle`` and send its clients to ``new_owner`` (None: a plain unload)."""

    @abc.abstractmethod
    async def close(self, bundle: BundleId, reason: str) -> str | None:
        """Stop serving ``bundle`` at once; ``reason`` is for the broker's log."""

    @abc.abstractmethod
    def stop_all(self, reason: str) -> None:
        """Stop serving every bundle at once: the session ended or the lease ran out.

        Called on the event loop at the moment it happened; must not block. The client has
        already forgotten the bundles: they are served again only after a new Own.
        """

    @abc.abstractmethod
    def load_report(self) -> lbd_pb2.LoadReport:
        """The broker's load now (usage, and stats of every bundle it serves)."""

    def session_opened(self) -> None:  # noqa: B027 -- optional hook, empty by default
        """A session with the sidecar was opened (before Hello's answers arrive)."""

    def session_ended(self) -> None:  # noqa: B027 -- optional hook, empty by default
        """The session ended; :meth:`stop_all` follows at once."""

    def lease_granted(self, valid_until: float) -> None:  # noqa: B027 -- optional hook
        """A grant extended the lease until ``valid_until`` (``time.monotonic()`` seconds)."""

    def revoked(self, bundle: BundleId, command: str) -> None:  # noqa: B027 -- optional hook
        """A ``command`` (``release`` or ``close``) of ``bundle``, which the broker owned, has
        arrived: the bundle is not servable from now on, while the command waits its turn for
        :meth:`release` or :meth:`close`. Called on the event loop; must not block."""


class BrokerClient:
    """Holds a broker's session with its sidecar, reconnecting with a capped backoff.

    Run it with ``async with BrokerClient(...)`` (or :meth:`start` and :meth:`close`), or await
    :meth:`run` in a task of the broker's own.
    """

    def __init__(
        self,
        sidecar: str,
        info: lbd_pb2.BrokerInfo,
        handler: BrokerHandler,
        *,
        report_interval_s: float = 1.0,
        reconnect_min_s: float = 0.1,
        reconnect_max_s: float = 2.0,
        credentials: ClientCredentials = INSECURE,
    ) -> None:
        """``credentials``: TLS files and token of this broker (its certificate's common name
        or its token's name must be ``info.broker_id``; docs/broker-contract.md)."""
        check_address(sidecar)
        if not info.broker_id:
            raise InvalidInputError("the Hello's broker id must not be empty")
        if report_interval_s <= 0:
            raise InvalidInputError(f"report interval must be > 0 seconds, got {report_interval_s}")
        Backoff(reconnect_min_s, reconnect_max_s)  # checks the delays now, not at the first loss
        self._sidecar = sidecar
        self._info = info
        self._handler = handler
        self._report_interval_s = report_interval_s
        self._reconnect = (reconnect_min_s, reconnect_max_s)
        self._credentials = credentials
        self._owned: set[BundleId] = set()
        self._revoked: dict[BundleId, int] = {}
        """Bundles whose Release or Close has arrived and is not carried out yet, with its
        command id (ids grow in the order the sidecar sends): an Own sent before it does not make
        the bundle servable when it is carried out."""
        self._lease: BrokerLease | None = None
        self._lease_duration_s = 0.0
        self._sessions = 0
        self._outbox: Outbox | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def sessions(self) -> int:
        """How many sessions were opened so far."""
        return self._sessions

    @property
    def connected(self) -> bool:
        """Whether a session is open now."""
        return self._lease is not None

    @property
    def lapses(self) -> int:
        """How often the lease ran out in the current session (0 outside a session)."""
        return self._lease.lapses if self._lease is not None else 0

    @property
    def owned(self) -> frozenset[BundleId]:
        """The bundles the sidecar gave this broker (served only while the lease is valid)."""
        return frozenset(self._owned)

    def lease_valid(self) -> bool:
        """Whether a session is open and its lease is valid now."""
        return self._lease is not None and self._lease.valid(time.monotonic())

    def serving(self) -> frozenset[BundleId]:
        """The bundles the broker may serve now."""
        return self.owned if self.lease_valid() else frozenset()

    def may_serve(self, bundle: BundleId) -> bool:
        """Whether the broker may serve ``bundle`` now; ask before serving anything."""
        return bundle in self._owned and self.lease_valid()

    def revoked(self, bundle: BundleId) -> bool:
        """Whether a Release or Close of ``bundle`` has arrived and is not carried out yet: the
        broker stopped serving it on arrival, and its handler is told when the command's turn
        comes (or :meth:`BrokerHandler.stop_all`, should the session end first)."""
        return bundle in self._revoked

    def leave(self, reason: str) -> bool:
        """Tell the sidecar this broker is shutting down gracefully: it has every bundle
        handed to other brokers (the broker goes on serving and carrying out the Releases
        meanwhile). False when no session is open to say it on."""
        if self._outbox is None:
            return False
        self._outbox.put_nowait(lbd_pb2.BrokerMessage(leave=lbd_pb2.LeaveRequest(reason=reason)))
        return True

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Run the client in a task of its own; idempotent."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self.run(), name=f"broker-client-{self._info.broker_id}"
            )

    async def close(self) -> None:
        """Stop the client (it stops serving everything); re-raises what made it fail, if
        anything. Idempotent."""
        task = self._task
        if task is None:
            return
        if not task.done():
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            # Its own cancellation ends here; one of the caller's goes on.
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise

    async def __aenter__(self) -> BrokerClient:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def run(self) -> None:
        """Hold a session with the sidecar, reconnecting whenever it drops, until cancelled.

        Raises what a handler hook other than the three commands raised (after stopping
        everything): a broker that cannot report its load must not run on unnoticed.
        """
        backoff = Backoff(*self._reconnect)
        while True:
            # A channel per session: a renewed certificate or token is read at each reconnect.
            async with self._credentials.aio_channel(self._sidecar) as channel:
                stub = lbd_pb2_grpc.LoadBalancerStub(channel)
                started = time.monotonic()
                opened = await self._session(stub)
                lasted = time.monotonic() - started
            await asyncio.sleep(backoff.after(connected=opened, lasted_s=lasted))

    # -- one session -------------------------------------------------------------------------

    async def _session(self, stub: lbd_pb2_grpc.LoadBalancerStub) -> bool:
        """One session, until it ends; True when it was opened at all."""
        outbox: Outbox = asyncio.Queue()
        hello = lbd_pb2.BrokerInfo()
        hello.CopyFrom(self._info)
        hello.takes_own_batches = True  # _apply carries out every bundle of an Own
        outbox.put_nowait(lbd_pb2.BrokerMessage(hello=hello))
        call = stub.BrokerSession(_drain(outbox), metadata=self._credentials.metadata())
        tasks: list[asyncio.Task[None]] = []
        opened = False
        try:
            await call.wait_for_connection()
            opened = True
            self._outbox = outbox
            self._open_session()
            lease = self._lease
            assert lease is not None
            granted = asyncio.Event()
            commands: asyncio.Queue[lbd_pb2.SidecarMessage] = asyncio.Queue()
            name = self._info.broker_id
            tasks = [
                asyncio.create_task(
                    self._read(call, lease, granted, commands), name=f"broker-session-{name}"
                ),
                asyncio.create_task(
                    self._lease_loop(lease, granted, outbox), name=f"broker-lease-{name}"
                ),
                asyncio.create_task(self._command_loop(commands, outbox), name=f"commands-{name}"),
                asyncio.create_task(self._report_loop(outbox), name=f"broker-load-{name}"),
            ]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # the reader's end is the session's; another's is a failure
            _log.warning("sidecar %s ended the session", self._sidecar)
        except grpc.aio.AioRpcError as e:
            if e.code() in _REFUSALS:
                _log.error(
                    "sidecar %s refused the session: %s %s (check this broker's credentials)",
                    self._sidecar,
                    e.code().name,
                    e.details(),
                )
            elif opened:
                _log.warning(
                    "session with sidecar %s lost: %s %s", self._sidecar, e.code().name, e.details()
                )
            else:
                _log.debug("sidecar %s unreachable: %s", self._sidecar, e.code().name)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # Ends the request stream: grpc's task writing it would otherwise wait forever when
            # the server ended the call first (cancel() does not stop it then).
            outbox.put_nowait(None)
            call.cancel()
            self._outbox = None
            if opened:
                self._end_session()
        return opened

    def _open_session(self) -> None:
        self._sessions += 1
        self._revoked.clear()
        self._lease = BrokerLease()
        self._lease_duration_s = 0.0
        _log.info("session %d with sidecar %s open", self._sessions, self._sidecar)
        self._handler.session_opened()

    def _end_session(self) -> None:
        self._lease = None
        self._owned.clear()
        self._handler.session_ended()
        self._handler.stop_all(SESSION_LOST)

    async def _read(
        self,
        call: AsyncIterator[lbd_pb2.SidecarMessage],
        lease: BrokerLease,
        granted: asyncio.Event,
        commands: asyncio.Queue[lbd_pb2.SidecarMessage],
    ) -> None:
        async for message in call:
            kind = message.WhichOneof("kind")
            if kind == "lease":
                self._granted(lease, message.lease, granted)
                continue
            if kind in ("release", "close"):
                self._revoke(message, getattr(message, kind).bundle)
            commands.put_nowait(message)

    def _revoke(self, command: lbd_pb2.SidecarMessage, text: str) -> None:
        """Stop serving a bundle the moment its Release or Close arrives, before any lease
        granted after it (the sidecar withholds grants until it has sent the command, and counts
        on this): the commands before it in the queue may take a while."""
        with contextlib.suppress(InvalidInputError):  # refused when it is carried out
            bundle = parse_bundle_id(text).id
            if bundle in self._owned:
                self._owned.discard(bundle)
                self._handler.revoked(bundle, str(command.WhichOneof("kind")))
            self._revoked[bundle] = command.command_id

    def _granted(
        self, lease: BrokerLease, msg: lbd_pb2.ServingLease, granted: asyncio.Event
    ) -> None:
        """Take a grant; a stale one (its request was sent too long ago) extends nothing."""
        grant = ServingLease(msg.sequence, msg.duration_ms)
        if lease.grant(grant, time.monotonic()) and lease.valid_until is not None:
            self._lease_duration_s = grant.duration_ms / 1000
            self._handler.lease_granted(lease.valid_until)
            granted.set()

    async def _lease_loop(self, lease: BrokerLease, granted: asyncio.Event, outbox: Outbox) -> None:
        """Ask for the lease now and every quarter of the duration last granted; stop serving
        when it runs out before a renewal arrived."""
        while True:
            request = lease.request(time.monotonic())
            outbox.put_nowait(
                lbd_pb2.BrokerMessage(
                    lease_request=lbd_pb2.LeaseRequest(
                        sequence=request.sequence, lapses=request.lapses
                    )
                )
            )
            pause = self._lease_duration_s / 4 if self._lease_duration_s else FIRST_LEASE_RETRY_S
            granted.clear()
            deadline = time.monotonic() + pause
            while (now := time.monotonic()) < deadline:
                until = lease.valid_until
                wait = deadline - now if until is None else min(deadline, until) - now
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(wait, 0.0)):
                        await granted.wait()
                granted.clear()
                if lease.lapse_if_due(time.monotonic()):
                    _log.warning("serving lease ran out; stopping every bundle")
                    self._owned.clear()
                    self._handler.stop_all(LEASE_RAN_OUT)

    async def _command_loop(
        self, commands: asyncio.Queue[lbd_pb2.SidecarMessage], outbox: Outbox
    ) -> None:
        while True:
            command = await commands.get()
            outbox.put_nowait(lbd_pb2.BrokerMessage(ack=await self._apply(command)))

    async def _apply(self, command: lbd_pb2.SidecarMessage) -> lbd_pb2.CommandAck:
        """Carry out one command through the handler; its ack."""
        ack = lbd_pb2.CommandAck(command_id=command.command_id, ok=True)
        kind = command.WhichOneof("kind")
        if kind not in ("own", "release", "close"):
            ack.ok, ack.error = False, f"not a command: {kind or 'empty'}"
            return ack
        if kind == "own" and command.own.more_bundles:
            return await self._apply_own_batch(command, ack)
        try:
            bundle = parse_bundle_id(getattr(command, kind).bundle).id
        except InvalidInputError as e:
            ack.ok, ack.error = False, str(e)
            return ack
        error: str | None
        if kind == "own":
            error = await self._own_one(bundle, command.command_id)
        else:
            try:
                self._owned.discard(bundle)
                if self._revoked.get(bundle) == command.command_id:
                    del self._revoked[bundle]
                error = await self._carry_out(command, kind, bundle)
            except Exception as e:
                _log.exception("%s %s failed", kind, bundle)
                error = f"{type(e).__name__}: {e}"
        if error is not None:
            ack.ok, ack.error = False, error
        _log.info("%s %s: %s (owning %d bundles)", kind, bundle, error or "done", len(self._owned))
        return ack

    async def _apply_own_batch(
        self, command: lbd_pb2.SidecarMessage, ack: lbd_pb2.CommandAck
    ) -> lbd_pb2.CommandAck:
        """Carry out an Own of several bundles, each as an Own of its own, in order; the ack
        names each bundle not taken."""
        own = command.own
        for text in (own.bundle, *own.more_bundles):
            try:
                bundle = parse_bundle_id(text).id
            except InvalidInputError as e:
                ack.failed.add(bundle=text, error=str(e))
                continue
            error = await self._own_one(bundle, command.command_id)
            if error is not None:
                ack.failed.add(bundle=bundle, error=error)
        if ack.failed:
            ack.ok, ack.error = False, f"{len(ack.failed)} of the bundles not taken"
        _log.info(
            "own %d bundles: %d taken (owning %d bundles)",
            len(own.more_bundles) + 1,
            len(own.more_bundles) + 1 - len(ack.failed),
            len(self._owned),
        )
        return ack

    async def _own_one(self, bundle: BundleId, command_id: int) -> str | None:
        """Take one bundle (of an Own, or of an Own batch): the error, if any. It becomes
        servable unless a Release or Close of it sent after this Own has already arrived."""
        lease = self._lease
        lapses = lease.lapses if lease is not None else 0
        try:
            error = await self._handler.own(bundle)
            if error is None:
                if lease is not None and lease.lapses != lapses:
                    # The lease ran out while the broker was taking the bundle: stop_all came
                    # first, so this one is dropped as well (the sidecar drops it too when it
                    # learns of the lapse from the next request).
                    await self._handler.close(bundle, LEASE_RAN_OUT)
                elif self._revoked.get(bundle, -1) < command_id:
                    self._owned.add(bundle)
        except Exception as e:
            _log.exception("own %s failed", bundle)
            return f"{type(e).__name__}: {e}"
        return error

    async def _carry_out(
        self, command: lbd_pb2.SidecarMessage, kind: str, bundle: BundleId
    ) -> str | None:
        if kind == "release":
            return await self._handler.release(bundle, _new_owner(command.release))
        return await self._handler.close(bundle, command.close.reason)

    async def _report_loop(self, outbox: Outbox) -> None:
        while True:
            outbox.put_nowait(lbd_pb2.BrokerMessage(load=self._handler.load_report()))
            await asyncio.sleep(self._report_interval_s)


def check_address(address: str) -> None:
    """Raise InvalidInputError unless ``address`` is HOST:PORT."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidInputError(f"sidecar address must be HOST:PORT, got {address!r}")


def _new_owner(release: lbd_pb2.ReleaseCommand) -> NewOwner | None:
    if not release.new_owner_broker_id:
        return None
    urls = release.new_owner
    return NewOwner(
        BrokerId(release.new_owner_broker_id),
        urls.service_url,
        urls.service_url_tls,
        urls.web_service_url,
    )


async def _drain(outbox: Outbox) -> AsyncIterator[lbd_pb2.BrokerMessage]:
    """The request stream of a session: whatever is put in the outbox, in order, until None."""
    while (message := await outbox.get()) is not None:
        yield message
