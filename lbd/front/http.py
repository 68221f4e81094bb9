"""A small HTTP/1.1 server on asyncio: the broker's web port (``front.web_addr``,
``front.web_tls_addr``), where :mod:`lbd.front.rest` answers Pulsar's REST API.

What it speaks is what Pulsar's clients and ``curl`` send: one request at a time per connection,
kept alive unless the client says ``Connection: close`` (or speaks HTTP/1.0 without keep-alive),
a body only by ``Content-Length`` (``Expect: 100-continue`` answered), every response with a
``Content-Length``. What it refuses, it answers with a status and a JSON ``{"reason": ...}``
before it closes: a head over :data:`MAX_HEAD_BYTES` (431), a body over :data:`MAX_BODY_BYTES`
(413), a chunked body (411), a malformed request line (400). A connection idle for
:data:`IDLE_TIMEOUT_S` between requests is closed. A handler that raises gets a 500 naming the
error, and the connection stays usable.

A standard library server would run each request on a thread; the handlers here await gRPC
calls on the front's event loop, so the server lives on that loop too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qs, unquote, urlsplit

from lbd.core.errors import LbdError
from lbd.front.server import listen

_log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
"""Request line and headers at most."""
MAX_BODY_BYTES = 1024 * 1024
"""Request body at most (an admin call's JSON is a few hundred bytes)."""
IDLE_TIMEOUT_S = 60.0
"""A kept-alive connection silent this long between requests is closed."""
READ_TIMEOUT_S = 10.0
"""A request whose head or body takes longer than this to arrive is dropped."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request: ``path`` decoded (``%2F`` stays a separator), headers by lower-case name."""

    method: str
    path: str
    query: Mapping[str, list[str]]
    headers: Mapping[str, str]
    body: bytes
    peer: str
    tls: bool

    def param(self, name: str, default: str | None = None) -> str | None:
        """The first value of query parameter ``name``."""
        values = self.query.get(name)
        return values[0] if values else default


@dataclass(frozen=True, slots=True)
class Response:
    """A status, a body and its type, and any further headers (``Location``)."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, status: int, value: object) -> Response:
        return cls(status, json.dumps(value, separators=(",", ":")).encode())

    @classmethod
    def error(cls, status: int, reason: str) -> Response:
        """Pulsar's error body: ``{"reason": "..."}``."""
        return cls.json(status, {"reason": reason})

    @classmethod
    def text(cls, status: int, text: str) -> Response:
        return cls(status, text.encode(), "text/plain")


Handler = Callable[[Request], Awaitable[Response]]


class _Refused(Exception):
    """A request the server answers itself, then closes the connection."""

    def __init__(self, status: HTTPStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class HttpServer:
    """Serves ``handler`` on plain and TLS addresses; :meth:`start`, then :meth:`close`."""

    def __init__(
        self,
        handler: Handler,
        *,
        addr: str | None,
        tls_addr: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._handler = handler
        self._listen = {"plain": (addr, None), "tls": (tls_addr, tls)}
        self._servers: list[asyncio.Server] = []
        self._connections: set[asyncio.Task[None]] = set()
        self.ports: dict[str, int] = {}
        """The bound port of each listener ("plain", "tls")."""

    async def start(self) -> None:
        """Bind; LbdError naming the address when one cannot be bound."""
        for name, (addr, context) in self._listen.items():
            if addr is None:
                continue
            try:
                server = await listen(
                    addr,
                    functools.partial(
                        asyncio.start_server,
                        functools.partial(self._accept, tls=context is not None),
                        ssl=context,
                        reuse_address=True,
                        limit=MAX_HEAD_BYTES,
                    ),
                )
            except LbdError:
                await self.close()
                raise
            self._servers.append(server)
            self.ports[name] = server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and drop every connection; idempotent."""
        for server in self._servers:
            server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()

    async def _accept(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tls: bool
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        peer = writer.get_extra_info("peername")
        name = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        try:
            await self._serve(reader, writer, name, tls)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ssl.SSLError):
            pass
        except asyncio.CancelledError:
            # close() cancels the connection and awaits it. Ending normally matters on 3.11:
            # StreamReaderProtocol's done callback calls task.exception(), which on a cancelled
            # task raises and is logged as "Exception in callback" for every dropped connection.
            pass
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str, tls: bool
    ) -> None:
        while True:
            try:
                async with asyncio.timeout(IDLE_TIMEOUT_S):
                    head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return  # the client closed between requests
            except asyncio.LimitOverrunError:
                refused = _Refused(
                    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                    f"the request head is over {MAX_HEAD_BYTES} bytes",
                )
                await _send(writer, Response.error(refused.status, refused.reason), False)
                return
            try:
                request, keep = await self._read(reader, writer, head, peer, tls)
            except _Refused as e:
                await _send(writer, Response.error(e.status, e.reason), False)
                return
            try:
                response = await self._handler(request)
            except Exception as e:  # a handler's bug must not take the port down
                _log.exception("%s %s failed", request.method, request.path)
                response = Response.error(500, f"{type(e).__name__}: {e}")
            await _send(writer, response, keep, head_only=request.method == "HEAD")
            if not keep:
                return

    async def _read(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        head: bytes,
        peer: str,
        tls: bool,
    ) -> tuple[Request, bool]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _Refused(HTTPStatus.BAD_REQUEST, f"malformed request line {lines[0][:80]!r}")
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep or not name.strip():
                raise _Refused(HTTPStatus.BAD_REQUEST, f"malformed header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        connection = headers.get("connection", "").lower()
        keep = connection != "close" and (version == "HTTP/1.1" or connection == "keep-alive")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            raise _Refused(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length")
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            raise _Refused(HTTPStatus.BAD_REQUEST, "Content-Length is not a number") from None
        if length < 0 or length > MAX_BODY_BYTES:
            raise _Refused(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the body is {length} bytes, at most {MAX_BODY_BYTES} are read",
            )
        if length and headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = b""
        if length:
            async with asyncio.timeout(READ_TIMEOUT_S):
                body = await reader.readexactly(length)
        split = urlsplit(target)
        request = Request(
            method=method.upper(),
            path=unquote(split.path),
            query=parse_qs(split.query, keep_blank_values=True),
            headers=headers,
            body=body,
            peer=peer,
            tls=tls,
        )
        return request, keep


async def _send(
    writer: asyncio.StreamWriter, response: Response, keep: bool, *, head_only: bool = False
) -> None:
    try:
        reason = HTTPStatus(response.status).phrase
    except ValueError:
        reason = "Status"
    lines = [
        f"HTTP/1.1 {response.status} {reason}",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
        f"Connection: {'keep-alive' if keep else 'close'}",
        *(f"{k}: {v}" for k, v in response.headers.items()),
    ]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    # One write: each is a send on the socket, and a lookup's answer is a few hundred bytes.
    writer.write(head if head_only else head + response.body)
    await writer.drain()
