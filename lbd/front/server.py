"""The front's listening ports: plaintext and TLS, connection limits, handshake and keepalive.

Every connection is a :class:`~lbd.front.connection.ClientConnection`. The server refuses what
would let one peer starve the others: past ``max_connections`` in all, or
``max_connections_per_peer`` from one IP address, a new connection is closed as it arrives
(counted in ``lbd_front_rejected_connections``, logged at most once a second). A connection
that has not said CONNECT within ``handshake_timeout_s`` is closed; one silent for
``keepalive_interval_s`` is pinged, and closed when it stays silent as long again.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import functools
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from lbd.api.tls import ServerTlsFiles
from lbd.core.errors import InvalidInputError, LbdError
from lbd.front.connection import ClientConnection
from lbd.front.service import Front
from lbd.front.wire import FRAME_OVERHEAD

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Limits:
    """What one connection, one peer and the whole front may take."""

    max_connections: int = 10_000
    max_connections_per_peer: int = 1_000
    handshake_timeout_s: float = 10.0
    keepalive_interval_s: float = 30.0


async def listen(
    addr: str, start: Callable[[str, int], Awaitable[asyncio.Server]]
) -> asyncio.Server:
    """``start(host, port)`` of ``addr`` (``host:port``, ``[v6]:port``); LbdError naming the
    address when it cannot be bound (the port in use said so)."""
    host, _, port = addr.rpartition(":")
    try:
        return await start(host.strip("[]"), int(port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise LbdError(f"cannot listen on {addr}: the port is in use") from None
        raise LbdError(f"cannot listen on {addr}: {e.strerror or e}") from None


class ReloadingTls:
    """The TLS port's context, loaded again when its files change (new handshakes use the new
    certificate; connections open keep theirs). A file caught half-written keeps the old one."""

    def __init__(self, files: ServerTlsFiles) -> None:
        self._files = files
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        if files.client_ca_file is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED
        try:
            self._load()
        except (OSError, ssl.SSLError) as e:
            raise InvalidInputError(f"front TLS files do not load: {e}") from None
        self._stamp = self._stamps()
        self.reloads = 0

    def check(self) -> None:
        """Reload when a file changed since the last check."""
        try:
            stamp = self._stamps()
            if stamp == self._stamp:
                return
            self._load()
        except (OSError, ssl.SSLError) as e:
            _log.warning("front TLS files changed but do not load yet (keeping the old): %s", e)
            return
        self._stamp = stamp
        self.reloads += 1
        _log.info("front TLS files changed: new connections use them")

    def _load(self) -> None:
        f = self._files
        self.context.load_cert_chain(f.cert_file, f.key_file)
        if f.client_ca_file is not None:
            self.context.load_verify_locations(cafile=f.client_ca_file)

    def _stamps(self) -> tuple[tuple[int, int], ...]:
        paths: list[Path] = [self._files.cert_file, self._files.key_file]
        if self._files.client_ca_file is not None:
            paths.append(self._files.client_ca_file)
        return tuple((s.st_mtime_ns, s.st_size) for s in (os.stat(p) for p in paths))


class FrontServer:
    """Listens for clients of one :class:`Front`; :meth:`start`, then :meth:`close`."""

    def __init__(
        self,
        front: Front,
        *,
        addr: str | None,
        tls_addr: str | None = None,
        tls: ReloadingTls | None = None,
        limits: Limits = Limits(),
    ) -> None:
        if tls_addr is not None and tls is None:
            raise InvalidInputError("a TLS port needs a certificate")
        self._front = front
        self._addr = addr
        self._tls_addr = tls_addr
        self._tls = tls
        self._limits = limits
        self._max_frame = front.max_message_size + FRAME_OVERHEAD
        self._servers: list[asyncio.Server] = []
        self._per_peer: collections.Counter[str] = collections.Counter()
        self._sweeper: asyncio.Task[None] | None = None
        self._last_rejection_log = 0.0
        self.ports: dict[str, int] = {}
        """The bound port of each listener ("plain", "tls"): a port 0 in the address is
        chosen by the system."""

    async def start(self) -> None:
        """Bind the ports; LbdError naming the address when one cannot be bound."""
        loop = asyncio.get_running_loop()
        for name, addr, context in (
            ("plain", self._addr, None),
            ("tls", self._tls_addr, self._tls.context if self._tls else None),
        ):
            if addr is None:
                continue
            try:
                server = await listen(
                    addr,
                    functools.partial(
                        loop.create_server,
                        functools.partial(self._connection, context is not None),
                        ssl=context,
                        reuse_address=True,
                    ),
                )
            except LbdError:
                await self.close()
                raise
            self._servers.append(server)
            self.ports[name] = server.sockets[0].getsockname()[1]
        self._sweeper = loop.create_task(self._sweep(), name="front-keepalive")

    async def close(self) -> None:
        """Stop listening and close every connection; idempotent."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        for server in self._servers:
            server.close()
        for connection in list(self._front.connections):
            connection.close("the broker is stopping")
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()

    def _connection(self, tls: bool) -> ClientConnection:
        return ClientConnection(self._front, tls=tls, max_frame_size=self._max_frame, gate=self)

    def admit(self, connection: ClientConnection) -> bool:
        """Count a new connection in, or refuse it (the limits of the module docstring)."""
        peer = connection.peer.rpartition(":")[0]
        front = self._front
        reason = None
        if len(front.connections) >= self._limits.max_connections:
            reason = "limit"
        elif self._per_peer[peer] >= self._limits.max_connections_per_peer:
            reason = "limit_per_peer"
        if reason is not None:
            front.metrics.rejected_connections.labels(reason).inc()
            now = time.monotonic()
            if now - self._last_rejection_log >= 1.0:
                self._last_rejection_log = now
                _log.warning(
                    "refusing connections from %s: %d open in all, %d from it (%s)",
                    peer,
                    len(front.connections),
                    self._per_peer[peer],
                    reason,
                )
            return False
        self._per_peer[peer] += 1
        front.connections.add(connection)
        front.metrics.connections.inc()
        front.metrics.open_connections.inc()
        return True

    def release(self, connection: ClientConnection) -> None:
        """A counted connection is gone."""
        peer = connection.peer.rpartition(":")[0]
        self._per_peer[peer] -= 1
        if self._per_peer[peer] <= 0:
            del self._per_peer[peer]
        self._front.metrics.open_connections.dec()

    async def _sweep(self) -> None:
        limits = self._limits
        # Also how often the TLS files are checked for a change.
        period = min(limits.handshake_timeout_s, limits.keepalive_interval_s) / 2
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for connection in list(self._front.connections):
                quiet = now - connection.last_heard
                if not connection.connected and now - connection.opened_at > (
                    limits.handshake_timeout_s
                ):
                    self._front.count_bad_frame("no handshake")
                    connection.close(f"no CONNECT within {limits.handshake_timeout_s:g} s")
                elif quiet > 2 * limits.keepalive_interval_s:
                    connection.close(f"silent for {quiet:.0f} s (keepalive)")
                elif quiet > limits.keepalive_interval_s and not connection.pinged:
                    connection.ping()
            if self._tls is not None:
                self._tls.check()
