"""In-process gRPC servers over the service harness: real grpc.aio servers on 127.0.0.1:0.

:func:`serve_api` puts the API server ``lbd serve`` builds (:func:`lbd.api.server.sidecar_api`) in
front of one harness sidecar and returns stubs connected to it. The sidecar's registration is
rewritten with the server's real address, so forwarding between sidecars of one harness goes over
real gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from opentelemetry.sdk.trace import TracerProvider

from lbd.api.auth import AuthConfig, Authenticator
from lbd.api.forwarding import Forwarder
from lbd.api.server import ApiServer, sidecar_api
from lbd.api.tls import ReloadingServerTls
from lbd.broker.credentials import INSECURE, ClientCredentials
from lbd.gen.v1 import lbd_pb2_grpc
from lbd.services.leader.election import LeaderElector
from tests.unit.services.harness import Harness, Sidecar

WAIT_S = 5.0


@dataclass
class Api:
    """One sidecar behind a real gRPC server, and a client of it."""

    sidecar: Sidecar
    server: ApiServer
    elector: LeaderElector
    channel: grpc.aio.Channel
    lb: lbd_pb2_grpc.LoadBalancerStub
    admin: lbd_pb2_grpc.AdminStub

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.server.port}"


ServeApi = Callable[..., contextlib.AbstractAsyncContextManager[Api]]


@contextlib.asynccontextmanager
async def serve_api(
    harness: Harness,
    sidecar: Sidecar,
    *,
    admin_token: str | None = None,
    auth: AuthConfig | None = None,
    tls: ReloadingServerTls | None = None,
    credentials: ClientCredentials = INSECURE,
    tracer_provider: TracerProvider | None = None,
) -> AsyncIterator[Api]:
    """``sidecar`` behind an ApiServer (SERVING), with stubs; all stopped on exit.

    ``admin_token`` is short for ``auth=AuthConfig(admin_token=...)``; ``credentials`` are the
    client's (and the forwarder's) TLS files and token."""
    if admin_token is not None:
        auth = AuthConfig(admin_token=admin_token)
    forwarder = Forwarder(sidecar.me, credentials=credentials)
    server = sidecar_api(
        sidecar.services,
        "127.0.0.1:0",
        forwarder,
        authenticator=None if auth is None else Authenticator(auth),
        tls=tls,
        tracer_provider=tracer_provider,
    )
    await server.start()
    await server.set_serving(True)
    info = sidecar.registry.get(sidecar.me)
    if info is not None:
        real = dataclasses.replace(info, sidecar_grpc_addr=f"127.0.0.1:{server.port}")
        await sidecar.registry.register(real)
    channel = credentials.aio_channel(f"127.0.0.1:{server.port}")
    try:
        yield Api(
            sidecar,
            server,
            sidecar.elector,
            channel,
            lbd_pb2_grpc.LoadBalancerStub(channel),
            lbd_pb2_grpc.AdminStub(channel),
        )
    finally:
        await channel.close()
        await server.stop(0)
        await forwarder.close()


async def until(condition: Callable[[], bool]) -> None:
    """Let the loop run until ``condition()`` holds (no clock time passes); bounded."""
    async with asyncio.timeout(WAIT_S):
        # The conditions are plain properties of services (no event to wait on), some of
        # them changed by gRPC I/O, which needs the loop to poll.
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.001)
