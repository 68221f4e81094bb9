"""The balancing scenario suite's driver: a scenario played on the load model, cycle by cycle.

Each cycle is one load-report interval and one shedding run (``step_s`` simulated seconds) of
:class:`~lbd.workload.model.LoadModel`:

1. the scenario's events (brokers join or leave, traffic changes) take effect;
2. bundles without an owner (a left broker's, or unloaded without a destination) are placed as
   the next lookup would place them;
3. every broker reports its carried load into its EMA;
4. the leader runs the strategy over the snapshot it would build, and every decision is carried
   out at once.

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

from lbd.core.assign import PlacementRules
from lbd.core.balance_metrics import ping_pongs
from lbd.core.bundles import parse_bundle_id
from lbd.core.ids import BrokerId, BundleId
from lbd.core.names import NamespaceName
from lbd.core.namespace import NamespacePolicies
from lbd.core.settings import MB, SheddingConfig
from lbd.core.shedding import STRATEGIES, SheddingResult, mean_and_std
from lbd.core.shedding.planner import PING_PONG_WINDOW_MS
from lbd.workload.model import LoadModel, Move, moves_per_broker

NOISE = 0.03
"""Standard deviation of the per-cycle multiplicative noise on each bundle's traffic."""
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
    ema_only: frozenset[BrokerId] = frozenset()
    """Brokers (up at the start or joining later) whose reports carry only the EMAs."""
    report_every: Mapping[BrokerId, int] = field(default_factory=dict)
    """Brokers that report only every this many cycles (the others report every cycle)."""
    policies: Mapping[NamespaceName, NamespacePolicies] = field(default_factory=dict)
    """Placement rules (isolation, anti-affinity) of the namespaces that have any."""
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
    disturbed_at: tuple[int, ...] = ()
    """The cycles of the disturbances (0 for a skewed start)."""
    forbidden_moves: int = 0
    """Transfers to a broker the placement rules did not allow then."""

    @property
    def minutes_to_target(self) -> float | None:
        """:attr:`cycles_to_target` in simulated minutes."""
        if self.cycles_to_target is None:
            return None
        return self.cycles_to_target * self.step_s / 60


@dataclass(frozen=True, slots=True)
class Cycle:
    """What one cycle of :class:`BalanceSim` did, in order: the placements of unloaded bundles,
    the reports (in the model's ``loads``), the shedding run and the moves it made."""

    std: float
    """The std of the carried load after the moves."""
    placed: tuple[Move, ...]
    """Bundles unloaded by an earlier cycle, placed as the next lookup would place them."""
    shed: SheddingResult
    moved: tuple[Move, ...]
    """The shedding run's decisions as carried out."""


class BalanceSim:
    """One scenario under one strategy on the load model; :meth:`run` plays it to the end."""

    def __init__(
        self,
        scenario: BalanceScenario,
        strategy: str,
        config: SheddingConfig,
        seed: int = 1,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
        self.scenario = scenario
        self.strategy_name = strategy
        self.config = config
        self.model = LoadModel(
            scenario.brokers,
            scenario.traffic,
            scenario.placement,
            seed=seed,
            rules=PlacementRules(scenario.policies),
        )
        self.model.ema_only.update(scenario.ema_only)
        self.model.report_every_s.update(
            (b, n * scenario.step_s) for b, n in scenario.report_every.items()
        )
        self._noise = random.Random(seed * 7919 + 1)
        self._factor: dict[NamespaceName, float] = {}
        self._namespace = {b: parse_bundle_id(b).namespace for b in scenario.traffic}
        self._start_ms = self.model.now_ms
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
        """One cycle; the std of the carried load after its moves."""
        return self.cycle(cycle).std

    def cycle(self, cycle: int) -> Cycle:
        """One cycle, and what it did (``lbd analytics synth --generated`` records it)."""
        model = self.model
        model.advance(self.scenario.step_s)
        for event in self.scenario.events:
            if event.at == cycle:
                self._apply_event(event)
        self._update_traffic()
        placed = model.place_orphans()
        model.report()
        shed = model.shed(self.strategy_name, self.config)
        moved = model.apply(shed.decisions)
        self._count_moves(placed + moved)
        std = mean_and_std(model.carried().values())[1]
        return Cycle(std, tuple(placed), shed, tuple(moved))

    def actual_loads(self) -> dict[BrokerId, float]:
        """Each broker's load now: the traffic it carries over its capacity."""
        return self.model.carried()

    # -- the world ------------------------------------------------------------------------------

    def _apply_event(self, event: Event) -> None:
        for broker, capacity in event.join.items():
            self.model.join(broker, capacity)
        for broker in event.leave:
            self.model.leave(broker)
        for namespace, factor in event.traffic.items():
            self._factor[namespace] = self._factor.get(namespace, 1.0) * factor

    def _update_traffic(self) -> None:
        seasonal = self.scenario.seasonal
        elapsed_s = (self.model.now_ms - self._start_ms) // 1000
        for bundle, base in self.scenario.traffic.items():
            namespace = self._namespace[bundle]
            factor = self._factor.get(namespace, 1.0)
            if seasonal is not None:
                factor *= seasonal(namespace, elapsed_s)
            noise = max(0.5, self._noise.gauss(1.0, NOISE))
            self.model.traffic[bundle] = base * factor * noise

    def _count_moves(self, moves: list[Move]) -> None:
        if moves:
            most = max(moves_per_broker(moves).values())
            self.max_moves_per_broker = max(self.max_moves_per_broker, most)

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
        unloads = [m for m in self.model.moves if m.src is not None]
        tail = series[-FINAL_CYCLES:]
        return RunResult(
            scenario=self.scenario.name,
            strategy=self.strategy_name,
            disturbances=len(disturbances),
            cycles_to_target=worst if disturbances else None,
            minutes_over_target=over * self.scenario.step_s / 60,
            final_std=math.fsum(tail) / len(tail),
            moves=len(unloads),
            moved_mb=sum(m.throughput for m in unloads) / MB,
            ping_pongs=ping_pongs(self._move_log(), PING_PONG_WINDOW_MS),
            max_moves_per_broker=self.max_moves_per_broker,
            std_series=tuple(series),
            step_s=self.scenario.step_s,
            disturbed_at=tuple(disturbances),
            forbidden_moves=len(self.model.forbidden),
        )

    def _move_log(self) -> list[tuple[int, str, str | None, str | None]]:
        """Every move as ping_pongs reads it: a departure, then an arrival."""
        log: list[tuple[int, str, str | None, str | None]] = []
        for move in self.model.moves:
            if move.src is not None:
                log.append((move.at_ms, move.bundle, move.src, None))
            if move.dst is not None:
                log.append((move.at_ms, move.bundle, None, move.dst))
        return log
