"""The links' proxies (:mod:`lbd.devcluster.links`) as a partition test relies on them, around
a plain echo server: a cut link passes nothing and closes nothing, and delivers what it held once
restored; a connection made while cut reaches the server once the link returns; a slow link
delays, a flaky one stalls every other period; bad requests are refused by name."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lbd.adapters.pulsar_channel import PulsarChannelLog
from lbd.adapters.pulsar_client import PulsarConnection
from lbd.core.errors import InvalidInputError
from lbd.devcluster import PulsarLiteServer
from lbd.devcluster.links import LinkSpec, link_status, proxied_url, set_links
from lbd.devcluster.ports import LOOPBACK, free_ports
from lbd.devcluster.processes import LinksProcess
from lbd.ports.errors import UnavailableError

pytestmark = pytest.mark.timeout(60)


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(4096):
            self.request.sendall(data)


@pytest.fixture(scope="module")
def links(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LinksProcess]:
    server = socketserver.ThreadingTCPServer((LOOPBACK, 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    target = f"{LOOPBACK}:{server.server_address[1]}"
    a, b, control = free_ports(3)
    process = LinksProcess(
        tmp_path_factory.mktemp("links"),
        [LinkSpec("host-1/echo", a, target), LinkSpec("host-2/echo", b, target)],
        control,
    )
    process.start()
    try:
        yield process
    finally:
        process.close()
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def _restored(links: LinksProcess) -> Iterator[None]:
    yield
    set_links(links.control_addr, list(links.specs), "up")


def _connect(links: LinksProcess, name: str = "host-1/echo") -> socket.socket:
    host, _, port = links.specs[name].addr.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.settimeout(5)
    return sock


def _round_trip_s(sock: socket.socket, data: bytes = b"ping") -> float:
    start = time.monotonic()
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        got += sock.recv(4096)
    assert got == data
    return time.monotonic() - start


def _silent_for(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(4096) == b"never"  # nothing may arrive, not even a close
    except TimeoutError:
        return True
    finally:
        sock.settimeout(5)


def test_an_up_link_passes_bytes_both_ways(links: LinksProcess) -> None:
    with _connect(links) as sock:
        assert _round_trip_s(sock) < 1.0
    status = link_status(links.control_addr)
    assert status["host-1/echo"]["mode"] == "up"
    assert int(str(status["host-1/echo"]["bytes"])) >= 8


def test_a_cut_link_passes_nothing_closes_nothing_and_delivers_what_it_held_once_restored(
    links: LinksProcess,
) -> None:
    with _connect(links) as sock, _connect(links, "host-2/echo") as other:
        assert _round_trip_s(sock) < 1.0
        set_links(links.control_addr, ["host-1/echo"], "cut")
        sock.sendall(b"held")
        assert _silent_for(sock, 0.5)
        assert _round_trip_s(other) < 1.0  # the other link still passes
        set_links(links.control_addr, ["host-1/echo"], "up")
        assert sock.recv(4096) == b"held"


def test_what_a_sender_wrote_while_cut_is_dropped_when_it_resets_the_connection(
    links: LinksProcess,
) -> None:
    sock = _connect(links)
    assert _round_trip_s(sock) < 1.0
    set_links(links.control_addr, ["host-1/echo"], "cut")
    sock.sendall(b"late write")
    time.sleep(0.2)
    sock.shutdown(socket.SHUT_WR)  # closed first, then reset (as the broker front does)
    time.sleep(0.2)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # a reset: the kernel drops what the peer has not acknowledged
    time.sleep(0.2)
    before = link_status(links.control_addr)["host-1/echo"]
    assert int(str(before["dropped"])) >= len(b"late write")
    set_links(links.control_addr, ["host-1/echo"], "up")
    time.sleep(0.2)
    after = link_status(links.control_addr)["host-1/echo"]
    assert after["bytes"] == before["bytes"]  # nothing reached the server


def test_a_connection_made_while_cut_reaches_the_server_once_the_link_returns(
    links: LinksProcess,
) -> None:
    set_links(links.control_addr, ["host-1/echo"], "cut")
    with _connect(links) as sock:
        sock.sendall(b"early")
        assert _silent_for(sock, 0.5)
        set_links(links.control_addr, ["host-1/echo"], "up")
        assert sock.recv(4096) == b"early"


def test_a_slow_link_delays_every_chunk(links: LinksProcess) -> None:
    set_links(links.control_addr, ["host-1/echo"], "slow", delay_s=0.2)
    with _connect(links) as sock:
        assert _round_trip_s(sock) >= 0.4  # one delay each way


def test_a_flaky_link_passes_then_stalls_in_turn(links: LinksProcess) -> None:
    set_links(links.control_addr, ["host-1/echo"], "flaky", period_s=0.3)
    trips = []
    with _connect(links) as sock:
        for _ in range(12):  # over two periods of passing and two of stalling, at least
            trips.append(_round_trip_s(sock))
            time.sleep(0.1)
    assert max(trips) >= 0.1, trips  # some waited out a stall
    assert min(trips) < 0.1, trips  # some passed at once
    assert max(trips) < 1.0, trips


def test_unknown_links_and_bad_modes_are_refused_by_name(links: LinksProcess) -> None:
    with pytest.raises(InvalidInputError, match=r"no link host-9/echo \(links: host-1/echo"):
        set_links(links.control_addr, ["host-9/echo"], "cut")
    with pytest.raises(InvalidInputError, match="mode must be one of up, cut, slow, flaky"):
        set_links(links.control_addr, ["host-1/echo"], "down")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="a slow link needs a delay"):
        set_links(links.control_addr, ["host-1/echo"], "slow", delay_s=0)
    assert {s["mode"] for s in link_status(links.control_addr).values()} == {"up"}


def test_a_proxied_url_keeps_its_scheme(tmp_path: Path) -> None:
    spec = LinkSpec("b/etcd", 4321, "127.0.0.1:2379")
    assert proxied_url("https://127.0.0.1:2379", spec) == f"https://{LOOPBACK}:4321"
    assert proxied_url("127.0.0.1:2379", spec) == f"{LOOPBACK}:4321"


async def test_a_cut_pulsar_link_cuts_the_clients_topic_connections_too(
    private_pulsar_server: PulsarLiteServer, pulsar_topic: str, tmp_path: Path
) -> None:
    """A Pulsar client follows a lookup to the broker's own address; without the link's
    rewritten lookup answers its producer and reader went around the proxy, and a sidecar "cut
    from the channel" still wrote and read it."""
    server = private_pulsar_server
    port, control = free_ports(2)
    target = server.service_url.rpartition("//")[2]
    process = LinksProcess(
        tmp_path, [LinkSpec("host-1/channel", port, target, pulsar=True)], control
    )
    process.start()
    connection = PulsarConnection(
        proxied_url(server.service_url, process.specs["host-1/channel"]), operation_timeout_s=3.0
    )
    channel = PulsarChannelLog(connection, pulsar_topic, send_timeout_s=1.0)
    try:
        first = await channel.publish("t/ns/a", b"1")
        assert await channel.last_after(None) == first

        set_links(process.control_addr, ["host-1/channel"], "cut")
        with pytest.raises(UnavailableError):
            await channel.publish("t/ns/a", b"2")
        with pytest.raises(UnavailableError):
            await channel.last_after(first)

        set_links(process.control_addr, ["host-1/channel"], "up")
        for _ in range(40):  # until the client is connected again
            with contextlib.suppress(UnavailableError):
                last = await channel.publish("t/ns/a", b"3")
                break
        else:
            raise AssertionError("the channel took no write after the link returned")
        assert await channel.last_after(first) == last
    finally:
        await channel.close()
        await connection.close()
        process.close()
