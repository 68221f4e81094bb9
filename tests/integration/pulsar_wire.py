"""A raw Pulsar-protocol client for tests: it sends exactly the frames the test writes and shows
every frame the server sends, where the official client would hide them (a CLOSE_PRODUCER and
its URL, a SEND that got no receipt)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time

from lbd.front import wire
from lbd.front.wire import Command, Frame, FrameDecoder, Type
from lbd.gen.pulsar import pulsar_api_pb2 as api

WAIT_S = 5.0


class RawClient:
    """One connection; frames the server sends are queued until the test takes them."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self.writer = writer
        self._frames: asyncio.Queue[Frame | None] = asyncio.Queue()
        self._pump = asyncio.create_task(self._read())
        self._sequence = 0

    @classmethod
    async def open(cls, port: int, *, handshake: bool = True) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = cls(reader, writer)
        if handshake:
            client.send(
                Command(
                    type=Type.CONNECT,
                    connect=api.CommandConnect(client_version="raw-test", protocol_version=20),
                )
            )
            await client.expect(Type.CONNECTED)
        return client

    async def _read(self) -> None:
        decoder = FrameDecoder()
        try:
            while data := await self._reader.read(65536):
                for frame in decoder.feed(data):
                    if frame.type == Type.PING:
                        self.send(Command(type=Type.PONG, pong=api.CommandPong()))
                    else:
                        self._frames.put_nowait(frame)
        finally:
            self._frames.put_nowait(None)

    def send(self, command: Command, payload: bytes | None = None) -> None:
        self.writer.write(wire.encode(command, payload))

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    async def next(self, timeout_s: float = WAIT_S) -> Frame | None:
        """The next frame; None when the server closed the connection. TimeoutError if none."""
        async with asyncio.timeout(timeout_s):
            return await self._frames.get()

    async def expect(self, kind: int, timeout_s: float = WAIT_S) -> Frame:
        """The next frame of ``kind``, skipping receipts and messages of other kinds."""
        deadline = time.monotonic() + timeout_s
        while True:
            frame = await self.next(max(deadline - time.monotonic(), 0.001))
            if frame is None:
                raise ConnectionError(f"closed while waiting for {wire.type_name(kind)}")
            if frame.type == kind:
                return frame

    async def closed(self, timeout_s: float = WAIT_S) -> bool:
        """Whether the server closes the connection within ``timeout_s`` (frames skipped)."""
        with contextlib.suppress(TimeoutError):
            deadline = time.monotonic() + timeout_s
            while await self.next(max(deadline - time.monotonic(), 0.001)) is not None:
                pass
            return True
        return False

    async def producer(self, topic: str, producer_id: int = 1, request_id: int = 1) -> Frame:
        """Create a producer; the answer (PRODUCER_SUCCESS or ERROR)."""
        self.send(
            Command(
                type=Type.PRODUCER,
                producer=api.CommandProducer(
                    topic=topic, producer_id=producer_id, request_id=request_id
                ),
            )
        )
        return await self.answer(request_id)

    async def subscribe(
        self,
        topic: str,
        consumer_id: int = 1,
        request_id: int = 2,
        sub_type: int = 2,
        consumer_name: str = "",
    ) -> Frame:
        """Subscribe (Failover by default, from the earliest message); the answer."""
        self.send(
            Command(
                type=Type.SUBSCRIBE,
                subscribe=api.CommandSubscribe(
                    topic=topic,
                    subscription="test",
                    subType=sub_type,  # type: ignore[arg-type]
                    consumer_id=consumer_id,
                    request_id=request_id,
                    consumer_name=consumer_name,
                    initialPosition=api.CommandSubscribe.Earliest,
                ),
            )
        )
        return await self.answer(request_id)

    async def answer(self, request_id: int) -> Frame:
        """The answer to request ``request_id``."""
        while True:
            frame = await self.expect_any(
                (Type.SUCCESS, Type.ERROR, Type.PRODUCER_SUCCESS, Type.LOOKUP_RESPONSE)
            )
            if _request_id(frame) == request_id:
                return frame

    async def answer_within(self, request_id: int, timeout_s: float) -> Frame:
        """The answer to request ``request_id``; TimeoutError after ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            return await self.answer(request_id)

    async def expect_any(self, kinds: tuple[int, ...], timeout_s: float = WAIT_S) -> Frame:
        deadline = time.monotonic() + timeout_s
        while True:
            frame = await self.next(max(deadline - time.monotonic(), 0.001))
            if frame is None:
                raise ConnectionError("closed while waiting for an answer")
            if frame.type in kinds:
                return frame

    def send_message(self, body: bytes, producer_id: int = 1) -> int:
        """One SEND with the next sequence id; the sequence id."""
        sequence = self._sequence
        self._sequence += 1
        metadata = api.MessageMetadata(producer_name="raw", sequence_id=sequence, publish_time=1)
        self.send(
            Command(
                type=Type.SEND,
                send=api.CommandSend(producer_id=producer_id, sequence_id=sequence),
            ),
            wire.make_payload(metadata, body),
        )
        return sequence

    async def reset(self) -> None:
        """End the connection with a reset, as the kernel does for a process killed with data
        unread, then close."""
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()
        await self.close()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()
        self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump


def _request_id(frame: Frame) -> int | None:
    command = frame.command
    for field in ("success", "error", "producer_success", "lookupTopicResponse"):
        if command.HasField(field):
            return int(getattr(command, field).request_id)
    return None
