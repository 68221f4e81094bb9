"""``lbd.v1.LoadBalancer``: what the broker beside the sidecar (and broker-side caches) call.

Thin: each method converts the request, calls one service and converts the answer back. Errors
are raised as lbd errors and mapped to status codes by :mod:`lbd.api.errors`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, TypeVar

import grpc

from lbd.api import convert
from lbd.api.auth import BROKER_SESSION, Authenticator, Refused, audit, principal_of
from lbd.core.names import NamespaceName
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc

if TYPE_CHECKING:
    from lbd.services.channel.follower import ChannelFollower
    from lbd.services.sidecar.broker_link import BrokerLink
    from lbd.services.sidecar.lookup import LookupService

_log = logging.getLogger(__name__)
_T = TypeVar("_T")


class LoadBalancerServicer(lbd_pb2_grpc.LoadBalancerServicer):
    """Lookups, the ownership feed and the broker session of one sidecar."""

    def __init__(
        self,
        *,
        lookup: LookupService,
        follower: ChannelFollower,
        link: BrokerLink,
        authenticator: Authenticator | None = None,
    ) -> None:
        """With ``authenticator``, a BrokerSession's Hello must name the caller's own broker
        (an admin may hold any); without one every caller may hold any."""
        self._lookup = lookup
        self._follower = follower
        self._link = link
        self._authenticator = authenticator

    async def Lookup(
        self, request: lbd_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.LookupResponse:
        """The topic's bundle and owner; assigns the bundle unless ``read_only``."""
        result = await self._lookup.lookup(request.topic, read_only=request.read_only)
        return convert.lookup_response(result)

    async def WatchOwnership(
        self, request: lbd_pb2.WatchOwnershipRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[lbd_pb2.OwnershipChange]:
        """Every matching bundle's current value, the end of those, then each accepted change,
        in channel order."""
        namespace = NamespaceName.parse(request.namespace) if request.namespace else None
        prefix = f"{namespace}/" if namespace is not None else ""
        # Subscribed, then the snapshot taken, with no await between: every change is either
        # in the snapshot or in the feed, never in both.
        changes = self._follower.changes()
        async with contextlib.aclosing(changes):
            snapshot = sorted(
                (b, v) for b, v in self._follower.table.items() if b.startswith(prefix)
            )
            for bundle, value in snapshot:
                yield convert.ownership_change(bundle, value)
            yield lbd_pb2.OwnershipChange(snapshot_done=True)
            async for change in changes:
                if change.key.startswith(prefix):
                    yield convert.ownership_change(change.key, change.new)

    async def BrokerSession(
        self,
        request_iterator: AsyncIterator[lbd_pb2.BrokerMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[lbd_pb2.SidecarMessage]:
        """The broker's stream, bridged to :meth:`BrokerLink.session` (core types inside)."""
        peer = context.peer()
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        if first is None:
            return
        if self._authenticator is not None and first.HasField("hello"):
            # Before the link sees the Hello: a refused caller disturbs no session.
            await self._check_identity(first.hello.broker_id, context)
        _log.info("broker session opened from %s", peer)
        incoming = (convert.broker_message_from_proto(m) async for m in _prepend(first, messages))
        try:
            async for command in self._link.session(incoming):
                yield convert.sidecar_message_to_proto(command)
        finally:
            _log.info("broker session from %s ended", peer)

    async def _check_identity(self, broker_id: str, context: grpc.aio.ServicerContext) -> None:
        assert self._authenticator is not None
        try:
            principal = principal_of(self._authenticator, context)
        except Refused as e:
            await context.abort(e.code, e.message)
        if principal.may_open_session_for(broker_id):
            return
        message = (
            f"{principal.describe()} may open a BrokerSession only for broker "
            f"{principal.name}, not for {broker_id!r}"
        )
        audit(principal, BROKER_SESSION, "PERMISSION_DENIED", peer=context.peer(), details=message)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)


async def _prepend(first: _T, rest: AsyncIterator[_T]) -> AsyncIterator[_T]:
    yield first
    async for item in rest:
        yield item
