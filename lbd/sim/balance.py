"""A load model for comparing shedding strategies: moving a bundle moves its load.

Each cycle is one load-report interval and one shedding run (``step_s`` simulated seconds):

1. the scenario's events (brokers join or leave, traffic changes) take effect;
2. bundles without an owner (a left broker's, or unloaded without a destination) are placed by the
   core's ``least_resource_usage_with_weight``, as the next lookup would place them;
3. every broker reports: its raw usage is its bundles' traffic over its network capacity (CPU at
   80% of that share), folded into the EMA as a real sidecar folds it; its ten busiest bundles
   (``load_report.top_bundles``) go in the top-bundles report;
4. the leader runs the strategy over the snapshot it would build (registered brokers, reports,
   the ownership table, its record of recent unloads) and every decision is carried out at once.

Bundle traffic is the scenario's base traffic times its namespace's factor at that time, times a
small seeded noise per bundle and cycle. What is measured (:class:`RunResult`) is the spread of the
load the brokers actually carry (traffic over capacity), not of the EMA the strategies see: the EMA
converges to it, and it is what clients feel.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from lbd.core.assign import BrokerCandidate, select_broker
from lbd.core.balance_metrics import ping_pongs
from lbd.core.bundles import parse_bundle_id
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BrokerUsage, BundleLoad, ResourceUsage, ResourceWeights
from lbd.core.names import NamespaceName
from lbd.core.shedding import STRATEGIES, LoadSnapshot, ShedderState, mean_and_std
from lbd.core.tuning import MB, AssignmentConfig, SheddingConfig
from lbd.services.sidecar.loadreport import top_bundles

TOP_BUNDLES = 10
"""Bundles per top-bundles report (the ``load_report.top_bundles`` default)."""
NOISE = 0.03
"""Standard deviation of the per-cycle multiplicative noise on each bundle's traffic."""
PING_PONG_WINDOW_S = 3600
"""A bundle arriving at a broker it left less than this ago is a ping-pong."""
FINAL_CYCLES = 10
"""The final std is the mean over this many last cycles."""


@dataclass(frozen=True, slots=True)
class Event:
    """What happens at the start of cycle ``at``."""

    at: int
    join: Mapping[BrokerId, float] = field(default_factory=dict)
    """Brokers joining, with their network capacity (MB/s each way)."""
    leave: tuple[BrokerId, ...] = ()
    traffic: Mapping[NamespaceName, float] = field(default_factory=dict)
    """Namespaces whose traffic is multiplied by this factor from now on."""
    disturbs: bool = True
    """Whether the time back under target is measured from this event."""


@dataclass(frozen=True, slots=True)
class BalanceScenario:
    """A cluster, its bundles, and what happens to it."""

    name: str
    description: str
    brokers: Mapping[BrokerId, float]
    """Brokers up at the start, with their network capacity (MB/s each way)."""
    traffic: Mapping[BundleId, float]
    """Each bundle's base traffic (bytes/s in plus out)."""
    placement: Mapping[BundleId, BrokerId]
    """Each bundle's owner at the start."""
    cycles: int
    events: tuple[Event, ...] = ()
    seasonal: Callable[[NamespaceName, int], float] | None = None
    """A namespace's traffic factor at a time (seconds since the start), e.g. a daily swing."""
    disturbed_at_start: bool = False
    """Whether the time to target is measured from the start (a skewed initial placement)."""
    step_s: int = 60


@dataclass(frozen=True, slots=True)
class RunResult:
    """One scenario run under one strategy."""

    scenario: str
    strategy: str
    disturbances: int
    """Events (or a skewed start) after which the time back under target is measured."""
    cycles_to_target: int | None
    """The most shedding cycles any disturbance took to bring the std under target, counting the
    cycle of the disturbance (None: one never did before the next disturbance or the end, or
    there was no disturbance)."""
    minutes_over_target: float
    final_std: float
    moves: int
    moved_mb: float
    """Traffic of the moved bundles at the time they moved, MB/s."""
    ping_pongs: int
    max_moves_per_broker: int
    """The most moves (in plus out) one broker took in one cycle."""
    std_series: tuple[float, ...]
    step_s: int

    @property
    def minutes_to_target(self) -> float | None:
        """:attr:`cycles_to_target` in simulated minutes."""
        if self.cycles_to_target is None:
            return None
        return self.cycles_to_target * self.step_s / 60


class BalanceSim:
    """One scenario under one strategy; :meth:`run` plays it to the end."""

    def __init__(
        self,
        scenario: BalanceScenario,
        strategy: str,
        config: SheddingConfig,
        seed: int = 1,
    ) -> None:
        self.scenario = scenario
        self.strategy_name = strategy
        self._strategy = STRATEGIES[strategy]
        self.config = config
        self._rng = random.Random(seed)
        self._noise = random.Random(seed * 7919 + 1)
        self._weights = ResourceWeights()
        self.capacity: dict[BrokerId, float] = dict(scenario.brokers)
        self.owners: dict[BundleId, BrokerId] = dict(scenario.placement)
        self._factor: dict[NamespaceName, float] = {}
        self._namespace = {b: parse_bundle_id(b).namespace for b in scenario.traffic}
        self.traffic: dict[BundleId, float] = dict(scenario.traffic)
        self._load: dict[BrokerId, BrokerLoadData] = {}
        self._state = ShedderState()
        self._unloaded_bundles: dict[BundleId, int] = {}
        self._unloaded_brokers: dict[BrokerId, int] = {}
        self.now_ms = 1_700_000_000_000
        self._start_ms = self.now_ms
        self._move_log: list[tuple[int, str, str | None, str | None]] = []
        self._awaiting: set[BundleId] = set()
        """Bundles unloaded without a destination, whose placement is the arrival of a move."""
        self.moves = 0
        self.moved_bytes = 0.0
        self.max_moves_per_broker = 0

    def run(self) -> RunResult:
        """Every cycle of the scenario; the measurements."""
        series: list[float] = []
        disturbances: list[int] = [0] if self.scenario.disturbed_at_start else []
        for cycle in range(self.scenario.cycles):
            disturbances += [cycle for e in self.scenario.events if e.at == cycle and e.disturbs]
            series.append(self.step(cycle))
        return self._result(series, disturbances)

    def step(self, cycle: int) -> float:
        """One cycle; the std of the actual load after its moves."""
        self.now_ms += self.scenario.step_s * 1000
        for event in self.scenario.events:
            if event.at == cycle:
                self._apply_event(event)
        self._update_traffic()
        self._place_orphans()
        self._report()
        self._shed()
        return mean_and_std(self.actual_loads().values())[1]

    def actual_loads(self) -> dict[BrokerId, float]:
        """Each broker's load now: the traffic it carries over its capacity."""
        carried = dict.fromkeys(self.capacity, 0.0)
        for bundle, owner in self.owners.items():
            carried[owner] += self.traffic[bundle]
        return {b: t / 2 / (self.capacity[b] * MB) for b, t in carried.items()}

    # -- the world ------------------------------------------------------------------------------

    def _apply_event(self, event: Event) -> None:
        self.capacity.update(event.join)
        for broker in event.leave:
            del self.capacity[broker]
            self._load.pop(broker, None)
            for bundle in [b for b, o in self.owners.items() if o == broker]:
                del self.owners[bundle]
        for namespace, factor in event.traffic.items():
            self._factor[namespace] = self._factor.get(namespace, 1.0) * factor

    def _update_traffic(self) -> None:
        seasonal = self.scenario.seasonal
        elapsed_s = (self.now_ms - self._start_ms) // 1000
        for bundle, base in self.scenario.traffic.items():
            namespace = self._namespace[bundle]
            factor = self._factor.get(namespace, 1.0)
            if seasonal is not None:
                factor *= seasonal(namespace, elapsed_s)
            noise = max(0.5, self._noise.gauss(1.0, NOISE))
            self.traffic[bundle] = base * factor * noise

    def _place_orphans(self) -> None:
        candidates = [BrokerCandidate(b) for b in sorted(self.capacity)]
        for bundle in self.scenario.traffic:
            if bundle in self.owners:
                continue
            selection = select_broker(bundle, candidates, self._load, AssignmentConfig(), self._rng)
            if selection.broker is None:
                continue
            self.owners[bundle] = selection.broker
            if bundle in self._awaiting:
                self._awaiting.remove(bundle)
                self._move_log.append((self.now_ms, bundle, None, selection.broker))
                self._count_moves({selection.broker: 1})

    def _report(self) -> None:
        owned: dict[BrokerId, list[BundleId]] = {b: [] for b in self.capacity}
        for bundle, owner in self.owners.items():
            owned[owner].append(bundle)
        for broker, bundles in owned.items():
            capacity = self.capacity[broker]
            each_way = sum(self.traffic[b] for b in bundles) / 2
            usage = BrokerUsage(
                cpu=ResourceUsage(80.0 * each_way / (capacity * MB), 100.0),
                bandwidth_in=ResourceUsage(each_way / MB, capacity),
                bandwidth_out=ResourceUsage(each_way / MB, capacity),
                msg_throughput_in=each_way,
                msg_throughput_out=each_way,
                bundle_count=len(bundles),
            )
            previous = self._load.get(broker, BrokerLoadData(broker=broker))
            self._load[broker] = previous.update(usage, self._weights, self.now_ms)

    def _snapshot(self) -> LoadSnapshot:
        tops: dict[BrokerId, tuple[BundleLoad, ...]] = {}
        owned: dict[BrokerId, list[BundleLoad]] = {b: [] for b in self.capacity}
        for bundle, owner in self.owners.items():
            t = self.traffic[bundle]
            owned[owner].append(BundleLoad(bundle, t / 2, t / 2))
        for broker, loads in owned.items():
            tops[broker] = top_bundles(tuple(loads), TOP_BUNDLES)
        return LoadSnapshot(
            brokers={b: self._load.get(b) for b in self.capacity},
            top_bundles=tops,
            owners=dict(self.owners),
            recently_unloaded_bundles=dict(self._unloaded_bundles),
            recently_unloaded_brokers=dict(self._unloaded_brokers),
        )

    def _shed(self) -> None:
        result, self._state = self._strategy(
            self._snapshot(), self.config, self._state, self.now_ms, self._rng
        )
        per_broker: dict[BrokerId, int] = {}
        for d in result.decisions:
            if self.owners.get(d.bundle) != d.src:
                continue
            self.moves += 1
            self.moved_bytes += self.traffic[d.bundle]
            self._unloaded_bundles[d.bundle] = self.now_ms
            self._unloaded_brokers[d.src] = self.now_ms
            per_broker[d.src] = per_broker.get(d.src, 0) + 1
            self._move_log.append((self.now_ms, d.bundle, d.src, None))
            if d.dst is None or d.dst not in self.capacity:
                del self.owners[d.bundle]
                self._awaiting.add(d.bundle)
            else:
                self.owners[d.bundle] = d.dst
                per_broker[d.dst] = per_broker.get(d.dst, 0) + 1
                self._move_log.append((self.now_ms, d.bundle, None, d.dst))
        self._count_moves(per_broker)

    def _count_moves(self, per_broker: Mapping[BrokerId, int]) -> None:
        if per_broker:
            self.max_moves_per_broker = max(self.max_moves_per_broker, max(per_broker.values()))

    # -- measurements ---------------------------------------------------------------------------

    def _result(self, series: Sequence[float], disturbances: Sequence[int]) -> RunResult:
        target = self.config.target_std
        worst: int | None = 0
        for i, start in enumerate(disturbances):
            end = disturbances[i + 1] if i + 1 < len(disturbances) else len(series)
            back = next((c for c in range(start, end) if series[c] <= target), None)
            if back is None:
                worst = None
                break
            assert worst is not None
            worst = max(worst, back - start + 1)
        over = sum(1 for std in series if std > target)
        tail = series[-FINAL_CYCLES:]
        return RunResult(
            scenario=self.scenario.name,
            strategy=self.strategy_name,
            disturbances=len(disturbances),
            cycles_to_target=worst if disturbances else None,
            minutes_over_target=over * self.scenario.step_s / 60,
            final_std=math.fsum(tail) / len(tail),
            moves=self.moves,
            moved_mb=self.moved_bytes / MB,
            ping_pongs=ping_pongs(self._move_log, PING_PONG_WINDOW_S * 1000),
            max_moves_per_broker=self.max_moves_per_broker,
            std_series=tuple(series),
            step_s=self.scenario.step_s,
        )
