"""Forwarding Admin calls to the sidecar that must run them.

Split runs on the bundle owner's sidecar, and the methods declared :func:`on_leader` (Transfer,
Unload, Rebalance, the operations, Snapshot...) on the leader's; any sidecar accepts them and
forwards them there over gRPC. Forwarding to the leader is one layer of the server
(:class:`LeaderForwarding`, innermost, inside the error mapping), so a servicer method runs only
where it belongs and never asks who leads (the address is the target's
``BrokerInfo.sidecar_grpc_addr``). A forwarded call carries the ``x-lbd-forwarded`` marker: a
sidecar that receives a marked call it cannot run itself refuses it instead of forwarding it
again, so a stale view (the owner or leader just changed) cannot make calls loop. The caller's
``authorization`` goes along, since sidecars of one cluster accept the same tokens; with mutual
TLS the sidecar connects with its own certificate.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from lbd.api.auth import ANONYMOUS_CALLER, AUTHORIZATION
from lbd.api.handlers import (
    BoundCall,
    BoundStreamCall,
    Call,
    CallWrapper,
    MethodDetails,
    StreamCall,
    WrappingInterceptor,
)
from lbd.api.tracing import inject_context
from lbd.broker.credentials import INSECURE, ClientCredentials
from lbd.core.errors import PreconditionError
from lbd.gen.v1 import lbd_pb2_grpc
from lbd.ports.errors import UnavailableError

if TYPE_CHECKING:
    from lbd.core.ids import BrokerId
    from lbd.services.cluster.registry import BrokerRegistry
    from lbd.services.leader.election import LeaderElector

_log = logging.getLogger(__name__)

FORWARDED = "x-lbd-forwarded"
"""Metadata key marking a call one sidecar forwarded to another; its value is the sender's id."""

DEFAULT_TIMEOUT_S = 30.0
"""Deadline of a forwarded call when the caller set none (a split waits for its children)."""


F = TypeVar("F", bound=Callable[..., Any])

_ON_LEADER = "lbd_runs_on_leader"


def on_leader(method: F) -> F:
    """Declares a servicer method that runs on the leader's sidecar only: on any other sidecar
    :class:`LeaderForwarding` sends the call to the leader's."""
    setattr(method, _ON_LEADER, True)
    return method


def leader_methods(servicer: object, service: str) -> frozenset[str]:
    """The full method names (``/lbd.v1.Admin/Transfer``) of ``servicer``'s methods declared
    :func:`on_leader`; ``service`` is the full service name."""
    kind = type(servicer)
    return frozenset(
        f"/{service}/{name}"
        for name in dir(kind)
        if getattr(getattr(kind, name, None), _ON_LEADER, False)
    )


def sidecar_addr(registry: BrokerRegistry, broker: BrokerId, role: str) -> str:
    """The gRPC address of ``broker``'s sidecar; UnavailableError (naming ``role``) when it is
    not registered or registered no address."""
    info = registry.get(broker)
    if info is None:
        raise UnavailableError(f"{role}, {broker}, is not registered; retry once it is back")
    if not info.sidecar_grpc_addr:
        raise UnavailableError(f"{role}, {broker}, did not register its sidecar's address")
    return info.sidecar_grpc_addr


def forwarded_by(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The broker id of the sidecar that forwarded this call, or None for a first-hand call."""
    for key, value in metadata or ():
        if key == FORWARDED:
            return str(value)
    return None


class Forwarder:
    """Calls the Admin service of other sidecars; one channel per address, kept open."""

    def __init__(
        self,
        me: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        credentials: ClientCredentials = INSECURE,
    ) -> None:
        """``credentials``: this sidecar's TLS files (its certificate is its client certificate);
        channels are made again when one of the files changes."""
        self._me = me
        self._timeout_s = timeout_s
        self._credentials = credentials
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stamp = _stamp(credentials)

    async def call(
        self,
        addr: str,
        method: Callable[[lbd_pb2_grpc.AdminStub], Any],
        request: Any,
        context: grpc.aio.ServicerContext,
        *,
        what: str,
    ) -> Any:
        """Send ``request`` to ``method`` of the Admin service at ``addr``; its response.

        ``what`` says why this sidecar does not run the call itself (for the log and for the
        refusal of a call that was forwarded already). A failed call raises its
        :class:`grpc.aio.AioRpcError`, which the error mapping passes on to the caller as it is.
        """
        metadata = self._metadata(context, what)
        remaining = context.time_remaining()
        timeout = self._timeout_s if remaining is None else min(remaining, self._timeout_s)
        _log.info("forwarding %s to %s: %s", type(request).__name__, addr, what)
        stub = lbd_pb2_grpc.AdminStub(await self._channel(addr))
        return await method(stub)(request, metadata=metadata, timeout=timeout)

    async def stream(
        self,
        addr: str,
        method: Callable[[lbd_pb2_grpc.AdminStub], Any],
        request: Any,
        context: grpc.aio.ServicerContext,
        *,
        what: str,
    ) -> AsyncGenerator[Any, None]:
        """:meth:`call` for a server-streaming method: its responses as they come, for as long
        as the caller's deadline allows (no deadline of its own: a drain may take long)."""
        metadata = self._metadata(context, what)
        _log.info("forwarding %s to %s: %s", type(request).__name__, addr, what)
        stub = lbd_pb2_grpc.AdminStub(await self._channel(addr))
        call = method(stub)(request, metadata=metadata, timeout=context.time_remaining())
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    def _metadata(
        self, context: grpc.aio.ServicerContext, what: str
    ) -> tuple[tuple[str, str], ...]:
        """The forwarded call's metadata; PreconditionError when the call was forwarded here."""
        incoming = context.invocation_metadata() or ()
        sender = forwarded_by(incoming)
        if sender is not None:
            raise PreconditionError(
                f"{what}, and the call was already forwarded here by {sender}; the cluster's "
                "view is changing, retry"
            )
        metadata: list[tuple[str, str]] = [(FORWARDED, self._me)]
        metadata += [
            (k, v)
            for k, v in incoming
            if k in (AUTHORIZATION, ANONYMOUS_CALLER) and isinstance(v, str)
        ]
        inject_context(metadata)
        return tuple(metadata)

    async def _channel(self, addr: str) -> grpc.aio.Channel:
        stamp = _stamp(self._credentials)
        if stamp != self._stamp:
            _log.info("TLS files changed: new channels to the other sidecars")
            self._stamp = stamp
            await self.close()
        channel = self._channels.get(addr)
        if channel is None:
            channel = self._credentials.aio_channel(addr)
            self._channels[addr] = channel
        return channel

    async def close(self) -> None:
        """Close every channel. Idempotent."""
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()


def _stamp(credentials: ClientCredentials) -> tuple[tuple[int, int], ...]:
    """When and how big each credential file is (a missing file counts as changed)."""
    stamps = []
    for path in credentials.files():
        try:
            st = os.stat(path)
        except OSError:
            stamps.append((-1, -1))
        else:
            stamps.append((st.st_mtime_ns, st.st_size))
    return tuple(stamps)


class LeaderForwarding(WrappingInterceptor):
    """The layer that runs each :func:`on_leader` method on the leader's sidecar: here when this
    sidecar leads, else forwarded to the leader's (its response, or its error, as the caller's).
    Other methods pass through untouched."""

    def __init__(
        self,
        methods: frozenset[str],
        *,
        me: BrokerId,
        elector: LeaderElector,
        registry: BrokerRegistry,
        forwarder: Forwarder,
    ) -> None:
        super().__init__(_ToLeader(me, elector, registry, forwarder))
        self.methods = methods

    def wrapper_for(self, details: grpc.HandlerCallDetails | MethodDetails) -> CallWrapper | None:
        """The forwarding wrapper for the declared methods only."""
        return self._wrapper if details.method in self.methods else None


class _ToLeader(CallWrapper):
    def __init__(
        self, me: BrokerId, elector: LeaderElector, registry: BrokerRegistry, forwarder: Forwarder
    ) -> None:
        self._me = me
        self._elector = elector
        self._registry = registry
        self._forwarder = forwarder

    async def unary(self, method: str, context: grpc.aio.ServicerContext, call: Call) -> Any:
        if self._elector.is_leader:
            return await call()
        assert isinstance(call, BoundCall)
        addr, what = self._leader_addr()
        return await self._forwarder.call(
            addr, _stub_method(method), call.request, context, what=what
        )

    async def stream(
        self, method: str, context: grpc.aio.ServicerContext, call: StreamCall
    ) -> AsyncGenerator[Any, None]:
        if self._elector.is_leader:
            async with contextlib.aclosing(call()) as responses:
                async for response in responses:
                    yield response
            return
        assert isinstance(call, BoundStreamCall)
        addr, what = self._leader_addr()
        forwarded = self._forwarder.stream(
            addr, _stub_method(method), call.request, context, what=what
        )
        async with contextlib.aclosing(forwarded):
            async for response in forwarded:
                yield response

    def _leader_addr(self) -> tuple[str, str]:
        """The leader's sidecar address and why this sidecar does not answer itself."""
        leader = self._elector.leader
        if leader is None:
            raise UnavailableError("no leader is elected right now; retry shortly")
        if leader.broker == self._me:
            raise PreconditionError(
                f"{self._me} was elected leader but is not running the leader duties yet; "
                "retry shortly"
            )
        addr = sidecar_addr(self._registry, leader.broker, "the leader")
        return addr, f"{leader.broker} leads, not {self._me}"


def _stub_method(method: str) -> Callable[[lbd_pb2_grpc.AdminStub], Any]:
    """The Admin stub's method of the full method name ``method``."""
    name = method.rsplit("/", 1)[-1]
    return lambda stub: getattr(stub, name)
