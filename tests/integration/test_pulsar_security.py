"""Pulsar TLS and token settings end to end through :class:`PulsarConnection`, on pulsar-lite.

pulsar-lite 0.2 speaks plaintext only and authenticates nobody: it accepts any CONNECT, whatever
credential it carries (docs/pulsar-security.md). So a relay in front of it records the CONNECT
command each connection opens with, proving what lbd presents, and, for TLS, terminates TLS
the way a TLS-terminating proxy in front of Pulsar would (asking for a client certificate).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from lbd.adapters.pulsar_channel import PulsarChannelLog
from lbd.adapters.pulsar_client import PULSAR_ERRORS, PulsarConnection
from lbd.config.schema import PulsarSettings
from lbd.devcluster import PulsarLiteServer
from lbd.devcluster.pki import DevPki
from lbd.ports.errors import UnavailableError
from tests.contract.channel_suite import take

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]

LOOPBACK = "127.0.0.1"
OPERATION_TIMEOUT_S = 3.0
TOKEN = "eyJhbGciOiJIUzI1NiJ9.bGJkLXNpZGVjYXI.signature"

_CONNECT = 2  # BaseCommand.Type.CONNECT
_CONNECT_FIELDS = {3: "auth_data", 5: "auth_method_name"}  # of CommandConnect


def _fields(message: bytes) -> dict[int, int | bytes]:
    """The top-level fields of a protobuf message (varints and length-delimited only)."""
    out: dict[int, int | bytes] = {}
    i = 0

    def varint() -> int:
        nonlocal i
        value = shift = 0
        while True:
            byte = message[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while i < len(message):
        tag = varint()
        if tag & 7 == 0:
            out[tag >> 3] = varint()
        elif tag & 7 == 2:
            size = varint()
            out[tag >> 3] = message[i : i + size]
            i += size
        else:
            raise AssertionError(f"unexpected wire type in {message!r}")
    return out


def parse_connect(frame: bytes) -> dict[str, bytes]:
    """The credential fields of a Pulsar CONNECT frame (``[total][cmd size][BaseCommand]``)."""
    command = _fields(frame[8 : 8 + struct.unpack(">I", frame[4:8])[0]])
    assert command[1] == _CONNECT, f"first command is not CONNECT: {command}"
    connect = command[2]
    assert isinstance(connect, bytes)
    return {
        name: value
        for number, value in _fields(connect).items()
        if (name := _CONNECT_FIELDS.get(number)) is not None and isinstance(value, bytes)
    }


class Relay:
    """Forwards loopback connections to pulsar-lite, recording each one's CONNECT command (and,
    with ``tls``, its client certificate's subject)."""

    def __init__(self, upstream: PulsarLiteServer, tls: ssl.SSLContext | None = None) -> None:
        self._upstream = upstream
        self._tls = tls
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.connects: list[dict[str, bytes]] = []
        self.client_subjects: list[object] = []

    async def start(self, host: str = LOOPBACK) -> None:
        self._server = await asyncio.start_server(self._handle, host, 0, ssl=self._tls)

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.append(writer)
        peer = writer.get_extra_info("peercert")
        if peer is not None:
            self.client_subjects.append(peer["subject"])
        try:
            up_reader, up_writer = await asyncio.open_connection(LOOPBACK, self._upstream.port)
            self._writers.append(up_writer)
            header = await reader.readexactly(4)
            frame = header + await reader.readexactly(struct.unpack(">I", header)[0])
            self.connects.append(parse_connect(frame))
            up_writer.write(frame)
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self._handlers.discard(task)

    def sever(self) -> None:
        """Cut every relayed connection, as a network failure would."""
        for writer in self._writers:
            writer.close()
        self._writers.clear()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.sever()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=5)


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    sink.close()


@pytest.fixture
async def relays() -> AsyncIterator[list[Relay]]:
    """Relays made by a test, closed after it."""
    made: list[Relay] = []
    yield made
    for relay in made:
        await relay.close()


@pytest.fixture
async def connections() -> AsyncIterator[list[PulsarConnection]]:
    """Connections made by a test, closed after it."""
    made: list[PulsarConnection] = []
    yield made
    for connection in made:
        await connection.close()


async def start_relay(
    relays: list[Relay], upstream: PulsarLiteServer, tls: ssl.SSLContext | None = None
) -> Relay:
    relay = Relay(upstream, tls)
    await relay.start()
    relays.append(relay)
    return relay


def connect(connections: list[PulsarConnection], url: str, **settings: Any) -> PulsarConnection:
    """A connection made as lbd makes it, from ``[pulsar]`` settings."""
    connection = PulsarConnection.from_settings(
        PulsarSettings(service_url=url, operation_timeout_s=OPERATION_TIMEOUT_S, **settings)
    )
    connections.append(connection)
    return connection


# --- tokens on pulsar-lite ----------------------------------------------------------------------


async def test_token_client_publishes_and_reads_the_channel(
    pulsar_server: PulsarLiteServer,
    pulsar_topic: str,
    relays: list[Relay],
    connections: list[PulsarConnection],
) -> None:
    relay = await start_relay(relays, pulsar_server)
    connection = connect(connections, f"pulsar://{LOOPBACK}:{relay.port}", auth_token=TOKEN)
    channel = PulsarChannelLog(connection, pulsar_topic)
    try:
        first = await channel.publish("t/ns/0x00000000_0x40000000", b'{"state": "Owned"}')
        await channel.publish("t/ns/0x40000000_0x80000000", b"")
        read = await take(channel.catch_up(None), 2)
    finally:
        await channel.close()
    assert [(m.key, m.value) for m in read] == [
        ("t/ns/0x00000000_0x40000000", b'{"state": "Owned"}'),
        ("t/ns/0x40000000_0x80000000", b""),
    ]
    assert read[0].position == first
    assert relay.connects[0] == {"auth_method_name": b"token", "auth_data": TOKEN.encode()}


async def test_rotated_token_file_is_presented_on_reconnection(
    pulsar_server: PulsarLiteServer,
    pulsar_topic: str,
    relays: list[Relay],
    connections: list[PulsarConnection],
    tmp_path: Path,
) -> None:
    relay = await start_relay(relays, pulsar_server)
    token_file = tmp_path / "token"
    token_file.write_text("first-token\n")
    connection = connect(
        connections, f"pulsar://{LOOPBACK}:{relay.port}", auth_token_file=str(token_file)
    )
    assert await connection.client.get_topic_partitions(pulsar_topic) == [pulsar_topic]
    token_file.write_text("second-token\n")
    relay.sever()
    # The client notices the cut connection on its own thread; ask until it has reconnected.
    deadline = time.monotonic() + 10
    while len(relay.connects) < 2:
        assert time.monotonic() < deadline, "the client did not reconnect"
        try:
            await connection.client.get_topic_partitions(pulsar_topic)
        except PULSAR_ERRORS:
            await asyncio.sleep(0.05)
    assert [c["auth_data"] for c in relay.connects] == [b"first-token", b"second-token"]


# --- TLS, through a TLS-terminating relay -----------------------------------------------------


def server_tls(pki: DevPki) -> ssl.SSLContext:
    """The relay's side: the dev CA's server certificate; client certificates are required."""
    files = pki.issue("pulsar", "pulsar", server=True)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca_file))
    context.load_cert_chain(files.cert, files.key)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


async def test_tls_with_a_client_certificate(
    pulsar_server: PulsarLiteServer,
    pulsar_topic: str,
    relays: list[Relay],
    connections: list[PulsarConnection],
    tmp_path: Path,
) -> None:
    pki = DevPki(tmp_path / "pki")
    relay = await start_relay(relays, pulsar_server, server_tls(pki))
    client = pki.issue("sidecar", "lbd-sidecar")
    connection = connect(
        connections,
        f"pulsar+ssl://localhost:{relay.port}",
        tls_trust_certs_file=str(pki.ca_file),
        tls_cert_file=str(client.cert),
        tls_key_file=str(client.key),
    )
    # Answered over the TLS connection to the service URL. (Producers and readers go where
    # pulsar-lite's lookup sends them, its plaintext address, which a TLS client refuses.)
    assert await connection.client.get_topic_partitions(pulsar_topic) == [pulsar_topic]
    assert relay.client_subjects == [((("commonName", "lbd-sidecar"),),)]
    assert relay.connects[0]["auth_method_name"] == b"tls"


async def test_tls_with_a_token(
    pulsar_server: PulsarLiteServer,
    pulsar_topic: str,
    relays: list[Relay],
    connections: list[PulsarConnection],
    tmp_path: Path,
) -> None:
    pki = DevPki(tmp_path / "pki")
    tls = server_tls(pki)
    tls.verify_mode = ssl.CERT_NONE
    relay = await start_relay(relays, pulsar_server, tls)
    connection = connect(
        connections,
        f"pulsar+ssl://localhost:{relay.port}",
        tls_trust_certs_file=str(pki.ca_file),
        auth_token=TOKEN,
    )
    assert await connection.client.get_topic_partitions(pulsar_topic) == [pulsar_topic]
    assert relay.connects == [{"auth_method_name": b"token", "auth_data": TOKEN.encode()}]


async def test_a_broker_signed_by_another_ca_is_refused_clearly(
    pulsar_server: PulsarLiteServer,
    pulsar_topic: str,
    relays: list[Relay],
    connections: list[PulsarConnection],
    tmp_path: Path,
) -> None:
    pki = DevPki(tmp_path / "pki")
    tls = server_tls(pki)
    tls.verify_mode = ssl.CERT_NONE
    relay = await start_relay(relays, pulsar_server, tls)
    other = DevPki(tmp_path / "other", name="some other CA")
    connection = connect(
        connections,
        f"pulsar+ssl://localhost:{relay.port}",
        tls_trust_certs_file=str(other.ca_file),
    )
    channel = PulsarChannelLog(connection, pulsar_topic)
    try:
        with pytest.raises(UnavailableError, match="certificate verify failed"):
            await channel.publish("t/ns/0x00000000_0x40000000", b"")
    finally:
        await channel.close()
    assert relay.connects == []
