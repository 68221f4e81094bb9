"""The lookup benchmark's baseline: a grpc.aio server answering ``Lookup`` from a dict.

``python -m bench.trivial_server --port-file F --responses R`` serves ``lbd.v1.LoadBalancer/Lookup``
on a free loopback port (written to ``F`` once it listens) with the very LookupResponse bytes an
lbd sidecar gave for each topic (``R``: the length-prefixed request topics and response bytes
:func:`write_responses` wrote). It decodes each request with the same generated message class
and runs on the same event loop (uvloop) as the sidecar: what lbd adds on top of it is lbd's own
cost, not gRPC's or Python's.
"""

from __future__ import annotations

import argparse
import struct
from pathlib import Path
from typing import Any

import grpc
import uvloop

from lbd.gen.v1 import lbd_pb2

METHOD = "Lookup"
SERVICE = "lbd.v1.LoadBalancer"
_LENGTH = struct.Struct(">I")


def write_responses(path: Path, responses: dict[str, bytes]) -> None:
    """Store topic -> serialized LookupResponse for the server to load."""
    with path.open("wb") as out:
        for topic, response in responses.items():
            raw = topic.encode()
            out.write(_LENGTH.pack(len(raw)) + raw + _LENGTH.pack(len(response)) + response)


def read_responses(path: Path) -> dict[str, bytes]:
    """What :func:`write_responses` stored."""
    data = path.read_bytes()
    out: dict[str, bytes] = {}
    at = 0
    while at < len(data):
        fields = []
        for _ in range(2):
            (n,) = _LENGTH.unpack_from(data, at)
            fields.append(data[at + 4 : at + 4 + n])
            at += 4 + n
        out[fields[0].decode()] = fields[1]
    return out


async def serve(port_file: Path, responses: dict[str, bytes]) -> None:
    """Serve until cancelled; the bound port goes to ``port_file``."""

    async def lookup(request: lbd_pb2.LookupRequest, context: Any) -> bytes:
        try:
            return responses[request.topic]
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, request.topic)
            raise

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            METHOD: grpc.unary_unary_rpc_method_handler(
                lookup,
                request_deserializer=lbd_pb2.LookupRequest.FromString,
                response_serializer=lambda raw: raw,
            )
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(port))
    tmp.rename(port_file)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.trivial_server", description=__doc__)
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--responses", type=Path, required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.port_file, read_responses(args.responses)))


if __name__ == "__main__":
    main()
