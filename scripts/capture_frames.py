"""Capture the frames the official Pulsar client and a Pulsar server exchange, for the codec tests.

``python scripts/capture_frames.py [OUT]`` starts a pulsar-lite, puts a recording proxy in front
of it (lookups are answered with the proxy's URL, so the client stays on it), and has the
official client (``pulsar-client``) create a consumer, a producer, send synchronously and
asynchronously, receive and acknowledge, open a reader and ask whether it has messages. Every
frame, both ways, is written as a JSON line ``{"from": "client"|"server", "type": NAME, "hex":
BYTES}`` to OUT (default ``tests/unit/front/captured_frames.jsonl``). The codec tests decode
each and encode it again, byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import pulsar

from lbd.devcluster import PulsarLiteServer
from lbd.devcluster.ports import LOOPBACK, free_port
from lbd.front import wire
from lbd.front.wire import Type

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "unit" / "front" / "captured_frames.jsonl"


class Recorder:
    """A proxy between the client and the server that records every frame."""

    def __init__(self, server_port: int, proxy_port: int) -> None:
        self.server_port = server_port
        self.proxy_url = f"pulsar://{LOOPBACK}:{proxy_port}"
        self.frames: list[dict[str, str]] = []

    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(LOOPBACK, self.server_port)
        await asyncio.gather(
            self._pipe(client_r, server_w, "client"),
            self._pipe(server_r, client_w, "server"),
            return_exceptions=True,
        )

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, side: str
    ) -> None:
        # Frames are cut by their size prefix, so what is recorded are the bytes as they were
        # sent, not what this codec would make of them.
        while True:
            try:
                head = await reader.readexactly(4)
            except asyncio.IncompleteReadError:
                break
            raw = head + await reader.readexactly(int.from_bytes(head, "big"))
            (frame,) = wire.FrameDecoder().feed(raw)
            self.frames.append({"from": side, "type": wire.type_name(frame.type), "hex": raw.hex()})
            if frame.type == Type.LOOKUP_RESPONSE:
                frame.command.lookupTopicResponse.brokerServiceUrl = self.proxy_url
                raw = wire.encode(frame.command, frame.payload)
            writer.write(raw)
        writer.close()


def client_session(url: str) -> None:
    """What a producer, a consumer and a reader of the official client do."""
    client = pulsar.Client(url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    topic = f"persistent://public/default/capture-{time.time_ns()}"
    consumer = client.subscribe(
        topic,
        "capture",
        consumer_type=pulsar.ConsumerType.Failover,
        initial_position=pulsar.InitialPosition.Earliest,
    )
    producer = client.create_producer(topic, batching_enabled=False)
    for i in range(3):
        producer.send(f"message {i}".encode(), properties={"key": "value"}, partition_key=f"k{i}")
    sent = threading.Event()
    producer.send_async(b"async", lambda result, message_id: sent.set())
    producer.flush()
    sent.wait(10)
    for _ in range(4):
        consumer.acknowledge(consumer.receive(10_000))
    reader = client.create_reader(topic, pulsar.MessageId.earliest)
    reader.read_next(10_000)
    reader.close()
    reader = client.create_reader(topic, pulsar.MessageId.latest)
    reader.has_message_available()  # asks the server for the topic's last message id
    reader.close()
    consumer.close()
    producer.close()
    client.close()


async def capture() -> list[dict[str, str]]:
    proxy_port = free_port()
    with PulsarLiteServer() as server:
        recorder = Recorder(server.port, proxy_port)
        proxy = await asyncio.start_server(recorder.handle, LOOPBACK, proxy_port)
        async with proxy:
            await asyncio.to_thread(client_session, recorder.proxy_url)
            await asyncio.sleep(0.5)
    return recorder.frames


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    frames = asyncio.run(capture())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(f) + "\n" for f in frames))
    kinds = sorted({f["type"] for f in frames})
    print(f"{len(frames)} frames ({', '.join(kinds)}) written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
