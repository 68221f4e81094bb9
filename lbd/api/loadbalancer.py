"""``lbd.v1.LoadBalancer``: what the broker beside the sidecar (and broker-side caches) call.

Thin: each method converts the request, calls one service and converts the answer back. Errors
are raised as lbd errors and mapped to status codes by :mod:`lbd.api.errors`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from lbd.api import convert
from lbd.core.names import NamespaceName
from lbd.core.table import ApplyResult
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from lbd.tasks import cancel_and_wait, guard

if TYPE_CHECKING:
    from lbd.services.broker_link import BrokerLink
    from lbd.services.follower import ChannelFollower
    from lbd.services.lookup import LookupService

_log = logging.getLogger(__name__)


class LoadBalancerServicer(lbd_pb2_grpc.LoadBalancerServicer):
    """Lookups, the ownership feed and the broker session of one sidecar."""

    def __init__(
        self, *, lookup: LookupService, follower: ChannelFollower, link: BrokerLink
    ) -> None:
        self._lookup = lookup
        self._follower = follower
        self._link = link

    async def Lookup(
        self, request: lbd_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.LookupResponse:
        """The topic's bundle and owner; assigns the bundle unless ``read_only``."""
        result = await self._lookup.lookup(request.topic, read_only=request.read_only)
        return convert.lookup_response(result)

    async def WatchOwnership(
        self, request: lbd_pb2.WatchOwnershipRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[lbd_pb2.OwnershipChange]:
        """Every matching bundle's current value, then each accepted change, in channel order."""
        namespace = NamespaceName.parse(request.namespace) if request.namespace else None
        prefix = f"{namespace}/" if namespace is not None else ""
        async with _ChangeFeed(self._follower) as feed:
            # Taken after the feed subscribed: a change is in the snapshot, in the feed, or in
            # both (then its position is not after the snapshot's and it is dropped below).
            table = self._follower.table
            covered = table.last_position
            snapshot = sorted(
                ((b, v) for b, v in table.items() if b.startswith(prefix)), key=lambda bv: bv[0]
            )
            for bundle, value in snapshot:
                yield convert.ownership_change(bundle, value)
            while True:
                change = await feed.next()
                if covered is not None and change.position <= covered:
                    continue
                if change.key.startswith(prefix):
                    yield convert.ownership_change(change.key, change.new)

    async def BrokerSession(
        self,
        request_iterator: AsyncIterator[lbd_pb2.BrokerMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[lbd_pb2.SidecarMessage]:
        """The broker's stream, bridged to :meth:`BrokerLink.session` (core types inside)."""
        peer = context.peer()
        _log.info("broker session opened from %s", peer)
        incoming = (convert.broker_message_from_proto(m) async for m in request_iterator)
        try:
            async for command in self._link.session(incoming):
                yield convert.sidecar_message_to_proto(command)
        finally:
            _log.info("broker session from %s ended", peer)


class _ChangeFeed:
    """The follower's change feed, subscribed as soon as the ``async with`` is entered.

    :meth:`ChannelFollower.changes` subscribes only when first iterated; a pump task does that at
    once, so the caller can take a snapshot knowing no later change is missed.
    """

    def __init__(self, follower: ChannelFollower) -> None:
        self._follower = follower
        self._queue: asyncio.Queue[ApplyResult] = asyncio.Queue()
        self._pump: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _ChangeFeed:
        self._pump = guard(self._run(), name="watch-ownership-feed")
        # One loop turn lets the pump reach its first wait, subscribed (its step was scheduled
        # before ours resumes).
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await cancel_and_wait(self._pump)

    async def _run(self) -> None:
        # Cancelling the pump ends the feed's generator too, which unsubscribes it.
        async for change in self._follower.changes():
            self._queue.put_nowait(change)

    async def next(self) -> ApplyResult:
        """The next accepted change."""
        return await self._queue.get()
