"""The web port's HTTP server (:mod:`lbd.front.http`) over raw sockets, so each test controls the
bytes: keep-alive and close, request parsing, bodies and ``100-continue``, the requests it
refuses, a failing handler, HEAD, shutdown and a port in use."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator

import pytest

from lbd.core.errors import LbdError
from lbd.front.http import MAX_BODY_BYTES, MAX_HEAD_BYTES, HttpServer, Request, Response

Answer = tuple[int, dict[str, str], bytes]


class Recorder:
    """A handler that keeps every request, echoes its path and body, and raises on ``/raise``."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    async def __call__(self, request: Request) -> Response:
        self.requests.append(request)
        if request.path == "/raise":
            raise ValueError("no such bundle")
        return Response.json(200, _echo(request.path, request.body))


def _echo(path: str, body: bytes = b"") -> dict[str, str]:
    return {"path": path, "body": body.decode("latin-1")}


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
async def server(recorder: Recorder) -> AsyncIterator[HttpServer]:
    server = HttpServer(recorder, addr="127.0.0.1:0")
    await server.start()
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def conn(
    server: HttpServer,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.ports["plain"])
    try:
        yield reader, writer
    finally:
        writer.close()
        await writer.wait_closed()


async def _answer(reader: asyncio.StreamReader) -> Answer:
    """One response: status, headers by lower-case name, and a body of its Content-Length."""
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in lines if line)
        }
        body = await reader.readexactly(int(headers["content-length"]))
    assert status_line.startswith("HTTP/1.1 ")
    return int(status_line.split(" ")[1]), headers, body


async def _rest(reader: asyncio.StreamReader) -> bytes:
    """Everything until the server closes; EOF must come within the timeout."""
    async with asyncio.timeout(5):
        return await reader.read()


async def test_a_kept_alive_connection_serves_two_requests(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], recorder: Recorder
) -> None:
    reader, writer = conn
    for path in ("/first", "/second"):
        writer.write(f"GET {path} HTTP/1.1\r\nHost: broker\r\n\r\n".encode())
        status, headers, body = await _answer(reader)
        assert (status, headers["connection"]) == (200, "keep-alive")
        assert headers["content-length"] == str(len(body))
        assert json.loads(body) == _echo(path)
    assert [r.path for r in recorder.requests] == ["/first", "/second"]


async def test_connection_close_is_answered_then_the_server_closes(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, writer = conn
    writer.write(b"GET /bye HTTP/1.1\r\nConnection: close\r\n\r\n")
    status, headers, _ = await _answer(reader)
    assert (status, headers["connection"]) == (200, "close")
    assert await _rest(reader) == b""


async def test_http_1_0_without_keep_alive_closes_after_the_answer(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, writer = conn
    writer.write(b"GET /old HTTP/1.0\r\n\r\n")
    status, headers, _ = await _answer(reader)
    assert (status, headers["connection"]) == (200, "close")
    assert await _rest(reader) == b""


async def test_http_1_0_with_keep_alive_stays_open(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, writer = conn
    for _ in range(2):
        writer.write(b"GET /old HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
        status, headers, _ = await _answer(reader)
        assert (status, headers["connection"]) == (200, "keep-alive")


async def test_query_path_headers_and_method_reach_the_handler_parsed(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], recorder: Recorder
) -> None:
    reader, writer = conn
    writer.write(
        b"get /admin/v2/namespaces/my%20tenant/ns%2Fx?a=1&a=2&b= HTTP/1.1\r\n"
        b"X-Pulsar-Auth-Method-Name: Token\r\nHOST: broker\r\n\r\n"
    )
    assert (await _answer(reader))[0] == 200
    (got,) = recorder.requests
    assert got.method == "GET"
    assert got.path == "/admin/v2/namespaces/my tenant/ns/x"
    assert got.param("a") == "1" and got.query["a"] == ["1", "2"]
    assert got.param("b") == "" and got.param("c") is None and got.param("c", "d") == "d"
    assert got.headers["x-pulsar-auth-method-name"] == "Token"
    assert got.headers["host"] == "broker"
    assert got.body == b"" and got.tls is False and got.peer.startswith("127.0.0.1:")


async def test_a_body_read_by_content_length_reaches_the_handler(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], recorder: Recorder
) -> None:
    reader, writer = conn
    payload = b'{"bundles": ["0x00000000_0x80000000"]}'
    # The body arrives in two parts; the next request follows it at once: exactly
    # Content-Length bytes are the body, however they are split.
    writer.write(
        f"PUT /unload HTTP/1.1\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload[:10]
    )
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(payload[10:] + b"GET /next HTTP/1.1\r\n\r\n")
    status, _, body = await _answer(reader)
    assert status == 200 and json.loads(body) == _echo("/unload", payload)
    assert json.loads((await _answer(reader))[2]) == _echo("/next")
    assert [(r.method, r.body) for r in recorder.requests] == [("PUT", payload), ("GET", b"")]


async def test_expect_100_continue_gets_continue_before_the_final_answer(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], recorder: Recorder
) -> None:
    reader, writer = conn
    writer.write(b"POST /upload HTTP/1.1\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    # The body is held back until the server says to go on.
    async with asyncio.timeout(5):
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert recorder.requests == []
    writer.write(b"hello")
    status, _, body = await _answer(reader)
    assert status == 200 and json.loads(body) == _echo("/upload", b"hello")


@pytest.mark.parametrize(
    ("request_bytes", "status", "reason_words"),
    [
        pytest.param(
            b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            411,
            "Content-Length",
            id="chunked-411",
        ),
        pytest.param(
            f"PUT /x HTTP/1.1\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode(),
            413,
            f"at most {MAX_BODY_BYTES}",
            id="body-over-limit-413",
        ),
        pytest.param(
            b"GET /x HTTP/1.1\r\nCookie: " + b"c" * MAX_HEAD_BYTES + b"\r\n\r\n",
            431,
            f"over {MAX_HEAD_BYTES} bytes",
            id="head-over-limit-431",
        ),
        pytest.param(b"GET /x\r\n\r\n", 400, "malformed request line", id="request-line-400"),
        pytest.param(
            b"PUT /x HTTP/1.1\r\nContent-Length: ten\r\n\r\n",
            400,
            "Content-Length is not a number",
            id="content-length-400",
        ),
    ],
)
async def test_a_refused_request_gets_a_json_reason_and_the_connection_closes(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    recorder: Recorder,
    request_bytes: bytes,
    status: int,
    reason_words: str,
) -> None:
    reader, writer = conn
    writer.write(request_bytes)
    got, headers, body = await _answer(reader)
    assert (got, headers["content-type"], headers["connection"]) == (
        status,
        "application/json",
        "close",
    )
    assert reason_words in json.loads(body)["reason"]
    assert await _rest(reader) == b""
    assert recorder.requests == []


async def test_a_handler_that_raises_is_a_500_and_the_connection_still_answers(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, writer = conn
    writer.write(b"GET /raise HTTP/1.1\r\n\r\n")
    status, headers, body = await _answer(reader)
    assert (status, headers["connection"]) == (500, "keep-alive")
    assert json.loads(body) == {"reason": "ValueError: no such bundle"}
    writer.write(b"GET /after HTTP/1.1\r\n\r\n")
    status, _, body = await _answer(reader)
    assert status == 200 and json.loads(body) == _echo("/after")


async def test_head_gets_the_headers_with_the_body_length_but_no_body_bytes(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], recorder: Recorder
) -> None:
    reader, writer = conn
    writer.write(b"HEAD /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
    everything = await _rest(reader)
    head, sep, after = everything.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and sep and after == b""
    length = len(Response.json(200, _echo("/metrics")).body)
    assert f"\r\nContent-Length: {length}\r\n".encode() in head + b"\r\n"
    assert [r.method for r in recorder.requests] == ["HEAD"]


async def test_close_drops_an_idle_connection_and_may_be_repeated(
    server: HttpServer, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]
) -> None:
    reader, writer = conn
    writer.write(b"GET /once HTTP/1.1\r\n\r\n")
    assert (await _answer(reader))[0] == 200  # served, kept alive, now idle
    await server.close()
    assert await _rest(reader) == b""
    await server.close()


async def test_close_logs_no_error_for_the_connections_it_drops(
    server: HttpServer,
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    reader, writer = conn
    writer.write(b"GET /once HTTP/1.1\r\n\r\n")
    assert (await _answer(reader))[0] == 200
    with caplog.at_level(logging.WARNING):
        await server.close()
        assert await _rest(reader) == b""
        await asyncio.sleep(0)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_port_in_use_is_an_lbd_error_naming_the_address(recorder: Recorder) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr = f"127.0.0.1:{taken.getsockname()[1]}"
        server = HttpServer(recorder, addr=addr)
        try:
            with pytest.raises(LbdError, match=f"^cannot listen on {addr}: the port is in use$"):
                await server.start()
            assert server.ports == {}
        finally:
            await server.close()
