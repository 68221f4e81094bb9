"""The unload scheduler: the leader's shedder over a snapshot of the cluster (DESIGN §7).

Each cycle (every ``shedding.interval_s`` while leading, or on demand for the Rebalance RPC):

1. snapshot: the registered brokers (none: ``NoBrokers``), their latest load data and top bundles
   from the load topics (within ``load_data_ttl_s``), who holds each bundle in the channel table,
   the leader's own record of recent unloads, and for each reported bundle a placement rule
   binds (isolation, anti-affinity) the brokers it may move to;
2. decide: the configured strategy (:data:`lbd.core.shedding.STRATEGIES`), carrying its state
   (hit counts) from the previous cycle;
3. act: the decisions become a :class:`~lbd.core.operations.Plan` (with the load's spread now
   and as predicted after it) and run as a ``shedding`` operation of the
   :class:`~lbd.services.leader.tracker.OperationTracker`: each move waits for the execution
   governor, then, if its bundle is still ``Owned`` by its source, ``Releasing(dst, src)`` is
   proposed (``dst`` None: a plain unload); the source's sidecar does the rest.

Each decision is logged once, as one line with its reason. A dry run decides without acting and
without touching the carried state, and keeps the plan for ``Execute``. With
``operations.auto_shedding`` off the leader runs no cycle of its own. A cycle does not start while
the previous cycle's moves are still under way, and a broker that registers is filled without
waiting for the interval: a cycle runs once its first load report is in. In safe mode (the
registry cannot be reached) no cycle runs: the snapshot would rest on a registry that may be
stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from lbd.core.assign import MoveRules
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BundleLoad
from lbd.core.operations import (
    MoveState,
    Operation,
    OperationKind,
    Plan,
    moves_of,
    predicted_spread,
)
from lbd.core.settings import OperationsConfig, SheddingConfig
from lbd.core.shedding import (
    STRATEGIES,
    DecisionReason,
    LoadSnapshot,
    Scenario,
    ShedderState,
    SheddingResult,
    UnloadDecision,
)
from lbd.core.shedding.model import PastMove
from lbd.metrics import FAILURE, UNKNOWN_REASON, Metrics
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.ports.history import HistoryRecorder
from lbd.ports.metadata import RegistryEvent
from lbd.services.channel.follower import ChannelFollower
from lbd.services.channel.proposals import Proposer
from lbd.services.cluster.loads import LoadView
from lbd.services.cluster.registry import BrokerRegistry
from lbd.services.leader.tracker import OperationTracker
from lbd.tasks import cancel_and_wait, guard

_log = logging.getLogger(__name__)

MoveDestinations = Callable[[], Awaitable[MoveRules]]
"""The placement rules over the cluster as it is now (``Assigner.move_rules``)."""


@dataclass(frozen=True, slots=True)
class CycleReport:
    """What a cycle did beyond the strategy's result: the decisions proposed and those dropped."""

    result: SheddingResult
    proposed: tuple[UnloadDecision, ...]
    dropped: tuple[tuple[UnloadDecision, str], ...]
    """Decisions not acted on, with why (the bundle moved meanwhile, the channel was down)."""
    plan: Plan | None = None
    """The decisions as a plan (None when there are none)."""
    operation: Operation | None = None
    """The operation executing them (None for a dry run)."""


class UnloadScheduler:
    """Runs the shedding strategy over the cluster's load and executes the moves it decides."""

    name = "unload-scheduler"
    """The leader duty's name."""

    def __init__(
        self,
        proposer: Proposer,
        follower: ChannelFollower,
        registry: BrokerRegistry,
        loads: LoadView,
        clock: Clock,
        config: SheddingConfig,
        *,
        strategy: str,
        interval_s: float,
        metrics: Metrics,
        rng: random.Random,
        history: HistoryRecorder,
        tracker: OperationTracker,
        operations: OperationsConfig,
        settle_timeout_s: float,
        destinations: MoveDestinations | None = None,
    ) -> None:
        """Runs ``strategy`` (a key of :data:`lbd.core.shedding.STRATEGIES`) every
        ``interval_s`` while leading (when ``operations.auto_shedding``); ``destinations``
        gives the placement rules of the reported bundles (none: every bundle may go
        anywhere). A cycle waits at most ``settle_timeout_s`` for its moves to start."""
        self._destinations = destinations
        self._history = history
        self._proposer = proposer
        self._follower = follower
        self._registry = registry
        self._loads = loads
        self._clock = clock
        self._config = config
        self._strategy_name = strategy
        self._strategy = STRATEGIES[strategy]
        self._interval_s = interval_s
        self._metrics = metrics
        self._rng = rng
        self._tracker = tracker
        self._operations = operations
        self._settle_timeout_s = settle_timeout_s
        self._state = ShedderState()
        self._recent_bundles: dict[BundleId, int] = {}
        self._recent_brokers: dict[BrokerId, int] = {}
        self._last_skip: tuple[str, tuple[str, ...]] | None = None
        self._lock = asyncio.Lock()
        self._last_op: Operation | None = None

    @property
    def state(self) -> ShedderState:
        """The strategy's state carried into the next cycle."""
        return self._state

    async def run_leading(self, term: int) -> None:
        """The leader duty: a cycle every interval (and when a new broker has reported) until
        cancelled; none while ``operations.auto_shedding`` is off."""
        if not self._operations.auto_shedding:
            _log.info("automatic shedding is off (operations.auto_shedding): plans only")
            await asyncio.Event().wait()  # a duty runs for as long as the leader leads
        arrivals: asyncio.Queue[BrokerId] = asyncio.Queue()
        watcher = guard(self._watch_arrivals(arrivals), name="unload-scheduler-arrivals")
        try:
            while True:
                await self._next_cycle(arrivals)
                if self._last_op is not None and not self._last_op.state.finished:
                    _log.debug("shedding: the previous cycle's moves are still under way")
                    continue
                try:
                    await self.run_once(dry_run=False)
                except UnavailableError as e:
                    _log.warning("shedding cycle skipped: %s", e)
                except Exception:
                    # A strategy bug must not end the leader's other duties; Pulsar counts it too.
                    _log.exception("shedding cycle failed")
                    self._metrics.unload_total.labels(result=FAILURE, reason=UNKNOWN_REASON).inc()
        finally:
            await cancel_and_wait(watcher)

    async def _next_cycle(self, arrivals: asyncio.Queue[BrokerId]) -> None:
        """Wait for the interval, or for a new broker's first load report."""
        sleep = asyncio.ensure_future(self._clock.sleep(self._interval_s))
        arrival = asyncio.ensure_future(arrivals.get())
        try:
            await asyncio.wait({sleep, arrival}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleep.cancel()
            arrival.cancel()

    async def _watch_arrivals(self, arrivals: asyncio.Queue[BrokerId]) -> None:
        """Put each newly registered broker in ``arrivals`` once its load report is in."""
        known = set(self._registry.brokers())
        waiting: set[BrokerId] = set()
        events: asyncio.Queue[RegistryEvent] = asyncio.Queue()
        changes = self._registry.changes()

        async def pump() -> None:
            # A queue between the feed and the waits below: a wait that times out must not
            # cancel (and so close) the feed itself.
            async for event in changes:
                events.put_nowait(event)

        pumping = guard(pump(), name="unload-scheduler-registry")
        poll_s = min(1.0, self._interval_s)
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with self._clock.timeout(poll_s) if waiting else contextlib.nullcontext():
                        event = await events.get()
                        if event.value is not None and event.broker not in known:
                            waiting.add(event.broker)
                known = set(self._registry.brokers())
                waiting &= known
                reported = {b for b in waiting if b in self._loads.brokers()}
                for broker in sorted(reported):
                    _log.info("shedding: new broker %s reported its load; filling it now", broker)
                    arrivals.put_nowait(broker)
                waiting -= reported
        finally:
            await cancel_and_wait(pumping)

    async def run_once(self, *, dry_run: bool) -> SheddingResult:
        """One cycle now; with ``dry_run`` only decide (nothing proposed, no state carried).

        Raises UnavailableError in safe mode (the registry cannot be reached).
        """
        return (await self.run_cycle(dry_run=dry_run)).result

    async def run_cycle(self, *, dry_run: bool, asked: bool = False) -> CycleReport:
        """:meth:`run_once` with the plan and what became of each decision. Not a dry run: the
        plan runs as a ``shedding`` operation; this returns once each move has started (or
        ended), within the settle timeout. ``asked``: an operator asked (Rebalance): the
        strategy's hit counts, which keep automatic shedding from chasing a spike, are not
        waited out."""
        async with self._lock:
            if not self._registry.reachable:
                raise UnavailableError("safe mode: the broker registry cannot be reached")
            now = self._clock.now_ms()
            snapshot = self._snapshot(now)
            if self._destinations is not None:
                reported = [b.bundle for top in snapshot.top_bundles.values() for b in top]
                rules = await self._destinations()
                snapshot = dataclasses.replace(
                    snapshot, allowed_destinations=rules.destinations(reported), move_rules=rules
                )
            config = self._config
            if asked:
                config = dataclasses.replace(
                    config,
                    hit_count_threshold=0,
                    avg_shedder_hit_count_low_threshold=1,
                    avg_shedder_hit_count_high_threshold=1,
                )
            result, state = self._strategy(snapshot, config, self._state, now, self._rng)
            plan = self._plan(result, snapshot, now)
            if dry_run:
                for decision in result.decisions:
                    _log.info("unload decision (dry run): %s", _describe(decision, result))
                if plan is not None:
                    self._tracker.keep_plan(plan)
                return CycleReport(result, (), (), plan)
            self._state = state
            report = await self._act(result, plan, now)
            self._record(report.proposed, now)
            if report.proposed:
                self._history.record_shedding(result, snapshot, strategy=self._strategy_name)
            self._metrics.observe_shedding(
                result,
                failed=[d for d, _ in report.dropped],
                target_std=self._config.target_std,
            )
            return report

    async def execute(self, plan_id: str) -> Operation:
        """Execute a plan a dry run kept (once); the operation. Its moves count as this
        strategy's own (grace period, cool-down, the planner's memory of unreported moves).

        NotFoundError for an unknown plan, PreconditionError for an expired one.
        """
        async with self._lock:  # not between a cycle's decision and its carried state
            return self._execute(plan_id)

    def _execute(self, plan_id: str) -> Operation:
        plan = self._tracker.take_plan(plan_id)
        now = self._clock.now_ms()
        decisions = tuple(
            UnloadDecision(m.bundle, m.src, m.dst, _reason(m.reason)) for m in plan.moves
        )
        self._record(decisions, now)
        self._state = dataclasses.replace(
            self._state,
            moves=self._state.moves
            + tuple(PastMove(m.bundle, m.src, m.dst, m.msg_throughput, now) for m in plan.moves),
        )
        return self._tracker.start_operation(
            OperationKind.PLAN,
            f"plan {plan.id} ({plan.strategy}): {len(plan.moves)} move(s), std "
            f"{plan.std_before:.3f} -> {plan.std_after:.3f} predicted",
            [m.copy() for m in plan.moves],
            plan_id=plan.id,
        )

    def snapshot(self) -> Scenario:
        """The cluster as the shedder sees it now, in the scenario format (``lbd ctl snapshot``)."""
        now = self._clock.now_ms()
        return Scenario(snapshot=self._snapshot(now), now_ms=now, config=self._config)

    def _plan(self, result: SheddingResult, snapshot: LoadSnapshot, now: int) -> Plan | None:
        if not result.decisions:
            return None
        spread = predicted_spread(snapshot, self._config, self._state, now, result.decisions)
        avg, before, after = spread if spread is not None else (result.avg, result.std, result.std)
        return Plan(
            id=self._tracker.new_id("plan"),
            strategy=self._strategy_name,
            moves=moves_of(result.decisions, snapshot),
            avg=avg,
            std_before=before,
            std_after=after,
            created_at_ms=now,
            expires_at_ms=now + int(self._operations.plan_ttl_s * 1000),
        )

    # -- snapshot -----------------------------------------------------------------------------

    def _snapshot(self, now: int) -> LoadSnapshot:
        self._forget_old_unloads(now)
        registered = set(self._registry.brokers())
        loads: dict[BrokerId, BrokerLoadData | None] = dict.fromkeys(registered)
        loads.update((b, data) for b, data in self._loads.brokers().items() if b in registered)
        tops: dict[BrokerId, tuple[BundleLoad, ...]] = {
            b: top.bundles for b, top in self._loads.top_bundles().items() if b in registered
        }
        return LoadSnapshot(
            brokers=loads,
            top_bundles=tops,
            owners=self._follower.table.holders(),
            recently_unloaded_bundles=dict(self._recent_bundles),
            recently_unloaded_brokers=dict(self._recent_brokers),
        )

    def _forget_old_unloads(self, now: int) -> None:
        # Past these ages an entry no longer changes any decision (grace period; cooldown against
        # load data no older than the TTL).
        bundle_age = self._config.bundle_grace_period_s * 1000
        broker_age = (self._config.cooldown_s + self._config.load_data_ttl_s) * 1000
        self._recent_bundles = {
            b: t for b, t in self._recent_bundles.items() if now - t < bundle_age
        }
        self._recent_brokers = {
            b: t for b, t in self._recent_brokers.items() if now - t < broker_age
        }

    # -- acting -------------------------------------------------------------------------------

    async def _act(self, result: SheddingResult, plan: Plan | None, now: int) -> CycleReport:
        if result.skip_reason is not None or plan is None:
            reason = "Unknown" if result.skip_reason is None else result.skip_reason.value
            said = (reason, result.notes)
            if said != self._last_skip:
                _log.info(
                    "shedding: no unload (%s), avg %.3f std %.3f%s",
                    reason,
                    result.avg,
                    result.std,
                    "".join(f"; {note}" for note in result.notes),
                )
            self._last_skip = said
            return CycleReport(result, (), ())
        self._last_skip = None
        for note in result.notes:
            _log.info("shedding: %s", note)
        op = self._tracker.start_operation(
            OperationKind.SHEDDING,
            f"shedding cycle ({self._strategy_name}): {len(plan.moves)} move(s), std "
            f"{plan.std_before:.3f} -> {plan.std_after:.3f} predicted",
            [m.copy() for m in plan.moves],
            plan_id=plan.id,
        )
        self._last_op = op
        with contextlib.suppress(TimeoutError):
            async with self._clock.timeout(self._settle_timeout_s):
                async for current in self._tracker.watch(op.id):
                    if all(m.state is not MoveState.PENDING for m in current.moves):
                        break
        proposed: list[UnloadDecision] = []
        dropped: list[tuple[UnloadDecision, str]] = []
        for decision, move in zip(result.decisions, op.moves, strict=True):
            line = _describe(decision, result)
            if move.state in (MoveState.IN_FLIGHT, MoveState.DONE):
                _log.info("unload decision: %s; proposed Releasing (%s)", line, op.id)
                proposed.append(decision)
            elif move.state is MoveState.PENDING:
                _log.info("unload decision: %s; waiting for the governor (%s)", line, op.id)
                proposed.append(decision)
            else:
                why = move.error or move.state.value
                _log.info("unload decision: %s; not proposed: %s", line, why)
                dropped.append((decision, why))
        return CycleReport(result, tuple(proposed), tuple(dropped), plan, op)

    def _record(self, decisions: tuple[UnloadDecision, ...], now: int) -> None:
        for decision in decisions:
            self._recent_bundles[decision.bundle] = now
            self._recent_brokers[decision.src] = now


def _reason(text: str) -> DecisionReason:
    """The decision reason a plan's move names (Admin when it names none of the strategy's)."""
    try:
        return DecisionReason(text)
    except ValueError:
        return DecisionReason.ADMIN


def _describe(decision: UnloadDecision, result: SheddingResult) -> str:
    """One line: the bundle, the move, the reason and the cluster's spread."""
    dst = decision.dst if decision.dst is not None else "-"
    return (
        f"bundle={decision.bundle} src={decision.src} dst={dst} reason={decision.reason.value} "
        f"avg={result.avg:.3f} std={result.std:.3f}"
    )
