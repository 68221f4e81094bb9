"""The one wiring of a sidecar: every service, built from ports, plain config, a clock and an rng.

:func:`build_sidecar` is called by ``lbd serve`` (with the etcd and Pulsar adapters), by every
test harness and by the simulator (with the in-memory adapters). Nothing else constructs the
services of a sidecar, so what runs in tests is what runs in production.

Start order (:meth:`Sidecar.start`), each step needing the ones before:

1. the channel: the newest checkpoint restored, the follower caught up with the channel;
2. the metadata session (grants the lease), the load topics, the registry, the maintenance
   records, the namespace records (listed, then watched), ``public/default``;
3. the session watcher, then ownership: the reactor reconciles the broker with the table, the
   registration follows the broker link, the fence watches the lease;
4. this broker's load reports and split scheduler, then the leader election (whose six duties are
   the operation tracker, the shedder, the ownership monitor, checkpoints, the drainer and the
   safety auditor).

:meth:`Sidecar.close` stops them in reverse, deregistering the broker before the lease goes.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from lbd.core.audit import AuditBounds, AuditData
from lbd.core.broker_info import BrokerInfo
from lbd.core.ids import BrokerId
from lbd.core.names import NamespaceName
from lbd.core.settings import SidecarConfig
from lbd.core.state import ServiceUnitStateData, owner_of
from lbd.core.table import ApplyResult
from lbd.metrics import Metrics
from lbd.ports.channel import ChannelLog
from lbd.ports.checkpoint import CheckpointStore
from lbd.ports.clock import Clock
from lbd.ports.errors import SessionExpiredError, UnavailableError
from lbd.ports.history import HistoryRecorder, NoHistory
from lbd.ports.loadstore import LoadStore
from lbd.ports.metadata import MetadataStore
from lbd.services.channel import checkpoints
from lbd.services.channel.checkpoints import CheckpointDuty
from lbd.services.channel.follower import ChannelFollower
from lbd.services.channel.proposals import Proposer
from lbd.services.cluster.assigner import Assigner
from lbd.services.cluster.checks import RequestChecks
from lbd.services.cluster.loads import LoadView
from lbd.services.cluster.maintenance_view import MaintenanceView
from lbd.services.cluster.namespaces import NamespaceService
from lbd.services.cluster.registry import BrokerRegistry
from lbd.services.leader.auditor import SafetyAuditor
from lbd.services.leader.decisions import DecisionLog
from lbd.services.leader.drain import Drainer
from lbd.services.leader.election import LeaderElector
from lbd.services.leader.governor import ExecutionGovernor
from lbd.services.leader.monitor import OwnershipMonitor
from lbd.services.leader.shedding import UnloadScheduler
from lbd.services.leader.tracker import OperationTracker
from lbd.services.sidecar.assign_split import Operations
from lbd.services.sidecar.broker_link import BrokerLink
from lbd.services.sidecar.fencing import Fence
from lbd.services.sidecar.loadreport import LoadReporter, UsageSampler
from lbd.services.sidecar.lookup import LookupService
from lbd.services.sidecar.reactor import OwnershipReactor
from lbd.services.sidecar.registration import BrokerRegistration
from lbd.services.sidecar.session_watch import SessionWatcher
from lbd.services.sidecar.splitting import SplitScheduler
from lbd.tasks import Component, Tasks, idle_timeout

_log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = NamespaceName("public", "default")
"""Ensured at start, as Pulsar's standalone creates it, so a first lookup needs no admin step."""

OnDeath = Callable[[str, BaseException], None]


@dataclass(frozen=True, slots=True)
class SidecarPorts:
    """The outside systems of one sidecar, built but not started."""

    metadata: MetadataStore
    channel: ChannelLog
    broker_loads: LoadStore
    top_bundles: LoadStore
    checkpoints: CheckpointStore


@dataclass(eq=False)
class Sidecar(Component):
    """Every service of one sidecar, as :func:`build_sidecar` wired them."""

    me: BrokerId
    info: BrokerInfo
    """What this sidecar registers for its broker while it stands alone (auto-ack)."""
    config: SidecarConfig
    ports: SidecarPorts
    clock: Clock
    metrics: Metrics
    follower: ChannelFollower
    proposer: Proposer
    registry: BrokerRegistry
    maintenance: MaintenanceView
    namespaces: NamespaceService
    loads: LoadView
    assigner: Assigner
    link: BrokerLink
    fence: Fence
    session: SessionWatcher
    reactor: OwnershipReactor
    registration: BrokerRegistration
    lookup: LookupService
    operations: Operations
    reporter: LoadReporter
    splitter: SplitScheduler
    unload_scheduler: UnloadScheduler
    monitor: OwnershipMonitor
    checkpointing: CheckpointDuty
    auditor: SafetyAuditor
    elector: LeaderElector
    governor: ExecutionGovernor
    tracker: OperationTracker
    decisions: DecisionLog
    drainer: Drainer
    _stack: contextlib.AsyncExitStack | None = None

    async def start(self) -> None:
        """Start every part in order (see the module docstring); on failure, stop what started.

        Raises UnavailableError when etcd or Pulsar cannot be reached, at the latest after
        ``startup_timeout_s`` (naming the step that did not finish). While the state channel is
        read, only time without a new message counts: a long channel takes as long as it needs.
        """
        if self._stack is not None:
            return
        timeout_s = self.config.timings.startup_timeout_s
        step = "reading the newest checkpoint from etcd"
        # The deadline sits inside the stack: what started is closed after it fired, not while.
        async with contextlib.AsyncExitStack() as stack:
            try:
                async with self.clock.timeout(timeout_s):
                    table = await checkpoints.restore(self.ports.checkpoints)
                    step = "reading the state channel from Pulsar"
                    stack.push_async_callback(self.ports.channel.close)
                    stack.push_async_callback(self.proposer.close)
                    await self._started(stack, self.follower, table)
                # Only time without a new message counts: a long channel takes what it needs.
                async with idle_timeout(
                    self.clock, timeout_s, lambda: self.follower.table.last_position
                ):
                    await self.follower.wait_ready()
                step = "starting the rest of the sidecar"
                async with self.clock.timeout(timeout_s):  # the rest gets the whole timeout
                    await self._start_rest(stack)
            except TimeoutError:
                raise UnavailableError(
                    f"the sidecar did not start within {timeout_s:g}s "
                    f"(cluster.startup_timeout_s): {step} did not finish"
                ) from None
            self._stack = stack.pop_all()

    async def _start_rest(self, stack: contextlib.AsyncExitStack) -> None:
        """Everything after the channel has caught up, in order."""
        await self._started(stack, self.ports.metadata)  # closing it revokes the lease
        await self._started(stack, self.loads)
        await self._started(stack, self.registry)
        await self._started(stack, self.maintenance)
        await self._started(stack, self.namespaces)
        await self.namespaces.ensure(DEFAULT_NAMESPACE, self.config.default_namespace_bundles)
        await self._started(stack, self.session)
        await self._started(stack, self.reactor)
        stack.push_async_callback(self.registration.deregister)  # after it stopped following
        await self._started(stack, self.registration)
        await self._started(stack, self.fence)
        await self._started(stack, self.reporter)
        await self._started(stack, self.splitter)
        await self._started(stack, self.governor)
        await self._started(stack, self.tracker)
        await self._started(stack, self.elector)
        tasks = Tasks(f"the sidecar of {self.me}")
        tasks.spawn(_count_owned(self.follower, self.metrics, self.me), name="owned-count")
        stack.push_async_callback(tasks.close)

    async def close(self) -> None:
        """Stop every part in reverse order. Idempotent."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    @staticmethod
    async def _started(stack: contextlib.AsyncExitStack, part: Any, *args: Any) -> None:
        """Start ``part`` and have the stack close it."""
        await part.start(*args)
        stack.push_async_callback(part.close)


def build_sidecar(
    info: BrokerInfo,
    ports: SidecarPorts,
    config: SidecarConfig,
    clock: Clock,
    rng: random.Random,
    *,
    metrics: Metrics | None = None,
    history: HistoryRecorder | None = None,
    host: UsageSampler | None = None,
    on_death: OnDeath | None = None,
    on_session_expired: Callable[[SessionExpiredError], None] | None = None,
) -> Sidecar:
    """Wire every service of the sidecar of ``info.broker_id``; nothing is started.

    ``rng`` decides every random choice (assignment, shedding). ``metrics`` defaults to a
    private registry and ``history`` to recording nothing; ``host`` measures the host while no
    broker reports (default: this machine). ``on_death`` hears of a vital task's death and
    ``on_session_expired`` of the metadata session's end under the ``shutdown`` policy (the
    daemon stops on either).
    """
    me = info.broker_id
    timings = config.timings
    metrics = metrics if metrics is not None else Metrics()
    history = history if history is not None else NoHistory()
    follower = ChannelFollower(ports.channel, name=f"channel-follower-{me}", on_death=on_death)
    metrics.track_follower(follower.stats)
    proposer = Proposer(
        ports.channel,
        follower,
        clock,
        apply_timeout_s=timings.settle_timeout_s,
        publish_timeout_s=timings.publish_timeout_s,
        metrics=metrics,
        batch_max_values=config.channel_batch_max_values,
    )
    registry = BrokerRegistry(ports.metadata, clock)
    maintenance = MaintenanceView(ports.metadata, clock, me)
    namespaces = NamespaceService(ports.metadata, config.default_namespace_bundles)
    loads = LoadView(
        ports.broker_loads, ports.top_bundles, clock, ttl_s=config.shedding.load_data_ttl_s
    )
    assigner = Assigner(
        follower=follower,
        proposer=proposer,
        registry=registry,
        namespaces=namespaces,
        loads=loads,
        maintenance=maintenance,
        config=config.assignment,
        rng=rng,
        history=history,
    )
    link = BrokerLink(
        me,
        auto_ack=config.auto_ack,
        own_ack_timeout_s=timings.own_ack_timeout_s,
        release_ack_timeout_s=timings.release_ack_timeout_s,
        clock=clock,
        serving_lease_s=timings.serving_lease_s,
        lease_margin_s=timings.lease_margin_s,
        # The fence watches the link, and the link asks the fence: bound once both exist.
        vouch=lambda: fence.vouches(),
    )
    registration = BrokerRegistration(
        link,
        registry,
        clock,
        maintenance=maintenance,
        self_info=info,
        retry_s=timings.retry_s,
        silence_timeout_s=timings.silence_timeout_s,
    )
    fence = Fence(
        ports.metadata,
        link,
        clock,
        follower,
        registration,
        fence_after_s=timings.fence_after_s,
        channel_fence_after_s=timings.channel_fence_after_s,
        check_interval_s=timings.fence_check_interval_s,
        metrics=metrics,
    )
    lookup = LookupService(
        me,
        follower=follower,
        proposer=proposer,
        registry=registry,
        namespaces=namespaces,
        assigner=assigner,
        fence=fence,
        clock=clock,
        settle_timeout_s=timings.settle_timeout_s,
        metrics=metrics,
    )
    checks = RequestChecks(
        follower=follower, registry=registry, namespaces=namespaces, maintenance=maintenance
    )
    operations = Operations(
        me,
        follower=follower,
        proposer=proposer,
        checks=checks,
        namespaces=namespaces,
        lookup=lookup,
        link=link,
        split_config=config.split,
        settle_timeout_s=timings.settle_timeout_s,
        history=history,
        metrics=metrics,
    )
    decisions = DecisionLog(clock, keep=config.operations.keep_decisions)
    governor = ExecutionGovernor(follower, clock, config.governor, metrics=metrics)
    tracker = OperationTracker(
        me,
        follower=follower,
        proposer=proposer,
        registry=registry,
        checks=checks,
        assigner=assigner,
        governor=governor,
        clock=clock,
        config=config.operations,
        settle_timeout_s=timings.settle_timeout_s,
        decisions=decisions,
        history=history,
        metrics=metrics,
        cordoned=maintenance.cordoned,
    )
    drainer = Drainer(
        me,
        maintenance=maintenance,
        registry=registry,
        follower=follower,
        proposer=proposer,
        tracker=tracker,
        clock=clock,
        settle_timeout_s=timings.settle_timeout_s,
        retry_s=timings.retry_s,
    )
    unload_scheduler = UnloadScheduler(
        proposer,
        follower,
        registry,
        loads,
        clock,
        config.shedding,
        strategy=config.shedding_strategy,
        interval_s=config.shedding_interval_s,
        metrics=metrics,
        rng=rng,
        history=history,
        destinations=assigner.move_rules,
        tracker=tracker,
        operations=config.operations,
        settle_timeout_s=timings.settle_timeout_s,
    )
    monitor = OwnershipMonitor(
        proposer,
        follower,
        registry,
        namespaces,
        assigner,
        clock,
        config.monitor,
        handover_wait_s=timings.handover_wait_s,
        metrics=metrics,
        governor=governor,
        decisions=decisions,
        channel_readable_since=lambda: fence.readable_since,
    )
    checkpointing = CheckpointDuty(
        ports.checkpoints, follower, clock, interval_s=config.checkpoint_interval_s
    )
    auditor = SafetyAuditor(
        me,
        follower,
        registry,
        loads,
        clock,
        bounds=AuditBounds.of(config.monitor, timings.handover_wait_s),
        interval_s=config.operations.audit_interval_s,
        metrics=metrics,
    )
    return Sidecar(
        me=me,
        info=info,
        config=config,
        ports=ports,
        clock=clock,
        metrics=metrics,
        follower=follower,
        proposer=proposer,
        registry=registry,
        maintenance=maintenance,
        namespaces=namespaces,
        loads=loads,
        assigner=assigner,
        link=link,
        fence=fence,
        session=SessionWatcher(ports.metadata, on_expired=on_session_expired or _log_expiry),
        reactor=OwnershipReactor(
            me,
            follower=follower,
            proposer=proposer,
            link=link,
            registry=registry,
            namespaces=namespaces,
            clock=clock,
            fence=fence,
            retry_s=timings.retry_s,
            reown_interval_s=timings.silence_timeout_s,
            metrics=metrics,
        ),
        registration=registration,
        lookup=lookup,
        operations=operations,
        reporter=LoadReporter(
            me,
            link,
            loads,
            clock,
            interval_s=config.load_report_interval_s,
            top_bundles=config.top_bundles_per_report,
            metrics=metrics,
            history=history,
            host=host,
            on_death=on_death,
            stale_after_s=timings.silence_timeout_s,
            audit=lambda: AuditData(
                follower.table.last_position, follower.table.digest, lookup.dead_owners
            ),
        ),
        splitter=SplitScheduler(
            me,
            operations,
            follower,
            link,
            namespaces,
            clock,
            config.split,
            interval_s=config.split_interval_s,
            on_death=on_death,
            metrics=metrics,
        ),
        unload_scheduler=unload_scheduler,
        monitor=monitor,
        checkpointing=checkpointing,
        auditor=auditor,
        elector=LeaderElector(
            me,
            ports.metadata,
            follower,
            clock,
            (tracker, unload_scheduler, monitor, checkpointing, drainer, auditor),
            metrics=metrics,
            retry_s=timings.retry_s,
            on_death=on_death,
        ),
        governor=governor,
        tracker=tracker,
        decisions=decisions,
        drainer=drainer,
    )


def _log_expiry(error: SessionExpiredError) -> None:
    _log.error("metadata session over, and nobody to stop: %s", error)


async def _count_owned(follower: ChannelFollower, metrics: Metrics, me: BrokerId) -> None:
    """Count applied channel changes and keep ``lbd_owned_bundles`` (bundles Owned by ``me``)
    and ``lbd_bundles_in_flight`` (every broker's bundles in a transient state).

    Kept on the event loop rather than read at scrape time: scrapes run in the HTTP server's
    thread, which must not iterate a table the loop is changing. The table is scanned once;
    after that each change adjusts the counts, and the series are set once per batch of changes.
    """
    batches: AsyncGenerator[list[ApplyResult], None] = follower.change_batches()
    values = [value for _, value in follower.table.items()]
    owned = sum(1 for value in values if owner_of(value) == me)
    in_flight = sum(1 for value in values if _in_flight(value))
    metrics.owned_bundles.set(owned)
    metrics.bundles_in_flight.set(in_flight)
    async with contextlib.aclosing(batches):
        async for batch in batches:
            applied = collections.Counter(None if c.new is None else c.new.state for c in batch)
            for state, count in applied.items():
                metrics.observe_applied(state, count)
            for change in batch:
                owned += int(owner_of(change.new) == me) - int(owner_of(change.old) == me)
                in_flight += int(_in_flight(change.new)) - int(_in_flight(change.old))
            metrics.owned_bundles.set(owned)
            metrics.bundles_in_flight.set(in_flight)


def _in_flight(value: ServiceUnitStateData | None) -> bool:
    return value is not None and value.state.is_in_flight
