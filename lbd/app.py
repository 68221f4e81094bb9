"""The composition root: ``lbd serve`` built from Settings, started in order, stopped in reverse.

The only module that knows every part. Start-up, in order:

1. metrics and tracing (so that everything after is observable);
2. etcd (connection, metadata store with the session lease, checkpoint store) and Pulsar
   (connection, state channel, broker-load and top-bundles stores);
3. the newest checkpoint, then the channel follower, waited for until it has caught up;
4. registry, namespaces (``public/default`` ensured), proposer, broker link, ownership reactor,
   lookup, operations, fence, load reporter, split scheduler, leader elector;
5. the gRPC server, whose health turns SERVING, and NOT_SERVING again while fenced.

SIGTERM or SIGINT stops it within a bounded time: gRPC drains for ``grpc.shutdown_grace_s``, the
broker is deregistered, services close in reverse order, the lease is revoked, connections close.
A vital task's death stops it the same way, loudly, and the exit code is then 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any

from prometheus_client import start_http_server

from lbd.adapters.clock import SystemClock
from lbd.adapters.etcd import EtcdConnection, EtcdOptions
from lbd.adapters.etcd_checkpoint import EtcdCheckpointStore
from lbd.adapters.etcd_store import EtcdMetadataStore
from lbd.adapters.pulsar_channel import PulsarChannelLog
from lbd.adapters.pulsar_client import PulsarConnection
from lbd.adapters.pulsar_load import PulsarLoadStore
from lbd.api.admin import AdminDeps, AdminServicer
from lbd.api.forwarding import Forwarder
from lbd.api.loadbalancer import LoadBalancerServicer
from lbd.api.server import ApiServer, track_fence
from lbd.api.tracing import console_requested, install_tracing
from lbd.config import Settings
from lbd.core.broker import BrokerInfo
from lbd.core.errors import InvalidInputError, LbdError
from lbd.core.ids import BrokerId
from lbd.core.names import NamespaceName
from lbd.core.state import ServiceUnitState, ServiceUnitStateData
from lbd.metrics import Metrics
from lbd.ports.clock import Clock
from lbd.ports.history import HistoryRecorder
from lbd.services import checkpoints
from lbd.services.broker_link import BrokerLink
from lbd.services.fencing import Fence
from lbd.services.follower import ChannelFollower
from lbd.services.leader import LeaderElector
from lbd.services.loadreport import LoadReporter
from lbd.services.lookup import LookupService
from lbd.services.monitor import CheckpointDuty, OwnershipMonitor
from lbd.services.namespaces import NamespaceService
from lbd.services.operations import Operations
from lbd.services.ownership import OwnershipReactor
from lbd.services.proposals import Proposer
from lbd.services.registry import BrokerRegistry
from lbd.services.shedding import UnloadScheduler
from lbd.services.splitting import SplitScheduler
from lbd.tasks import cancel_and_wait, guard

_log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = NamespaceName("public", "default")
"""Ensured at start, as Pulsar's standalone creates it, so a first lookup needs no admin step."""
DEFAULT_NAMESPACE_BUNDLES = 4

EXIT_OK = 0
EXIT_DIED = 1

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True, slots=True)
class Death:
    """A vital task that died, and how."""

    name: str
    error: BaseException


def serve(settings: Settings) -> int:
    """Run the sidecar until SIGTERM/SIGINT (exit 0) or a vital part's death (exit 1)."""
    sidecar = Sidecar(settings, broker_id_of(settings), advertised_addr(settings))
    return _run(sidecar.run())


def _run(main: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # optional: the default loop is only slower
        return asyncio.run(main)
    return uvloop.run(main)


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


class Sidecar:
    """One ``lbd serve``: every part, started in order, stopped in reverse."""

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
        finally:
            for sig in _STOP_SIGNALS:
                loop.remove_signal_handler(sig)
        if self._death is not None:
            _log.critical("stopped because task %s died", self._death.name)
            return EXIT_DIED
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

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        s = self._settings
        me, clock, on_death = self._me, self._clock, self._on_death

        # -- observability -------------------------------------------------------------------
        metrics = Metrics()
        provider = install_tracing(broker_id=me, console=console_requested(os.environ))
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

        # -- outside systems -----------------------------------------------------------------
        options = EtcdOptions.from_settings(s)
        etcd = EtcdConnection.from_options(options)
        stack.push_async_callback(etcd.close)
        metadata = EtcdMetadataStore(etcd, options, clock)
        checkpoint_store = EtcdCheckpointStore(etcd, options.prefix)
        pulsar = PulsarConnection.from_settings(s.pulsar)
        stack.push_async_callback(pulsar.close)
        channel = PulsarChannelLog(pulsar, s.pulsar.state_channel_topic)
        stack.push_async_callback(channel.close)
        broker_loads = PulsarLoadStore(pulsar, s.pulsar.broker_load_topic, clock)
        stack.push_async_callback(broker_loads.close)
        top_bundles = PulsarLoadStore(pulsar, s.pulsar.top_bundles_topic, clock)
        stack.push_async_callback(top_bundles.close)

        # -- the channel -----------------------------------------------------------------------
        table = await checkpoints.restore(checkpoint_store)
        follower = ChannelFollower(channel, table, on_death=on_death)
        metrics.track_follower(follower.stats)
        await _started(stack, follower)
        await follower.wait_ready()

        # -- the session and the registry ------------------------------------------------------
        await _started(stack, metadata)  # closing it revokes the lease: registrations vanish
        await broker_loads.start()
        await top_bundles.start()
        registry = BrokerRegistry(metadata, clock)
        await _started(stack, registry)
        namespaces = NamespaceService(metadata, DEFAULT_NAMESPACE_BUNDLES)
        await namespaces.ensure(DEFAULT_NAMESPACE, DEFAULT_NAMESPACE_BUNDLES)

        # -- ownership ---------------------------------------------------------------------------
        proposer = Proposer(channel, follower, clock, metrics=metrics)
        link = BrokerLink(
            me,
            auto_ack=s.broker.auto_ack,
            ack_timeout_s=s.broker.release_ack_timeout_s,
            clock=clock,
        )
        fence = Fence(metadata, link, clock, fence_after_s=s.etcd.fence_after_s)
        reactor = OwnershipReactor(
            me,
            follower=follower,
            proposer=proposer,
            link=link,
            registry=registry,
            namespaces=namespaces,
            clock=clock,
            self_info=BrokerInfo(
                broker_id=me,
                service_url=s.broker.advertised_service_url or "",
                web_service_url=s.broker.advertised_web_url or "",
                start_time_ms=clock.now_ms(),
                sidecar_grpc_addr=self._advertised_addr,
            ),
            sidecar_grpc_addr=self._advertised_addr,
            fence=fence,
            metrics=metrics,
        )
        await _started(stack, reactor)
        await _started(stack, fence)
        history = await self._start_history(stack, me)
        lookup = LookupService(
            me,
            follower=follower,
            proposer=proposer,
            registry=registry,
            namespaces=namespaces,
            load_store=broker_loads,
            clock=clock,
            assignment=s.assignment.to_core(),
            load_data_ttl_s=s.shedding.load_data_ttl_s,
            fence=fence,
            history=history,
            metrics=metrics,
        )
        operations = Operations(
            me,
            follower=follower,
            proposer=proposer,
            registry=registry,
            namespaces=namespaces,
            lookup=lookup,
            link=link,
            split_config=s.split.to_core(),
            history=history,
            metrics=metrics,
        )

        # -- load and leadership -----------------------------------------------------------------
        reporter = LoadReporter(
            me,
            link,
            broker_loads,
            top_bundles,
            clock,
            s.load_report,
            metrics=metrics,
            history=history,
            on_death=on_death,
        )
        await _started(stack, reporter)
        splitter = SplitScheduler(
            me,
            operations,
            follower,
            link,
            namespaces,
            clock,
            s.split,
            metrics=metrics,
            on_death=on_death,
        )
        await _started(stack, splitter)
        unload_scheduler = UnloadScheduler(
            proposer,
            follower,
            registry,
            broker_loads,
            top_bundles,
            clock,
            s.shedding,
            metrics=metrics,
            history=history,
        )
        monitor = OwnershipMonitor(
            proposer,
            follower,
            registry,
            namespaces,
            broker_loads,
            clock,
            s.monitor,
            assignment=s.assignment.to_core(),
            load_data_ttl_s=s.shedding.load_data_ttl_s,
            metrics=metrics,
        )
        checkpointing = CheckpointDuty(checkpoint_store, follower, clock, s.checkpoint)
        elector = LeaderElector(
            me,
            metadata,
            follower,
            clock,
            (unload_scheduler, monitor, checkpointing),
            metrics=metrics,
            on_death=on_death,
        )
        await _started(stack, elector)

        # -- the API -----------------------------------------------------------------------------
        forwarder = Forwarder(me)
        stack.push_async_callback(forwarder.close)
        server = ApiServer(
            s.grpc.addr,
            loadbalancer=LoadBalancerServicer(lookup=lookup, follower=follower, link=link),
            admin=AdminServicer(
                AdminDeps(
                    me=me,
                    registry=registry,
                    namespaces=namespaces,
                    follower=follower,
                    operations=operations,
                    lookup=lookup,
                    elector=elector,
                    unload_scheduler=unload_scheduler,
                    broker_loads=broker_loads,
                    load_data_ttl_ms=s.shedding.load_data_ttl_s * 1000,
                    clock=clock,
                    forwarder=forwarder,
                )
            ),
            admin_token=(
                s.grpc.admin_token.get_secret_value() if s.grpc.admin_token is not None else None
            ),
            tracer_provider=provider,
        )
        await server.start()
        stack.push_async_callback(self._deregister, registry)
        stack.push_async_callback(server.stop, s.grpc.shutdown_grace_s)
        health = guard(track_fence(server, fence), name="health", on_death=on_death)
        stack.push_async_callback(cancel_and_wait, health)
        observer = guard(_observe_channel(follower, metrics, me), name="channel-metrics")
        stack.push_async_callback(cancel_and_wait, observer)

    async def _deregister(self, registry: BrokerRegistry) -> None:
        try:
            await registry.deregister(self._me)
        except LbdError as e:
            # The lease revocation right after removes the registration anyway.
            _log.warning("could not deregister %s: %s", self._me, e)


async def _started(stack: contextlib.AsyncExitStack, part: Any) -> None:
    """Start ``part`` and close it when the stack unwinds."""
    await part.start()
    stack.push_async_callback(part.close)


async def _observe_channel(follower: ChannelFollower, metrics: Metrics, me: BrokerId) -> None:
    """Count applied channel changes and keep ``lbd_owned_bundles`` (bundles Owned by ``me``).

    Kept on the event loop rather than read at scrape time: scrapes run in the HTTP server's
    thread, which must not iterate a table the loop is changing.
    """

    def mine(value: ServiceUnitStateData | None) -> bool:
        return (
            value is not None and value.state is ServiceUnitState.Owned and value.dst_broker == me
        )

    # No await between the count and the feed's first step, which subscribes: no change is
    # missed or counted twice.
    owned = sum(1 for _, value in follower.table.items() if mine(value))
    metrics.owned_bundles.set(owned)
    async for change in follower.changes():
        metrics.observe_applied(None if change.new is None else change.new.state)
        owned += int(mine(change.new)) - int(mine(change.old))
        metrics.owned_bundles.set(owned)
