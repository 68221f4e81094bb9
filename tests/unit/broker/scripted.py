"""A scripted sidecar on a real in-process gRPC server: the test decides what it says.

Every ``BrokerSession`` and every ``WatchOwnership`` stream is handed to the test, which reads
what the broker sent and puts what the sidecar answers. The server listens on 127.0.0.1 on a
free port and is stopped by the fixture that started it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc

WAIT_S = 5.0


@dataclass
class Session:
    """One BrokerSession as the scripted sidecar sees it."""

    received: asyncio.Queue[lbd_pb2.BrokerMessage] = field(default_factory=asyncio.Queue)
    to_send: asyncio.Queue[lbd_pb2.SidecarMessage | None] = field(default_factory=asyncio.Queue)

    async def next(self, kind: str) -> lbd_pb2.BrokerMessage:
        """The next message of ``kind`` (hello, load, ack, lease_request), skipping others."""
        async with asyncio.timeout(WAIT_S):
            while True:
                message = await self.received.get()
                if message.WhichOneof("kind") == kind:
                    return message

    async def command(self, message: lbd_pb2.SidecarMessage) -> lbd_pb2.CommandAck:
        """Send a command and wait for its ack."""
        self.to_send.put_nowait(message)
        while True:
            ack = (await self.next("ack")).ack
            if ack.command_id == message.command_id:
                return ack

    async def grant_next(self, duration_ms: int) -> lbd_pb2.LeaseRequest:
        """Answer the next lease request with a lease of ``duration_ms``; the request."""
        request = (await self.next("lease_request")).lease_request
        lease = lbd_pb2.ServingLease(sequence=request.sequence, duration_ms=duration_ms)
        self.to_send.put_nowait(lbd_pb2.SidecarMessage(lease=lease))
        return request

    def end(self) -> None:
        """The sidecar ends the stream."""
        self.to_send.put_nowait(None)


class ScriptedSidecar(lbd_pb2_grpc.LoadBalancerServicer):
    """Hands every stream to the test; refuses new ones while :attr:`refuse` is set."""

    def __init__(self) -> None:
        self.sessions: asyncio.Queue[Session] = asyncio.Queue()
        self.watches: asyncio.Queue[asyncio.Queue[lbd_pb2.OwnershipChange | None]] = asyncio.Queue()
        self.watch_requests: list[lbd_pb2.WatchOwnershipRequest] = []
        self.refuse = False
        self.lookups: dict[str, lbd_pb2.LookupResponse] = {}
        """What LookupMany answers for a topic (a topic not here fails with NOT_FOUND)."""
        self.lookups_asked: list[str] = []

    async def next_session(self) -> Session:
        return await asyncio.wait_for(self.sessions.get(), WAIT_S)

    async def next_watch(self) -> asyncio.Queue[lbd_pb2.OwnershipChange | None]:
        return await asyncio.wait_for(self.watches.get(), WAIT_S)

    async def BrokerSession(
        self,
        request_iterator: AsyncIterator[lbd_pb2.BrokerMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[lbd_pb2.SidecarMessage]:
        session = Session()
        self.sessions.put_nowait(session)

        async def pump() -> None:
            async for message in request_iterator:
                session.received.put_nowait(message)

        reader = asyncio.create_task(pump())
        try:
            while (message := await session.to_send.get()) is not None:
                yield message
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def WatchOwnership(
        self, request: lbd_pb2.WatchOwnershipRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[lbd_pb2.OwnershipChange]:
        if self.refuse:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "refused by the test")
        feed: asyncio.Queue[lbd_pb2.OwnershipChange | None] = asyncio.Queue()
        self.watch_requests.append(request)
        self.watches.put_nowait(feed)
        while (change := await feed.get()) is not None:
            yield change

    async def LookupMany(
        self, request: lbd_pb2.LookupManyRequest, context: grpc.aio.ServicerContext
    ) -> lbd_pb2.LookupManyResponse:
        results = []
        for lookup in request.lookups:
            self.lookups_asked.append(lookup.topic)
            answer = self.lookups.get(lookup.topic)
            if answer is None:
                failure = lbd_pb2.LookupFailure(
                    code=grpc.StatusCode.NOT_FOUND.value[0], message="not scripted"
                )
                results.append(lbd_pb2.LookupResult(failure=failure))
            else:
                results.append(lbd_pb2.LookupResult(answer=answer))
        return lbd_pb2.LookupManyResponse(results=results)


@contextlib.asynccontextmanager
async def scripted_sidecar() -> AsyncIterator[tuple[ScriptedSidecar, str]]:
    """A scripted sidecar served on 127.0.0.1:<free port>, and its address; stopped on exit."""
    server = grpc.aio.server()
    servicer = ScriptedSidecar()
    lbd_pb2_grpc.add_LoadBalancerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` until it holds (gRPC I/O changes it; there is no event); bounded."""
    async with asyncio.timeout(WAIT_S):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.001)
