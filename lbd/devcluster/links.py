"""The links of a dev cluster, each behind a TCP proxy that can cut, slow or stall it.

With ``lbd dev up --links`` every connection one process of the cluster opens to another goes
through a proxy of its own: each sidecar's to etcd (``broker-N/etcd``) and to the channel's
pulsar-lite (``broker-N/channel``, which carries the load topics too), each broker front's to
its sidecar (``broker-N/sidecar``) and to the storage pulsar-lite (``broker-N/storage``). One
process, ``python -m lbd.devcluster.links``, runs every proxy; a control port on loopback sets
each link's mode (:func:`set_links`, ``lbd dev link``):

- ``up``: bytes pass as they come;
- ``cut``: nothing passes either way, on open connections and on new ones, and nothing is
  closed: as a network partition drops packets, neither side is told, each learns from its own
  timeouts. What a sender writes meanwhile is held and delivered when the link returns, as its
  kernel would retransmit it, unless the sender resets the connection first (an abort, a process
  killed): then it is dropped, as the sender's kernel drops unacknowledged data on a reset;
- ``slow``: every chunk waits ``delay_s`` before it passes (latency, and throughput capped);
- ``flaky``: the link passes for ``period_s``, then stalls for ``period_s``, and so on: the
  reads of a lossy link, whose lost segments stall the stream until they are sent again.

A Pulsar client follows a topic lookup to the broker's own address, which would take its producers
and readers around the proxy it looked the topic up through: a link to a Pulsar server
(``pulsar``) rewrites the server's lookup answers to ``proxy_through_service_url``, as a Pulsar
proxy sets it, so the client opens its topic connections through the link too (plaintext only: a
TLS stream passes unread).

Why proxies rather than network namespaces with veth pairs: a proxy needs no privilege (CI
machines and containers often lack ``CAP_NET_ADMIN``), cuts exactly one process's link to one
server while the others keep theirs, and leaves every address on loopback. What it cannot do is
drop single segments inside the kernel's TCP: ``flaky`` stalls the stream instead, which is what
the processes above TCP see of a lossy link.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from google.protobuf.message import DecodeError

from lbd.core.errors import InvalidInputError, LbdError
from lbd.devcluster.ports import LOOPBACK
from lbd.front import wire

Mode = Literal["up", "cut", "slow", "flaky"]
MODES: tuple[Mode, ...] = ("up", "cut", "slow", "flaky")
CHUNK = 65536
RESET_POLL_S = 0.1
_U32 = struct.Struct(">I")
HOLD = 4 * 1024 * 1024
"""The most a link holds per direction of a connection while it is down (a TCP window's worth:
past it, the sender blocks)."""
CONTROL_TIMEOUT_S = 5.0

_log = logging.getLogger("lbd.devcluster.links")


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One link: where its proxy listens and what it forwards to."""

    name: str
    listen_port: int
    target: str
    """host:port of the server."""
    pulsar: bool = False
    """The server speaks Pulsar's protocol: its lookup answers send clients through the link
    (:class:`LookupsThroughLink`)."""

    @property
    def addr(self) -> str:
        """What the client process connects to instead of the server."""
        return f"{LOOPBACK}:{self.listen_port}"

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "listen_port": self.listen_port,
            "target": self.target,
            "pulsar": self.pulsar,
        }


def proxied_url(url: str, link: LinkSpec) -> str:
    """``url`` (``scheme://host:port``) with its address replaced by the link's."""
    scheme, sep, _ = url.partition("://")
    return f"{scheme}{sep}{link.addr}" if sep else link.addr


class LookupsThroughLink:
    """Rewrites a Pulsar server's byte stream so that its lookup answers tell the client to
    connect through the service URL it looked up through (``proxy_through_service_url``): the
    link. Every other frame passes as it came; a frame not whole yet waits for its rest."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> bytes:
        """The whole frames ``data`` completes, lookup answers rewritten."""
        buffer = self._buffer
        buffer += data
        out: list[bytes] = []
        start = 0
        while len(buffer) - start >= 4:
            (total,) = _U32.unpack_from(buffer, start)
            if len(buffer) - start - 4 < total:
                break
            out.append(self._through_link(bytes(buffer[start : start + 4 + total])))
            start += 4 + total
        del buffer[:start]
        return b"".join(out)

    def rest(self) -> bytes:
        """What is left of a frame cut off by the end of the stream."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        return rest

    def _through_link(self, frame: bytes) -> bytes:
        if len(frame) < 8:
            return frame
        (size,) = _U32.unpack_from(frame, 4)
        try:
            command = wire.Command.FromString(frame[8 : 8 + size])
        except DecodeError:
            return frame  # not ours to judge: the client will
        if command.type != wire.Type.LOOKUP_RESPONSE:
            return frame
        answer = command.lookupTopicResponse
        if answer.proxy_through_service_url or answer.response == answer.Failed:
            return frame
        answer.proxy_through_service_url = True
        rest = frame[8 + size :]
        return wire.encode(command, rest or None)


class _Link:
    """A link's mode and open connections, inside the proxy process."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self.mode: Mode = "up"
        self.delay_s = 0.0
        self.period_s = 1.0
        self.connections = 0
        self.bytes = 0
        self.dropped = 0
        self._since = 0.0
        self._changed = asyncio.Event()

    def set(self, mode: Mode, delay_s: float, period_s: float) -> None:
        self.mode, self.delay_s, self.period_s = mode, delay_s, period_s
        self._since = asyncio.get_running_loop().time()
        self._changed.set()
        self._changed = asyncio.Event()

    async def gate(self) -> None:
        """Return when a chunk may pass (at once while the link is up)."""
        loop = asyncio.get_running_loop()
        while True:
            if self.mode == "up":
                return
            if self.mode == "slow":
                await asyncio.sleep(self.delay_s)
                return
            wait: float | None = None
            if self.mode == "flaky":
                phase = (loop.time() - self._since) % (2 * self.period_s)
                if phase < self.period_s:
                    return
                wait = 2 * self.period_s - phase
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await changed.wait()

    def status(self) -> dict[str, object]:
        out: dict[str, object] = {
            "mode": self.mode,
            "target": self.spec.target,
            "listen": self.spec.addr,
            "connections": self.connections,
            "bytes": self.bytes,
            "dropped": self.dropped,
        }
        if self.mode == "slow":
            out["delay_s"] = self.delay_s
        if self.mode == "flaky":
            out["period_s"] = self.period_s
        return out

    async def serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.gate()  # a connection made while cut reaches the server once it returns
            host, _, port = self.spec.target.rpartition(":")
            try:
                server_r, server_w = await asyncio.open_connection(host, int(port))
            except OSError:
                return  # the server is down: the client sees its connection closed
            try:
                lookups = LookupsThroughLink() if self.spec.pulsar else None
                pumps = [
                    asyncio.ensure_future(self._pump(client_r, client_w, server_w)),
                    asyncio.ensure_future(self._pump(server_r, server_w, client_w, lookups)),
                ]
                # Either side closing ends the connection (the protocols here do not half-close).
                _, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            finally:
                server_w.close()
        finally:
            self.connections -= 1
            client_w.close()

    async def _pump(
        self,
        src: asyncio.StreamReader,
        src_w: asyncio.StreamWriter,
        dst: asyncio.StreamWriter,
        lookups: LookupsThroughLink | None = None,
    ) -> None:
        eof = False
        with contextlib.suppress(OSError):
            while not eof and (data := await src.read(CHUNK)):
                if self.mode != "up":
                    held = await self._hold(src, src_w, data)
                    if held is None:
                        # The sender reset its end while the link was down: what it had sent
                        # since is gone, as its kernel drops unacknowledged data on a reset. The
                        # server learns of it once the link returns.
                        await self.gate()
                        _abort(dst)
                        return
                    data, eof = held
                if lookups is not None:
                    data = lookups.feed(data) + (lookups.rest() if eof else b"")
                dst.write(data)
                await dst.drain()
                self.bytes += len(data)

    async def _hold(
        self, src: asyncio.StreamReader, src_w: asyncio.StreamWriter, data: bytes
    ) -> tuple[bytes, bool] | None:
        """Hold ``data`` until a chunk may pass, reading on meanwhile (up to :data:`HOLD`
        bytes): the data and whether the sender closed its end since, or None when the sender
        reset it."""
        gate = asyncio.ensure_future(self.gate())
        eof = False
        try:
            while not gate.done():
                if eof or len(data) >= HOLD:
                    # A reset after the sender's close drops what it had sent, the close too.
                    await asyncio.wait([gate], timeout=RESET_POLL_S)
                    if _was_reset(src, src_w):
                        self.dropped += len(data)
                        return None
                    continue
                more = asyncio.ensure_future(src.read(CHUNK))
                await asyncio.wait([gate, more], return_when=asyncio.FIRST_COMPLETED)
                if not more.done():
                    more.cancel()  # a read cancelled while it waits takes nothing
                    await asyncio.gather(more, return_exceptions=True)
                    break
                try:
                    chunk = more.result()
                except ConnectionResetError:
                    self.dropped += len(data)
                    return None
                data += chunk
                eof = not chunk
        finally:
            gate.cancel()
        return data, eof


def _was_reset(src: asyncio.StreamReader, src_w: asyncio.StreamWriter) -> bool:
    """Whether the sender reset the connection (once it closed its end, only the socket's
    pending error says so)."""
    if isinstance(src.exception(), ConnectionResetError):
        return True
    sock = src_w.get_extra_info("socket")
    try:
        return sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
    except OSError:
        return True


def _abort(writer: asyncio.StreamWriter) -> None:
    transport = writer.transport
    if hasattr(transport, "abort"):
        transport.abort()
    else:
        writer.close()


class _Proxies:
    def __init__(self, specs: Iterable[LinkSpec]) -> None:
        self.links = {s.name: _Link(s) for s in specs}

    async def run(self, control_port: int) -> None:
        servers = []  # held for as long as the proxies run
        for link in self.links.values():
            servers.append(await asyncio.start_server(link.serve, LOOPBACK, link.spec.listen_port))
        control = await asyncio.start_server(self._control, LOOPBACK, control_port)
        _log.info("%d links, control at %s:%d", len(self.links), LOOPBACK, control_port)
        async with control:
            await control.serve_forever()

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    answer = self._handle(json.loads(line))
                except (InvalidInputError, ValueError, TypeError) as e:
                    answer = {"ok": False, "error": str(e)}
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    def _handle(self, request: dict[str, object]) -> dict[str, object]:
        if request.get("op") == "set":
            names = request.get("links")
            if not isinstance(names, list) or not names:
                raise InvalidInputError("'links' must name at least one link")
            unknown = [n for n in names if n not in self.links]
            if unknown:
                raise InvalidInputError(
                    f"no link {', '.join(map(str, unknown))} (links: {', '.join(self.links)})"
                )
            mode, delay_s, period_s = _checked_mode(
                request.get("mode"), request.get("delay_s", 0.0), request.get("period_s", 1.0)
            )
            for name in names:
                self.links[str(name)].set(mode, delay_s, period_s)
                _log.info("link %s: %s", name, mode)
        elif request.get("op") != "status":
            raise InvalidInputError(f"unknown op {request.get('op')!r} (set, status)")
        return {"ok": True, "links": {n: link.status() for n, link in self.links.items()}}


def _checked_mode(mode: object, delay_s: object, period_s: object) -> tuple[Mode, float, float]:
    if mode not in MODES:
        raise InvalidInputError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    delay, period = float(delay_s), float(period_s)  # type: ignore[arg-type]
    if mode == "slow" and not 0 < delay <= 60:
        raise InvalidInputError(f"a slow link needs a delay in (0, 60] s, got {delay:g}")
    if mode == "flaky" and not 0 < period <= 60:
        raise InvalidInputError(f"a flaky link needs a period in (0, 60] s, got {period:g}")
    return mode, delay, period


# -- the client side: the supervisor, the harness, ``lbd dev link`` ----------------------------


def control(addr: str, request: dict[str, object]) -> dict[str, dict[str, object]]:
    """Send one request to the links process at ``addr``; the links' status after it.

    Raises InvalidInputError for a request it refuses, LbdError when it cannot be reached."""
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=CONTROL_TIMEOUT_S) as sock:
            sock.sendall(json.dumps(request).encode() + b"\n")
            answer = json.loads(sock.makefile("rb").readline() or b"null")
    except (OSError, ValueError) as e:
        raise LbdError(f"the links of the dev cluster do not answer at {addr}: {e}") from None
    if not isinstance(answer, dict):
        raise LbdError(f"the links process at {addr} closed the connection")
    if not answer.get("ok"):
        raise InvalidInputError(str(answer.get("error")))
    links = answer["links"]
    assert isinstance(links, dict)
    return links


def set_links(
    addr: str,
    names: Iterable[str],
    mode: Mode,
    *,
    delay_s: float = 0.0,
    period_s: float = 1.0,
) -> dict[str, dict[str, object]]:
    """Put the named links in ``mode`` (see the module docstring); the links' status after."""
    request = {
        "op": "set",
        "links": list(names),
        "mode": mode,
        "delay_s": delay_s,
        "period_s": period_s,
    }
    return control(addr, request)


def link_status(addr: str) -> dict[str, dict[str, object]]:
    """Every link's mode, target, open connections and bytes passed."""
    return control(addr, {"op": "status"})


def write_specs(path: Path, specs: Iterable[LinkSpec]) -> None:
    path.write_text(json.dumps([s.to_json() for s in specs], indent=2) + "\n", encoding="utf-8")


def read_specs(path: Path) -> list[LinkSpec]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return [
        LinkSpec(str(d["name"]), int(d["listen_port"]), str(d["target"]), bool(d.get("pulsar")))
        for d in data
    ]


def main(argv: list[str] | None = None) -> int:
    """``python -m lbd.devcluster.links --specs FILE --control-port P``: run every proxy."""
    parser = argparse.ArgumentParser(prog="python -m lbd.devcluster.links")
    parser.add_argument("--specs", type=Path, required=True)
    parser.add_argument("--control-port", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from lbd.tasks import run_event_loop

    run_event_loop(_Proxies(read_specs(args.specs)).run(args.control_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
