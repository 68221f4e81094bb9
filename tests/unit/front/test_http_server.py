"""The broker's web port (:mod:`lbd.front.http`) spoken to byte by byte: keep-alive, bodies, the
requests it refuses, a handler that fails."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import pytest

from lbd.core.errors import LbdError
from lbd.front.http import MAX_BODY_BYTES, MAX_HEAD_BYTES, HttpServer, Request, Response


class Recorder:
    def __init__(self) -> None:
        self.requests: list[Request] = []

    async def __call__(self, request: Request) -> Response:
        self.requests.append(request)
        if request.path == "/boom":
            raise RuntimeError("the handler broke")
        return Response.json(200, {"path": request.path, "body": request.body.decode()})


@pytest.fixture
async def served() -> AsyncIterator[tuple[HttpServer, Recorder]]:
    recorder = Recorder()
    server = HttpServer(recorder, addr="127.0.0.1:0")
    await server.start()
    try:
        yield server, recorder
    finally:
        await server.close()


async def _connect(server: HttpServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", server.ports["plain"])


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {
            k.strip().lower(): v.strip()
            for k, _, v in (line.partition(":") for line in lines[1:] if line)
        }
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split(" ")[1]), headers, body


async def _eof(reader: asyncio.StreamReader) -> bool:
    async with asyncio.timeout(5):
        return await reader.read(1) == b""


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    await writer.wait_closed()


async def test_a_kept_alive_connection_serves_two_requests(
    served: tuple[HttpServer, Recorder],
) -> None:
    server, recorder = served
    reader, writer = await _connect(server)
    try:
        for path in ("/one", "/two"):
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            status, headers, body = await _answer(reader)
            assert (status, headers["connection"]) == (200, "keep-alive")
            assert json.loads(body)["path"] == path
        assert [r.path for r in recorder.requests] == ["/one", "/two"]
    finally:
        await _close(writer)


@pytest.mark.parametrize(
    "request_bytes",
    [b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n", b"GET / HTTP/1.0\r\n\r\n"],
)
async def test_close_and_http_1_0_end_the_connection_after_the_answer(
    served: tuple[HttpServer, Recorder], request_bytes: bytes
) -> None:
    reader, writer = await _connect(served[0])
    try:
        writer.write(request_bytes)
        status, headers, _ = await _answer(reader)
        assert (status, headers["connection"]) == (200, "close")
        assert await _eof(reader)
    finally:
        await _close(writer)


async def test_the_request_reaches_the_handler_parsed(
    served: tuple[HttpServer, Recorder],
) -> None:
    server, recorder = served
    reader, writer = await _connect(server)
    try:
        writer.write(
            b"put /a%20b/c?x=1&x=2&y= HTTP/1.1\r\nX-Thing: Value\r\nContent-Length: 3\r\n"
            b"Expect: 100-continue\r\n\r\n"
        )
        async with asyncio.timeout(5):
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"abc")
        status, _, body = await _answer(reader)
        assert status == 200 and json.loads(body)["body"] == "abc"
        got = recorder.requests[0]
        assert (got.method, got.path) == ("PUT", "/a b/c")
        assert (got.param("x"), got.query["x"], got.param("y")) == ("1", ["1", "2"], "")
        assert got.headers["x-thing"] == "Value" and not got.tls
    finally:
        await _close(writer)


@pytest.mark.parametrize(
    ("request_bytes", "status", "words"),
    [
        (b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 411, "Content-Length"),
        (f"PUT / HTTP/1.1\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode(), 413, "body"),
        (b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n", 431, "head"),
        (b"NONSENSE\r\n\r\n", 400, "request line"),
        (b"PUT / HTTP/1.1\r\nContent-Length: many\r\n\r\n", 400, "Content-Length"),
        (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400, "header"),
    ],
)
async def test_a_refused_request_gets_a_reason_and_the_connection_closes(
    served: tuple[HttpServer, Recorder], request_bytes: bytes, status: int, words: str
) -> None:
    server, recorder = served
    reader, writer = await _connect(server)
    try:
        writer.write(request_bytes)
        got, headers, body = await _answer(reader)
        assert got == status and headers["content-type"] == "application/json"
        assert words in json.loads(body)["reason"]
        assert await _eof(reader)
        assert recorder.requests == []
    finally:
        await _close(writer)


async def test_a_handler_that_raises_is_a_500_and_the_connection_goes_on(
    served: tuple[HttpServer, Recorder],
) -> None:
    reader, writer = await _connect(served[0])
    try:
        writer.write(b"GET /boom HTTP/1.1\r\n\r\n")
        status, _, body = await _answer(reader)
        assert status == 500 and "RuntimeError: the handler broke" in json.loads(body)["reason"]
        writer.write(b"GET /fine HTTP/1.1\r\n\r\n")
        assert (await _answer(reader))[0] == 200
    finally:
        await _close(writer)


async def test_head_gets_the_headers_without_the_body(
    served: tuple[HttpServer, Recorder],
) -> None:
    reader, writer = await _connect(served[0])
    try:
        writer.write(b"HEAD /x HTTP/1.1\r\n\r\nGET /y HTTP/1.1\r\n\r\n")
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
            assert b"Content-Length: " in head and b"Content-Length: 0" not in head
            # The next bytes are the second answer, not the first one's body.
            assert (await reader.readuntil(b"\r\n"))[:15] == b"HTTP/1.1 200 OK"[:15]
    finally:
        await _close(writer)


async def test_close_drops_idle_connections_and_may_be_repeated() -> None:
    server = HttpServer(Recorder(), addr="127.0.0.1:0")
    await server.start()
    reader, writer = await _connect(server)
    try:
        await server.close()
        assert await _eof(reader)
        await server.close()
    finally:
        await _close(writer)


async def test_a_port_in_use_is_named() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr = f"127.0.0.1:{taken.getsockname()[1]}"
        server = HttpServer(Recorder(), addr=addr)
        with pytest.raises(LbdError, match=f"cannot listen on {addr}: the port is in use"):
            await server.start()
