"""The composition root: ``lbd serve``. Adapters, servers and signals; nothing else.

It builds the real adapters (etcd, Pulsar) from Settings, hands them to the one wiring function
(:func:`lbd.services.graph.build_sidecar`, which the tests and the simulator call too), starts the
sidecar, then serves gRPC (health SERVING, NOT_SERVING again while fenced) and ``/metrics``.

SIGTERM or SIGINT stops it within a bounded time: gRPC drains for ``grpc.shutdown_grace_s``, the
sidecar's parts close in reverse order (the broker is deregistered, the lease revoked), and the
connections close. A vital task's death stops it the same way, loudly, with exit code 1; the end
of the metadata session under ``etcd.session_expired_policy = shutdown`` with exit code 3.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import start_http_server

from lbd.adapters.clock import SystemClock
from lbd.adapters.etcd import EtcdConnection, EtcdOptions
from lbd.adapters.etcd_checkpoint import EtcdCheckpointStore
from lbd.adapters.etcd_store import EtcdMetadataStore
from lbd.adapters.pulsar_channel import PulsarChannelLog
from lbd.adapters.pulsar_client import PulsarConnection
from lbd.adapters.pulsar_load import PulsarLoadStore
from lbd.api.auth import AuthConfig, Authenticator, Role
from lbd.api.forwarding import Forwarder
from lbd.api.server import sidecar_api, track_fence
from lbd.api.tls import ReloadingServerTls, ServerTlsFiles
from lbd.api.tracing import console_requested, install_tracing
from lbd.broker.credentials import INSECURE, ClientCredentials
from lbd.config import Settings
from lbd.config.invariants import authenticates
from lbd.core.broker_info import BrokerInfo
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId
from lbd.metrics import Metrics
from lbd.ports.clock import Clock
from lbd.ports.history import HistoryRecorder
from lbd.services.graph import SidecarPorts, build_sidecar
from lbd.tasks import Tasks, cancel_and_wait, run_event_loop, tasks_outliving, yield_now

_log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_DIED = 1
"""A vital task died."""
EXIT_SESSION_EXPIRED = 3
"""The metadata session ended for good (``etcd.session_expired_policy = shutdown``)."""

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True, slots=True)
class Death:
    """Why the daemon stops on its own: what ended, how, and the exit code it means."""

    name: str
    error: BaseException
    exit_code: int = EXIT_DIED


def serve(settings: Settings) -> int:
    """Run the sidecar until SIGTERM/SIGINT (exit 0), a vital part's death (exit 1) or the end of
    its metadata session under the ``shutdown`` policy (exit 3)."""
    daemon = Daemon(settings, broker_id_of(settings), advertised_addr(settings))
    return run_event_loop(daemon.run())


def broker_id_of(settings: Settings) -> BrokerId:
    """This sidecar's broker id; InvalidInputError when it is not configured."""
    if settings.broker.broker_id is None:
        raise InvalidInputError(
            "broker.broker_id is not set: pass --broker-id ID (or set it in the config file, "
            "or LBD_BROKER__BROKER_ID)"
        )
    return BrokerId(settings.broker.broker_id)


def advertised_addr(settings: Settings) -> str:
    """The address other sidecars and ``lbd ctl`` reach this one at (stored in the registry)."""
    addr = settings.grpc.advertised_addr or settings.grpc.addr
    host, _, port = addr.rpartition(":")
    if port == "0":
        raise InvalidInputError(
            f"grpc.addr {settings.grpc.addr} has port 0: other sidecars could not reach this "
            "one; give a port, or set grpc.advertised_addr"
        )
    if host in ("0.0.0.0", "[::]", "") and not settings.grpc.advertised_addr:
        raise InvalidInputError(
            f"grpc.addr {settings.grpc.addr} binds every interface: set grpc.advertised_addr "
            "to the address other sidecars should use"
        )
    return addr


def authenticator(s: Settings) -> Authenticator | None:
    """Who may call what, from ``[auth]`` and ``grpc.admin_token``; None lets everyone do
    everything (no credential is configured and anonymous callers are admins)."""
    anonymous = s.auth.anonymous_role
    if anonymous == "auto":
        anonymous = "none" if authenticates(s) else "admin"
    config = AuthConfig(
        admin_token=None if s.grpc.admin_token is None else s.grpc.admin_token.get_secret_value(),
        tokens_file=None if s.auth.tokens_file is None else Path(s.auth.tokens_file),
        token_key_file=None if s.auth.token_key_file is None else Path(s.auth.token_key_file),
        cert_roles=(
            {o: Role.parse(r, "auth.cert_roles") for o, r in s.auth.role_map().items()}
            if s.grpc.mutual_tls
            else None
        ),
        anonymous_role=None if anonymous == "none" else Role.parse(anonymous, "auth"),
    )
    return None if config.open else Authenticator(config)


def server_tls(s: Settings) -> ReloadingServerTls | None:
    """The server's TLS from ``[grpc]``, or None for a plaintext port."""
    g = s.grpc
    if g.tls_cert_file is None or g.tls_key_file is None:
        return None
    return ReloadingServerTls(
        ServerTlsFiles(
            Path(g.tls_cert_file),
            Path(g.tls_key_file),
            Path(g.tls_ca_file) if g.mutual_tls and g.tls_ca_file is not None else None,
        )
    )


def sidecar_client_credentials(s: Settings) -> ClientCredentials:
    """How this sidecar connects to other sidecars: their CA, its own certificate."""
    g = s.grpc
    if g.tls_cert_file is None:
        return INSECURE
    mutual = g.mutual_tls and g.tls_key_file is not None
    return ClientCredentials(
        ca_file=None if g.tls_ca_file is None else Path(g.tls_ca_file),
        system_roots=g.tls_ca_file is None,
        cert_file=Path(g.tls_cert_file) if mutual else None,
        key_file=Path(g.tls_key_file) if mutual and g.tls_key_file is not None else None,
    )


class Daemon:
    """One ``lbd serve``: adapters, the sidecar, the servers; started in order, stopped in
    reverse."""

    def __init__(
        self, settings: Settings, me: BrokerId, advertised: str, *, clock: Clock | None = None
    ) -> None:
        self._settings = settings
        self._me = me
        self._advertised_addr = advertised
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._stop = asyncio.Event()
        self._death: Death | None = None

    def request_stop(self) -> None:
        """Stop at the next opportunity (what SIGTERM does)."""
        if not self._stop.is_set():
            _log.info("stop requested")
        self._stop.set()

    def _on_death(self, name: str, error: BaseException) -> None:
        if self._death is None:
            self._death = Death(name, error)
            _log.critical(
                "vital task %s died (%s: %s); stopping", name, type(error).__name__, error
            )
        self._stop.set()

    def _on_session_expired(self, error: BaseException) -> None:
        if self._death is None:
            self._death = Death("metadata-session", error, EXIT_SESSION_EXPIRED)
            _log.critical("metadata session over: %s", error)
        self._stop.set()

    async def run(self) -> int:
        """Start everything, serve until asked to stop or a vital part dies, stop; exit code."""
        loop = asyncio.get_running_loop()
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, self.request_stop)
        try:
            async with contextlib.AsyncExitStack() as stack:
                started = await self._until_stopped(self._start(stack))
                if started:
                    _log.info("lbd sidecar of broker %s is serving", self._me)
                    await self._stop.wait()
                _log.info("stopping")
                await self._teardown(stack)
            await self._report_tasks_left()
        finally:
            for sig in _STOP_SIGNALS:
                loop.remove_signal_handler(sig)
        if self._death is not None:
            _log.critical(
                "stopped because %s ended (exit %d)", self._death.name, self._death.exit_code
            )
            return self._death.exit_code
        _log.info("stopped")
        return EXIT_OK

    async def _until_stopped(self, start: Awaitable[None]) -> bool:
        """Run the start-up unless a stop comes first; whether it completed."""
        starting = asyncio.ensure_future(start)
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if starting.done():
            starting.result()  # start-up errors propagate: the CLI reports them
            return not self._stop.is_set()
        await cancel_and_wait(starting)
        return False

    async def _start_history(
        self, stack: contextlib.AsyncExitStack, me: BrokerId
    ) -> HistoryRecorder | None:
        """The Parquet history sink when ``[history] enabled``; its flush thread stops last."""
        settings = self._settings.history
        if not settings.enabled:
            return None
        # Imported here: pyarrow comes with the optional `analytics` extra.
        from lbd.history import HistorySink

        sink = HistorySink.from_settings(settings, cluster=self._settings.cluster.name, recorder=me)
        sink.start()
        stack.push_async_callback(asyncio.to_thread, sink.close)
        return sink

    async def _teardown(self, stack: contextlib.AsyncExitStack) -> None:
        # gRPC gets its grace inside this budget; every other close is a few requests at most.
        budget = self._settings.grpc.shutdown_grace_s + 2 * self._settings.etcd.request_timeout_s
        try:
            async with asyncio.timeout(budget):
                await stack.aclose()
        except TimeoutError:
            _log.error("stopping took longer than %.1fs; exiting anyway", budget)
            if self._death is None:
                self._death = Death("shutdown", TimeoutError("teardown over budget"))

    @staticmethod
    async def _report_tasks_left() -> None:
        """Every part is closed now: a task still running outlived its component (a bug, as the
        simulated world's check says; it would run on, unseen, in a process embedding the
        daemon)."""
        for _ in range(3):  # a task cancelled in the very last close ends within a few turns
            await yield_now()
        for name in tasks_outliving():
            _log.error("task %s outlived its component", name)

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        s = self._settings
        me, clock = self._me, self._clock

        # -- observability -------------------------------------------------------------------
        metrics = Metrics()
        provider = install_tracing(broker_id=me, console=console_requested(os.environ))
        if provider is not None:
            stack.callback(provider.shutdown)
        if s.metrics.addr is not None:
            host, _, port = s.metrics.addr.rpartition(":")
            try:
                httpd, _thread = start_http_server(int(port), host.strip("[]"), metrics.registry)
            except OSError as e:
                raise InvalidInputError(f"metrics.addr {s.metrics.addr}: {e.strerror}") from e
            stack.callback(httpd.server_close)
            stack.callback(httpd.shutdown)
            _log.info("metrics on http://%s/metrics", s.metrics.addr)
        history = await self._start_history(stack, me)

        # -- outside systems -----------------------------------------------------------------
        options = EtcdOptions.from_settings(s)
        etcd = EtcdConnection.from_options(options)
        stack.push_async_callback(etcd.close)
        pulsar = PulsarConnection.from_settings(s.pulsar)
        stack.push_async_callback(pulsar.close)
        ports = SidecarPorts(
            metadata=EtcdMetadataStore(etcd, options, clock),
            channel=PulsarChannelLog(
                pulsar, s.pulsar.state_channel_topic, send_timeout_s=s.pulsar.publish_timeout_s
            ),
            broker_loads=PulsarLoadStore(pulsar, s.pulsar.broker_load_topic, clock),
            top_bundles=PulsarLoadStore(pulsar, s.pulsar.top_bundles_topic, clock),
            checkpoints=EtcdCheckpointStore(etcd, options.prefix),
        )

        # -- the sidecar ---------------------------------------------------------------------
        info = BrokerInfo(
            broker_id=me,
            service_url=s.broker.advertised_service_url or "",
            web_service_url=s.broker.advertised_web_url or "",
            start_time_ms=clock.now_ms(),
            sidecar_grpc_addr=self._advertised_addr,
        )
        sidecar = build_sidecar(
            info,
            ports,
            s.sidecar_config(),
            clock,
            random.Random(),
            metrics=metrics,
            history=history,
            on_death=self._on_death,
            on_session_expired=self._on_session_expired,
        )
        await sidecar.start()
        stack.push_async_callback(sidecar.close)

        # -- the API -----------------------------------------------------------------------------
        forwarder = Forwarder(me, credentials=sidecar_client_credentials(s))
        stack.push_async_callback(forwarder.close)
        server = sidecar_api(
            sidecar,
            s.grpc.addr,
            forwarder,
            authenticator=authenticator(s),
            tls=server_tls(s),
            tracer_provider=provider,
        )
        await server.start()
        stack.push_async_callback(server.stop, s.grpc.shutdown_grace_s)
        tasks = Tasks(f"the daemon of {me}")
        tasks.spawn(track_fence(server, sidecar.fence), name="health", on_death=self._on_death)
        stack.push_async_callback(tasks.close)
