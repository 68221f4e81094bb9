"""The composition root of ``lbd broker``: settings in, a serving broker front out.

It builds the front's parts from ``[front]`` and ``[broker]`` (the broker id), checks that the
sidecar answers before it opens its ports (a one-line error otherwise, as for a port in use),
starts the ownership cache, the session with the sidecar and the listeners, and serves until
SIGTERM or SIGINT. Then it leaves gracefully: it asks its sidecar to hand every bundle to other
brokers (its clients follow them there, as in a transfer) and waits, at most
``front.leave_timeout_s``, until it owns nothing; only then does it close its ports and its
session. A second signal stops it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from lbd import __version__
from lbd.api.tls import ServerTlsFiles
from lbd.broker import BrokerClient, LookupBatcher, OwnershipCache
from lbd.broker.credentials import ClientCredentials
from lbd.broker.events import EventLog
from lbd.config import Settings
from lbd.core.errors import InvalidInputError, LbdError
from lbd.core.ids import BrokerId
from lbd.front.handles import Redirect
from lbd.front.http import HttpServer
from lbd.front.metrics import FrontMetrics
from lbd.front.rest import BrokerView, RestApi, WebUrls
from lbd.front.server import FrontServer, Limits, ReloadingTls
from lbd.front.service import Front
from lbd.front.storage import StorageAddress, StoragePool
from lbd.front.usage import UsageSampler
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from lbd.tasks import run_event_loop

_log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_DIED = 1
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def run_broker(settings: Settings) -> int:
    """Serve until stopped (exit 0) or until the session with the sidecar fails for good
    (exit 1); LbdError for what stops it from starting."""
    return run_event_loop(BrokerFront(settings).run())


def sidecar_of(settings: Settings) -> str:
    """The sidecar's gRPC address: ``front.sidecar_addr``, else the sidecar's own address."""
    return settings.front.sidecar_addr or settings.grpc.advertised_addr or settings.grpc.addr


def advertised_urls(settings: Settings) -> Redirect:
    """The URLs clients are given for this broker."""
    f = settings.front
    return Redirect(
        _advertised("pulsar", f.addr, f.advertised_url, "addr", "advertised_url"),
        _advertised(
            "pulsar+ssl", f.tls_addr, f.advertised_url_tls, "tls_addr", "advertised_url_tls"
        ),
    )


def advertised_web(settings: Settings) -> WebUrls:
    """The URLs of this broker's web service handed out in lookups."""
    f = settings.front
    return WebUrls(
        _advertised("http", f.web_addr, f.advertised_web_url, "web_addr", "advertised_web_url"),
        _advertised(
            "https",
            f.web_tls_addr,
            f.advertised_web_url_tls,
            "web_tls_addr",
            "advertised_web_url_tls",
        ),
    )


def _advertised(
    scheme: str, addr: str | None, advertised: str | None, addr_key: str, advertised_key: str
) -> str:
    """``advertised``, else ``scheme://addr`` ("" without either); InvalidInputError when that
    names no address a client can reach (a wildcard host or port 0)."""
    url = advertised or (f"{scheme}://{addr}" if addr else "")
    host = url.partition("://")[2].rpartition(":")[0]
    if host in ("0.0.0.0", "[::]") or url.endswith(":0"):
        raise InvalidInputError(
            f"front.{addr_key} does not name an address clients can reach ({url}): set "
            f"front.{advertised_key}"
        )
    return url


def credentials_of(settings: Settings) -> ClientCredentials:
    """How the broker authenticates to its sidecar: ``front.sidecar_*``, or the sidecar's own
    ``grpc.admin_token`` when the two share a file and the broker has no token of its own."""
    f = settings.front

    def path(value: str | None) -> Path | None:
        return Path(value) if value else None

    token = None
    if f.sidecar_token_file is None and settings.grpc.admin_token is not None:
        token = settings.grpc.admin_token.get_secret_value()
    return ClientCredentials(
        ca_file=path(f.sidecar_ca_file),
        cert_file=path(f.sidecar_cert_file),
        key_file=path(f.sidecar_key_file),
        token=token,
        token_file=path(f.sidecar_token_file),
    )


def storage_of(settings: Settings) -> StorageAddress:
    """Where the cluster's topics are kept."""
    f = settings.front
    context = None
    if f.storage_ca_file is not None:
        context = ssl.create_default_context(cafile=f.storage_ca_file)
    try:
        return StorageAddress.parse(f.storage_url, tls=context)
    except LbdError as e:
        raise InvalidInputError(f"front.storage_url: {e}") from None


class BrokerFront:
    """One ``lbd broker`` process (the module docstring)."""

    def __init__(self, settings: Settings) -> None:
        if settings.broker.broker_id is None:
            raise InvalidInputError(
                "broker.broker_id is not set: pass --broker-id ID (or set it in the config file, "
                "or LBD_BROKER__BROKER_ID)"
            )
        self._settings = settings
        self._me = settings.broker.broker_id
        self._stop = asyncio.Event()
        self._urgent = asyncio.Event()
        self._died: BaseException | None = None

    def request_stop(self) -> None:
        """Leave gracefully; a second request stops at once."""
        if self._stop.is_set():
            _log.warning("second stop request: stopping without waiting for the handover")
            self._urgent.set()
        self._stop.set()

    async def run(self) -> int:
        """Start, serve until asked to stop or the session fails for good, stop; exit code."""
        loop = asyncio.get_running_loop()
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, self.request_stop)
        try:
            async with contextlib.AsyncExitStack() as stack:
                client, front = await self._start(stack)
                _log.info("broker %s is serving", self._me)
                session = asyncio.ensure_future(client.run())
                stack.push_async_callback(_cancel, session)
                stopping = asyncio.ensure_future(self._stop.wait())
                await asyncio.wait((session, stopping), return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                if session.done():
                    self._died = session.exception() or RuntimeError("the session task returned")
                    _log.critical("the session with the sidecar failed: %s", self._died)
                else:
                    await self._leave(client, front)
                _log.info("stopping")
        finally:
            for sig in _STOP_SIGNALS:
                loop.remove_signal_handler(sig)
        return EXIT_DIED if self._died is not None else EXIT_OK

    async def _start(self, stack: contextlib.AsyncExitStack) -> tuple[BrokerClient, Front]:
        s = self._settings
        f = s.front
        sidecar = sidecar_of(s)
        credentials = credentials_of(s)
        urls = advertised_urls(s)
        web = advertised_web(s)
        storage = storage_of(s)
        tls = None
        if f.tls_cert_file is not None and f.tls_key_file is not None:
            tls = ReloadingTls(
                ServerTlsFiles(
                    Path(f.tls_cert_file),
                    Path(f.tls_key_file),
                    Path(f.tls_ca_file) if f.tls_ca_file else None,
                )
            )
        await _check_sidecar(sidecar, credentials, s.cluster.startup_timeout_s)

        metrics = FrontMetrics()
        if f.metrics_addr is not None:
            host, _, port = f.metrics_addr.rpartition(":")
            try:
                httpd, _thread = start_http_server(int(port), host.strip("[]"), metrics.registry)
            except OSError as e:
                raise LbdError(f"front.metrics_addr {f.metrics_addr}: {e.strerror}") from e
            stack.callback(httpd.server_close)
            stack.callback(httpd.shutdown)
        events = EventLog(Path(f.events_file), self._me) if f.events_file else None
        if events is not None:
            stack.callback(events.close)

        ownership = OwnershipCache(sidecar, credentials=credentials)
        channel = credentials.aio_channel(sidecar)
        stack.push_async_callback(channel.close)
        lookups = LookupBatcher(lbd_pb2_grpc.LoadBalancerStub(channel))
        stack.push_async_callback(lookups.close)
        pool = StoragePool(storage)
        stack.push_async_callback(pool.close)
        front = Front(
            broker_id=self._me,
            urls=urls,
            storage=pool,
            ownership=ownership,
            sidecar_lookup=lookups.lookup,
            metrics=metrics,
            usage=UsageSampler(f.usage_source, f.bandwidth_limit_mbit),
            events=events,
            drain_timeout_s=f.drain_timeout_s,
            handover_timeout_s=f.handover_timeout_s,
            lookup_hold_s=f.lookup_hold_s,
            max_message_size=f.max_message_size,
        )
        metrics.count_traffic(front.traffic_totals)
        stack.push_async_callback(front.close_tasks)
        info = lbd_pb2.BrokerInfo(
            broker_id=self._me,
            service_url=urls.service_url,
            service_url_tls=urls.service_url_tls,
            web_service_url=web.http,
            web_service_url_tls=web.https,
            version=f"lbd-front/{__version__}",
            start_time_ms=int(time.time() * 1000),
        )
        client = BrokerClient(
            sidecar, info, front, report_interval_s=f.report_interval_s, credentials=credentials
        )
        front.attach(client)
        server = FrontServer(
            front,
            addr=f.addr,
            tls_addr=f.tls_addr,
            tls=tls,
            limits=Limits(
                max_connections=f.max_connections,
                max_connections_per_peer=f.max_connections_per_peer,
                handshake_timeout_s=f.handshake_timeout_s,
                keepalive_interval_s=f.keepalive_interval_s,
            ),
        )
        await server.start()
        stack.push_async_callback(server.close)
        rest = RestApi(
            channel,
            BrokerView(
                broker_id=self._me,
                cluster=s.cluster.name,
                web=web,
                service_url=urls.service_url,
                service_url_tls=urls.service_url_tls,
                version=info.version,
                serving=lambda: _not_serving(client),
                load_report=lambda: front.last_report,
            ),
        )
        web_server = HttpServer(
            rest,
            addr=f.web_addr,
            tls_addr=f.web_tls_addr,
            tls=tls.context if tls is not None else None,
        )
        await web_server.start()
        stack.push_async_callback(web_server.close)
        ownership.start()
        stack.push_async_callback(ownership.close)
        brokers = asyncio.ensure_future(_learn_brokers(front, rest, channel, credentials))
        stack.push_async_callback(_cancel, brokers)
        _log.info(
            "broker %s: clients at %s, web service at %s, sidecar %s, storage %s",
            self._me,
            " and ".join(u for u in (urls.service_url, urls.service_url_tls) if u),
            " and ".join(u for u in (web.http, web.https) if u) or "(none)",
            sidecar,
            f.storage_url,
        )
        return client, front

    async def _leave(self, client: BrokerClient, front: Front) -> None:
        """Hand every bundle to other brokers through the sidecar, then return."""
        if self._urgent.is_set() or not front.served:
            return
        timeout = self._settings.front.leave_timeout_s
        held = len(front.served)
        _log.info(
            "leaving: asking the sidecar to hand over %d bundles (at most %g s)", held, timeout
        )
        client.leave("the broker is shutting down")
        deadline = time.monotonic() + timeout
        waits = [
            asyncio.ensure_future(front.emptied.wait()),
            asyncio.ensure_future(self._urgent.wait()),
        ]
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        if front.served:
            _log.warning(
                "leaving with %d bundles still held: their clients look them up again",
                len(front.served),
            )
        else:
            _log.info("every bundle handed over")
        await front.settle_handovers(min(5.0, max(deadline - time.monotonic(), 0.5)))


BROKERS_REFRESH_S = 5.0
"""How often the front asks its sidecar for the registered brokers' URLs."""


def _not_serving(client: BrokerClient) -> str | None:
    """Why the broker does not serve now (None when it does)."""
    if not client.connected:
        return "no session with its sidecar"
    if not client.lease_valid():
        return "its serving lease is not valid"
    return None


async def _learn_brokers(
    front: Front, rest: RestApi, channel: grpc.aio.Channel, credentials: ClientCredentials
) -> None:
    """Keep the front's and the REST API's lists of brokers (where to send a client its own
    sidecar cannot answer for) from the sidecar's ListBrokers; a failed call waits for the
    next."""
    admin = lbd_pb2_grpc.AdminStub(channel)
    while True:
        try:
            listed = await admin.ListBrokers(
                lbd_pb2.ListBrokersRequest(),
                timeout=BROKERS_REFRESH_S,
                metadata=credentials.metadata(),
            )
        except grpc.aio.AioRpcError as e:
            _log.debug("listing the brokers failed: %s", e.code().name)
        else:
            front.learn_brokers(
                {
                    BrokerId(b.info.broker_id): Redirect(b.info.service_url, b.info.service_url_tls)
                    for b in listed.brokers
                    if b.info.service_url or b.info.service_url_tls
                }
            )
            rest.learn_brokers(
                {
                    b.info.broker_id: WebUrls(b.info.web_service_url, b.info.web_service_url_tls)
                    for b in listed.brokers
                    if b.info.web_service_url or b.info.web_service_url_tls
                }
            )
        await asyncio.sleep(BROKERS_REFRESH_S)


async def _cancel(task: asyncio.Future[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _check_sidecar(sidecar: str, credentials: ClientCredentials, timeout_s: float) -> None:
    """Wait until the sidecar's health service answers SERVING; LbdError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with credentials.aio_channel(sidecar) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            left = deadline - time.monotonic()
            try:
                answer = await stub.Check(
                    health_pb2.HealthCheckRequest(service=""),
                    timeout=max(min(left, 2.0), 0.1),
                    metadata=credentials.metadata(),
                )
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
            except grpc.aio.AioRpcError as e:
                last = f"{e.code().name}: {e.details()}"
            if time.monotonic() >= deadline:
                raise LbdError(
                    f"the sidecar at {sidecar} cannot be reached ({last}) within "
                    f"{timeout_s:g} s: start `lbd serve` first, or set front.sidecar_addr"
                )
            await asyncio.sleep(0.2)
