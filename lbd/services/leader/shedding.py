"""The unload scheduler: the leader's shedder over a snapshot of the cluster (DESIGN §7).

Each cycle (every ``shedding.interval_s`` while leading, or on demand for the Rebalance RPC):

1. snapshot: the registered brokers (none: ``NoBrokers``), their latest load data and top bundles
   from the load topics (within ``load_data_ttl_s``), who holds each bundle in the channel table,
   the leader's own record of recent unloads, and for each reported bundle a placement rule
   binds (isolation, anti-affinity) the brokers it may move to;
2. decide: the configured strategy (:data:`lbd.core.shedding.STRATEGIES`), carrying its state
   (hit counts) from the previous cycle;
3. act: for each decision whose bundle is still ``Owned`` by its source, propose
   ``Releasing(dst, src)`` (``dst`` None: a plain unload); the source's sidecar does the rest.

Each decision is logged once, as one line with its reason. A dry run decides without acting and
without touching the carried state. In safe mode (the registry cannot be reached) no cycle runs:
the snapshot would rest on a registry that may be stale.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from lbd.core.errors import LbdError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BundleLoad
from lbd.core.shedding import (
    STRATEGIES,
    LoadSnapshot,
    Scenario,
    ShedderState,
    SheddingResult,
    UnloadDecision,
)
from lbd.core.state import ServiceUnitState
from lbd.core.tuning import SheddingConfig
from lbd.metrics import FAILURE, UNKNOWN_REASON, Metrics
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.ports.history import HistoryRecorder
from lbd.services.channel.follower import ChannelFollower
from lbd.services.channel.proposals import Proposer
from lbd.services.cluster.loads import LoadView
from lbd.services.cluster.registry import BrokerRegistry

_log = logging.getLogger(__name__)

MoveDestinations = Callable[[Iterable[BundleId]], Awaitable[Mapping[BundleId, frozenset[BrokerId]]]]
"""Where each of some bundles may move (``Assigner.move_destinations``)."""


@dataclass(frozen=True, slots=True)
class CycleReport:
    """What a cycle did beyond the strategy's result: the decisions proposed and those dropped."""

    result: SheddingResult
    proposed: tuple[UnloadDecision, ...]
    dropped: tuple[tuple[UnloadDecision, str], ...]
    """Decisions not acted on, with why (the bundle moved meanwhile, the channel was down)."""


class UnloadScheduler:
    """Runs the shedding strategy over the cluster's load and proposes the unloads it decides."""

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
        destinations: MoveDestinations | None = None,
    ) -> None:
        """Runs ``strategy`` (a key of :data:`lbd.core.shedding.STRATEGIES`) every
        ``interval_s`` while leading; ``destinations`` gives the placement rules of the
        reported bundles (none: every bundle may go anywhere)."""
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
        self._state = ShedderState()
        self._recent_bundles: dict[BundleId, int] = {}
        self._recent_brokers: dict[BrokerId, int] = {}
        self._last_skip: str | None = None
        self._lock = asyncio.Lock()

    @property
    def state(self) -> ShedderState:
        """The strategy's state carried into the next cycle."""
        return self._state

    async def run_leading(self, term: int) -> None:
        """The leader duty: a cycle every interval until cancelled."""
        while True:
            await self._clock.sleep(self._interval_s)
            try:
                await self.run_once(dry_run=False)
            except UnavailableError as e:
                _log.warning("shedding cycle skipped: %s", e)
            except Exception:
                # A strategy bug must not end the leader's other duties; Pulsar counts it too.
                _log.exception("shedding cycle failed")
                self._metrics.unload_total.labels(result=FAILURE, reason=UNKNOWN_REASON).inc()

    async def run_once(self, *, dry_run: bool) -> SheddingResult:
        """One cycle now; with ``dry_run`` only decide (nothing proposed, no state carried).

        Raises UnavailableError in safe mode (the registry cannot be reached).
        """
        return (await self.run_cycle(dry_run=dry_run)).result

    async def run_cycle(self, *, dry_run: bool) -> CycleReport:
        """:meth:`run_once` with what became of each decision."""
        async with self._lock:
            if not self._registry.reachable:
                raise UnavailableError("safe mode: the broker registry cannot be reached")
            now = self._clock.now_ms()
            snapshot = self._snapshot(now)
            if self._destinations is not None:
                reported = [b.bundle for top in snapshot.top_bundles.values() for b in top]
                snapshot = dataclasses.replace(
                    snapshot, allowed_destinations=await self._destinations(reported)
                )
            result, state = self._strategy(snapshot, self._config, self._state, now, self._rng)
            if dry_run:
                for decision in result.decisions:
                    _log.info("unload decision (dry run): %s", _describe(decision, result))
                return CycleReport(result, (), ())
            self._state = state
            report = await self._act(result, now)
            self._record(report.proposed, now)
            if report.proposed:
                self._history.record_shedding(result, snapshot, strategy=self._strategy_name)
            self._metrics.observe_shedding(result, failed=[d for d, _ in report.dropped])
            return report

    def snapshot(self) -> Scenario:
        """The cluster as the shedder sees it now, in the scenario format (``lbd ctl snapshot``)."""
        now = self._clock.now_ms()
        return Scenario(snapshot=self._snapshot(now), now_ms=now, config=self._config)

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

    async def _act(self, result: SheddingResult, now: int) -> CycleReport:
        if result.skip_reason is not None:
            if result.skip_reason.value != self._last_skip:
                _log.info(
                    "shedding: no unload (%s), avg %.3f std %.3f",
                    result.skip_reason.value,
                    result.avg,
                    result.std,
                )
            self._last_skip = result.skip_reason.value
            return CycleReport(result, (), ())
        self._last_skip = None
        proposed: list[UnloadDecision] = []
        dropped: list[tuple[UnloadDecision, str]] = []
        for decision in result.decisions:
            why_not = await self._propose(decision)
            line = _describe(decision, result)
            if why_not is None:
                _log.info("unload decision: %s; proposed Releasing", line)
                proposed.append(decision)
            else:
                _log.info("unload decision: %s; not proposed: %s", line, why_not)
                dropped.append((decision, why_not))
        return CycleReport(result, tuple(proposed), tuple(dropped))

    async def _propose(self, decision: UnloadDecision) -> str | None:
        """Propose the decision's Releasing; None when proposed, else why not."""
        current = self._follower.get(decision.bundle)
        if current is None or current.state is not ServiceUnitState.Owned:
            state = "Init" if current is None else current.state.value
            return f"the bundle is {state} now, not Owned"
        if current.dst_broker != decision.src:
            return f"the bundle is Owned by {current.dst_broker} now"
        try:
            await self._proposer.propose(
                decision.bundle, ServiceUnitState.Releasing, dst=decision.dst, src=decision.src
            )
        except LbdError as e:
            return f"the proposal failed: {e}"
        return None

    def _record(self, decisions: tuple[UnloadDecision, ...], now: int) -> None:
        for decision in decisions:
            self._recent_bundles[decision.bundle] = now
            self._recent_brokers[decision.src] = now


def _describe(decision: UnloadDecision, result: SheddingResult) -> str:
    """One line: the bundle, the move, the reason and the cluster's spread."""
    dst = decision.dst if decision.dst is not None else "-"
    return (
        f"bundle={decision.bundle} src={decision.src} dst={dst} reason={decision.reason.value} "
        f"avg={result.avg:.3f} std={result.std:.3f}"
    )
