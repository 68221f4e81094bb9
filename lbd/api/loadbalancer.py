"""``lbd.v1.LoadBalancer``: what the broker beside the sidecar (and broker-side caches) call.

Thin: each method converts the request, calls one service and converts the answer back. Errors
are raised as lbd errors and mapped to status codes by :mod:`lbd.api.errors`.

``WatchOwnership`` heartbeats say how fresh the stream is, and only what the sidecar can prove:
every change the state channel held at an instant ``vouched_age_ms`` before the heartbeat was
sent has been sent before it. The proof is a read barrier (run by the fence at least every half
``channel_fence_after_s``) that began after that instant and whose mark the stream has reached
(:class:`_Vouch`). A sidecar that cannot read the channel keeps sending heartbeats, with an age
that grows; a paused one sends none. Ages are measured on this process's monotonic clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Final, TypeVar

import grpc

from lbd.api import convert
from lbd.api.auth import BROKER_SESSION, Authenticator, Refused, audit, principal_of
from lbd.api.errors import failure_of
from lbd.core.errors import InvalidInputError
from lbd.core.names import NamespaceName
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from lbd.services.channel.follower import ReadBarrier
from lbd.services.sidecar.lookup import LookupResult
from lbd.tasks import cancel_and_wait, guard

if TYPE_CHECKING:
    from lbd.core.table import ApplyResult
    from lbd.services.channel.follower import ChannelFollower
    from lbd.services.sidecar.broker_link import BrokerLink
    from lbd.services.sidecar.lookup import LookupService

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

_MAX_AGE_MS: Final = 2**32 - 1
"""The largest ``vouched_age_ms`` (a uint32): about 50 days."""
_MIN_HEARTBEAT_S: Final = 0.01
"""The shortest heartbeat interval served, whatever a client asks for."""
MAX_LOOKUPS_PER_CALL: Final = 4_096
"""The most lookups one ``LookupMany`` call may carry."""
_LOOKUP_MANY = "/lbd.v1.LoadBalancer/LookupMany"
_SAMPLES_KEPT: Final = 16
"""Barrier-count samples a :class:`_Vouch` keeps; dropping the oldest only makes it vouch less."""


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
        self._responses = convert.LookupResponses()

    async def Lookup(
        self, request: lbd_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.LookupResponse:
        """The topic's bundle and owner; assigns the bundle unless ``read_only``.

        Most calls ask for an Owned bundle of a topic asked for before: they are answered from
        memory without a coroutine of their own (:meth:`LookupService.answer_now`), with an
        answer made once per bundle and owner (:class:`~lbd.api.convert.LookupResponses`)."""
        result = self._lookup.answer_now(request.topic)
        if result is None:
            result = await self._lookup.lookup(request.topic, read_only=request.read_only)
        return self._responses.of(result)

    async def LookupMany(
        self, request: lbd_pb2.LookupManyRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.LookupManyResponse:
        """Each lookup answered as :meth:`Lookup` would answer it alone, concurrently, in the
        order asked; one that fails carries the status code and message it would have failed
        with, and the others are answered all the same."""
        count = len(request.lookups)
        if count > MAX_LOOKUPS_PER_CALL:
            raise InvalidInputError(
                f"LookupMany carries {count} lookups; at most {MAX_LOOKUPS_PER_CALL} per call"
            )
        # Those answered from memory first, without a task each; the others concurrently.
        now: list[LookupResult | BaseException | None] = []
        for lookup in request.lookups:
            try:
                now.append(self._lookup.answer_now(lookup.topic))
            except Exception as e:  # fenced: the failure its Lookup would have ended with
                now.append(e)
        waiting = [r for r, answer in zip(request.lookups, now, strict=True) if answer is None]
        later = iter(
            await asyncio.gather(
                *(self._lookup.lookup(r.topic, read_only=r.read_only) for r in waiting),
                return_exceptions=True,
            )
        )
        outcomes = [next(later) if answer is None else answer for answer in now]
        return lbd_pb2.LookupManyResponse(
            results=[_lookup_result(o, self._responses) for o in outcomes]
        )

    async def WatchOwnership(
        self, request: lbd_pb2.WatchOwnershipRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[lbd_pb2.OwnershipChange]:
        """Every matching bundle's current value, the end of those, then each accepted change,
        in channel order; with ``heartbeat_ms``, a heartbeat that often once the sidecar can
        vouch for the stream (the module docstring)."""
        namespace = NamespaceName.parse(request.namespace) if request.namespace else None
        prefix = f"{namespace}/" if namespace is not None else ""
        # Subscribed, the barrier count sampled, then the snapshot taken, with no await between:
        # every change is either in the snapshot or in the feed, never in both, and a barrier
        # begun after the sample covers the snapshot.
        feed = self._follower.changes_and_barriers()
        vouch = _Vouch(self._follower)
        async with contextlib.aclosing(feed):
            snapshot = sorted(
                (b, v) for b, v in self._follower.table.items() if b.startswith(prefix)
            )
            for bundle, value in snapshot:
                yield convert.ownership_change(bundle, value)
            yield lbd_pb2.OwnershipChange(snapshot_done=True)
            interval_s = max(request.heartbeat_ms / 1000, _MIN_HEARTBEAT_S)
            beats = _with_beats(feed, interval_s if request.heartbeat_ms else None)
            async with contextlib.aclosing(beats):
                async for beat_or_item in beats:
                    if beat_or_item is None:
                        vouch.sample()
                        age_ms = vouch.age_ms()
                        if age_ms is not None:
                            yield lbd_pb2.OwnershipChange(heartbeat=True, vouched_age_ms=age_ms)
                    elif isinstance(beat_or_item, ReadBarrier):
                        vouch.reached(beat_or_item.number)
                    elif beat_or_item.key.startswith(prefix):
                        yield convert.ownership_change(beat_or_item.key, beat_or_item.new)

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
        incoming = convert.broker_messages_from_proto(_prepend(first, messages))
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


class _Vouch:
    """The latest instant as of which one ownership stream is known complete.

    The follower counts the read barriers it begins. Reading the count n at instant t tells that
    a barrier numbered above n began after t; once the stream has passed that barrier's mark, it
    has sent every change the channel held at t. So the vouch samples (count, instant) now and
    then, keeping the latest instant per count, and when the stream reaches the mark of barrier
    k it vouches for the latest sample whose count is below k.
    """

    def __init__(self, follower: ChannelFollower) -> None:
        self._follower = follower
        self._samples: deque[tuple[int, float]] = deque(maxlen=_SAMPLES_KEPT)
        self._as_of: float | None = None
        self.sample()

    def sample(self) -> None:
        """Note how many barriers began by now."""
        begun, now = self._follower.barriers_begun, time.monotonic()
        if self._samples and self._samples[-1][0] == begun:
            self._samples[-1] = (begun, now)  # a later instant for the same count is tighter
        else:
            self._samples.append((begun, now))

    def reached(self, barrier: int) -> None:
        """The stream has passed the mark of read barrier number ``barrier``."""
        while self._samples and self._samples[0][0] < barrier:
            _, at = self._samples.popleft()
            self._as_of = at if self._as_of is None else max(self._as_of, at)
        self.sample()

    def age_ms(self) -> int | None:
        """How long ago (ms, rounded up) the instant vouched for was; None while there is none."""
        if self._as_of is None:
            return None
        return min(math.ceil((time.monotonic() - self._as_of) * 1000), _MAX_AGE_MS)


async def _with_beats(
    feed: AsyncIterator[ApplyResult | ReadBarrier], interval_s: float | None
) -> AsyncGenerator[ApplyResult | ReadBarrier | None, None]:
    """The items of ``feed`` in order, and None every ``interval_s`` between them (never when
    ``interval_s`` is None).

    A task moves the feed into a queue, so that waiting for the next item can time out without
    cancelling the feed's own wait (which would end it)."""
    if interval_s is None:
        async for item in feed:
            yield item
        return
    queue: asyncio.Queue[ApplyResult | ReadBarrier] = asyncio.Queue()

    async def pump() -> None:
        async for item in feed:
            queue.put_nowait(item)

    pumping = guard(pump(), name="watch-ownership-feed")
    try:
        next_beat = time.monotonic() + interval_s
        while not pumping.done() or not queue.empty():
            wait_s = next_beat - time.monotonic()
            if wait_s <= 0:
                yield None
                next_beat = time.monotonic() + interval_s
                continue
            try:
                async with asyncio.timeout(wait_s):
                    item = await queue.get()
            except TimeoutError:
                continue
            yield item
    finally:
        await cancel_and_wait(pumping)


def _lookup_result(
    outcome: LookupResult | BaseException, responses: convert.LookupResponses
) -> lbd_pb2.LookupResult:
    if isinstance(outcome, LookupResult):
        return lbd_pb2.LookupResult(answer=responses.of(outcome))
    if not isinstance(outcome, Exception):
        raise outcome  # a cancellation: the call's, never one lookup's alone
    code, message = failure_of(_LOOKUP_MANY, outcome)
    return lbd_pb2.LookupResult(failure=lbd_pb2.LookupFailure(code=code.value[0], message=message))


async def _prepend(first: _T, rest: AsyncIterator[_T]) -> AsyncIterator[_T]:
    yield first
    async for item in rest:
        yield item
