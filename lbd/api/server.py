"""The sidecar's gRPC server: LoadBalancer and Admin, server reflection, ``grpc.health.v1``.

Each call of lbd's services passes through layers, outermost first: tracing (the span sees the
final status; only when a tracer provider is given), authentication and authorization
(:mod:`lbd.api.auth`, when any credential is configured), the error mapping, then, closest to the
servicers, the forwarding of the methods that run on the leader
(:class:`~lbd.api.forwarding.LeaderForwarding`). The layers wrap each method's handler once, when
the servicers are registered (:class:`~lbd.api.handlers.WrappedRegistration`), not on every call
as grpc interceptors would.
Every service is registered as generic handlers only, never as registered methods
(:class:`~lbd.api.handlers.GenericRegistration` says why).
The port is TLS when the sidecar has a certificate (:mod:`lbd.api.tls`). Health is NOT_SERVING
until the app says the sidecar can answer (follower caught up, registry started) and again while
it is fenced; the overall status ("") and each lbd service's share the same value.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from opentelemetry.trace import TracerProvider

from lbd.api.admin import AdminDeps, AdminServicer
from lbd.api.auth import Authenticator, AuthInterceptor
from lbd.api.errors import ErrorInterceptor
from lbd.api.forwarding import Forwarder, LeaderForwarding, leader_methods
from lbd.api.handlers import GenericRegistration, WrappedRegistration, WrappingInterceptor
from lbd.api.loadbalancer import LoadBalancerServicer
from lbd.api.tls import ReloadingServerTls
from lbd.api.tracing import TracingInterceptor
from lbd.core.errors import InvalidInputError
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from lbd.metrics import Metrics
from lbd.services.graph import Sidecar
from lbd.services.sidecar.fencing import Fence

_log = logging.getLogger(__name__)

MAX_RECEIVE_BYTES = 64 * 1024 * 1024
"""Largest message a caller may send. gRPC's default, 4 MiB, is less than the load report of a
broker serving about ten thousand bundles (per-bundle stats and top topics): over it the broker's
session broke at every report, and its acknowledgements with it."""

SERVICE_NAMES = tuple(
    lbd_pb2.DESCRIPTOR.services_by_name[name].full_name for name in ("LoadBalancer", "Admin")
)
"""Fully qualified names of lbd's services (``lbd.v1.LoadBalancer``, ``lbd.v1.Admin``)."""
ADMIN_SERVICE = SERVICE_NAMES[1]


def sidecar_api(
    sidecar: Sidecar,
    addr: str,
    forwarder: Forwarder,
    *,
    authenticator: Authenticator | None = None,
    tls: ReloadingServerTls | None = None,
    tracer_provider: TracerProvider | None = None,
) -> ApiServer:
    """The gRPC server of ``sidecar`` on ``addr`` (not started): its services wired to it."""
    admin = AdminServicer(
        AdminDeps(
            me=sidecar.me,
            registry=sidecar.registry,
            namespaces=sidecar.namespaces,
            follower=sidecar.follower,
            operations=sidecar.operations,
            lookup=sidecar.lookup,
            elector=sidecar.elector,
            unload_scheduler=sidecar.unload_scheduler,
            loads=sidecar.loads,
            forwarder=forwarder,
            tracker=sidecar.tracker,
            decisions=sidecar.decisions,
            maintenance=sidecar.maintenance,
            drainer=sidecar.drainer,
            auditor=sidecar.auditor,
        )
    )
    to_leader = LeaderForwarding(
        leader_methods(admin, ADMIN_SERVICE),
        me=sidecar.me,
        elector=sidecar.elector,
        registry=sidecar.registry,
        forwarder=forwarder,
    )
    return ApiServer(
        addr,
        loadbalancer=LoadBalancerServicer(
            lookup=sidecar.lookup,
            follower=sidecar.follower,
            link=sidecar.link,
            authenticator=authenticator,
        ),
        admin=admin,
        forwarding=to_leader,
        metrics=sidecar.metrics,
        authenticator=authenticator,
        tls=tls,
        tracer_provider=tracer_provider,
    )


class ApiServer:
    """The gRPC server of one sidecar; :meth:`start` binds, :meth:`stop` drains with a grace."""

    def __init__(
        self,
        addr: str,
        *,
        loadbalancer: LoadBalancerServicer,
        admin: AdminServicer,
        metrics: Metrics,
        authenticator: Authenticator | None = None,
        tls: ReloadingServerTls | None = None,
        tracer_provider: TracerProvider | None = None,
        forwarding: LeaderForwarding | None = None,
    ) -> None:
        """``forwarding`` is the innermost layer (the methods that run on the leader); without
        ``authenticator`` every caller may call everything (a loopback sidecar with
        no credentials configured); without ``tls`` the port is plaintext; without
        ``tracer_provider`` no span is made (tracing is off)."""
        self._addr = addr
        self._tls = tls
        layers: list[WrappingInterceptor] = []
        if tracer_provider is not None:
            layers.append(TracingInterceptor(tracer_provider))
        if authenticator is not None:
            layers.append(AuthInterceptor(authenticator))
        self._errors = ErrorInterceptor(metrics)
        layers.append(self._errors)
        if forwarding is not None:
            layers.append(forwarding)
        self._server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)]
        )
        registration = WrappedRegistration(self._server, layers)
        lbd_pb2_grpc.add_LoadBalancerServicer_to_server(loadbalancer, registration)
        lbd_pb2_grpc.add_AdminServicer_to_server(admin, registration)
        generic = GenericRegistration(self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, generic)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer(
                (
                    *SERVICE_NAMES,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                )
            ),
            generic,
        )
        self._port: int | None = None
        self._serving: bool | None = None
        self._stopped = False

    @property
    def port(self) -> int:
        """The bound port (useful with port 0); only after :meth:`start`."""
        if self._port is None:
            raise RuntimeError("the gRPC server is not started")
        return self._port

    async def start(self) -> None:
        """Bind the address and start serving, NOT_SERVING until :meth:`set_serving`."""
        await self.set_serving(False)
        try:
            if self._tls is None:
                port = self._server.add_insecure_port(self._addr)
            else:
                port = self._server.add_secure_port(self._addr, self._tls.credentials())
        except RuntimeError as e:
            raise InvalidInputError(f"grpc.addr {self._addr}: cannot listen there: {e}") from e
        if port == 0:
            raise InvalidInputError(f"grpc.addr {self._addr}: cannot listen there")
        await self._server.start()
        self._port = port
        _log.info(
            "gRPC server listening on %s (port %d, %s)",
            self._addr,
            port,
            "plaintext" if self._tls is None else "TLS",
        )

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING on the health service; logs each change once."""
        if serving == self._serving:
            return
        self._serving = serving
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", *SERVICE_NAMES):
            await self._health.set(service, status)
        if self._port is not None:
            _log.info("health: %s", "SERVING" if serving else "NOT_SERVING")

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls, give running ones ``grace_s`` seconds, then cancel them.

        Idempotent; health watchers are told NOT_SERVING first so that clients move away.
        """
        if self._stopped:
            return
        self._stopped = True
        self._errors.stopping()
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
        _log.info("gRPC server stopped")


async def track_fence(server: ApiServer, fence: Fence) -> None:
    """Keep the server's health SERVING unless the sidecar is fenced; runs until cancelled."""
    states = fence.states()  # subscribed before the first read: no change is missed
    await server.set_serving(not fence.fenced)
    async for fenced in states:
        await server.set_serving(not fenced)
