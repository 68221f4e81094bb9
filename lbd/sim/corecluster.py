"""A deterministic cluster simulated in the core's own terms: no network, no clock, no threads.

Brokers report load computed from the bundles they own; bundles move only through state-channel
values applied by the core's resolver (:class:`~lbd.core.table.StateTable`); the leader runs a
shedding strategy over the same snapshot the real leader builds. It shows the core's decisions
converging a skewed cluster (a scale-up from a few brokers, then a hot namespace), and is what
``lbd demo`` draws until the sidecar and its local cluster exist.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from lbd.core.assign import BrokerCandidate, select_broker
from lbd.core.bundles import NamespaceBundles
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BrokerUsage, BundleLoad, ResourceUsage, ResourceWeights
from lbd.core.names import NamespaceName
from lbd.core.shedding import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    LoadSnapshot,
    ShedderState,
    UnloadDecision,
)
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, encode_value
from lbd.core.table import ChannelPosition, StateTable
from lbd.core.tuning import MB, AssignmentConfig, SheddingConfig

BROKER_CAPACITY_MB = 125.0
HOT_FACTOR = 8.0
"""Every simulated broker has a 1 Gbit/s NIC: 125 MB/s in and 125 MB/s out."""


@dataclass(frozen=True, slots=True)
class SimSpec:
    """The simulated cluster: its size, its load and its events."""

    brokers: int = 5
    initial_brokers: int = 2
    """Brokers up at the start; the others join at ``join_at_cycle`` (a scale-up)."""
    join_at_cycle: int = 2
    namespaces: int = 4
    bundles_per_namespace: int = 8
    utilisation: float = 0.45
    """Cluster-wide load once every broker is up (share of total capacity)."""
    hot_namespace_at_cycle: int = 40
    """At this cycle one namespace's traffic grows ``HOT_FACTOR`` times; 0 disables it."""
    step_s: int = 60
    """Simulated seconds between two cycles (one load report and one shedding run each)."""
    strategy: str = DEFAULT_STRATEGY
    shedding: SheddingConfig = field(default_factory=SheddingConfig)
    seed: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.initial_brokers <= self.brokers:
            raise ValueError("initial_brokers must be between 1 and brokers")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; known: {', '.join(STRATEGIES)}")


@dataclass(frozen=True, slots=True)
class BrokerRow:
    """One broker's state after a cycle."""

    broker: BrokerId
    bundles: int
    load: float
    """Weighted max usage EMA (0..1+), what the shedder sees."""
    throughput_mb: float
    """MB/s in plus out of the bundles it owns."""


@dataclass(frozen=True, slots=True)
class CycleReport:
    """What happened in one simulated cycle."""

    cycle: int
    now_ms: int
    brokers: tuple[BrokerRow, ...]
    avg: float
    std: float
    decisions: tuple[UnloadDecision, ...]
    skip_reason: str | None
    events: tuple[str, ...]
    moves_total: int


class CoreCluster:
    """The simulated cluster; :meth:`step` runs one cycle and reports it."""

    def __init__(self, spec: SimSpec) -> None:
        self.spec = spec
        self._rng = random.Random(spec.seed)
        self._weights = ResourceWeights()
        self._table = StateTable()
        self._entry = 0
        self._cycle = 0
        self.now_ms = 1_700_000_000_000
        self._moves = 0
        self._state = ShedderState()
        self._unloaded_bundles: dict[BundleId, int] = {}
        self._unloaded_brokers: dict[BrokerId, int] = {}
        self._all_brokers = [BrokerId(f"broker-{i + 1}") for i in range(spec.brokers)]
        self._up: list[BrokerId] = self._all_brokers[: spec.initial_brokers]
        self._load: dict[BrokerId, BrokerLoadData] = {}
        self._namespaces = [NamespaceName("tenant", f"ns-{i}") for i in range(spec.namespaces)]
        self._traffic: dict[BundleId, float] = {}
        capacity = spec.brokers * BROKER_CAPACITY_MB * MB * spec.utilisation
        bundles = [
            b.id
            for ns in self._namespaces
            for b in NamespaceBundles.default(ns, spec.bundles_per_namespace).bundles()
        ]
        weights = [self._rng.lognormvariate(0.0, 0.8) for _ in bundles]
        for bundle, w in zip(bundles, weights, strict=True):
            self._traffic[bundle] = capacity * w / sum(weights)

    @property
    def table(self) -> StateTable:
        """The channel table every sidecar of this cluster would materialise."""
        return self._table

    def owners(self) -> dict[BundleId, BrokerId]:
        """Owner of every Owned bundle."""
        return self._table.owners()

    def step(self) -> CycleReport:
        """One cycle: events, assignment of free bundles, load reports, one shedding run."""
        self._cycle += 1
        self.now_ms += self.spec.step_s * 1000
        events = self._events()
        self._assign_free_bundles()
        self._report_load()
        snapshot = self._snapshot()
        strategy = STRATEGIES[self.spec.strategy]
        result, self._state = strategy(
            snapshot, self.spec.shedding, self._state, self.now_ms, self._rng
        )
        for decision in result.decisions:
            self._apply(decision)
        self._moves += len(result.decisions)
        return CycleReport(
            cycle=self._cycle,
            now_ms=self.now_ms,
            brokers=self._rows(),
            avg=result.avg,
            std=result.std,
            decisions=result.decisions,
            skip_reason=None if result.skip_reason is None else str(result.skip_reason),
            events=events,
            moves_total=self._moves,
        )

    def _events(self) -> tuple[str, ...]:
        events: list[str] = []
        if self._cycle == self.spec.join_at_cycle and len(self._up) < len(self._all_brokers):
            joining = self._all_brokers[len(self._up) :]
            self._up.extend(joining)
            events.append(f"{len(joining)} broker(s) joined: {', '.join(joining)}")
        if self._cycle == self.spec.hot_namespace_at_cycle:
            hot = self._namespaces[0]
            for bundle in self._traffic:
                if bundle.startswith(f"{hot}/"):
                    self._traffic[bundle] *= HOT_FACTOR
            events.append(f"namespace {hot} got {HOT_FACTOR:g}x traffic")
        return tuple(events)

    def _write(
        self,
        bundle: BundleId,
        state: ServiceUnitState,
        dst_broker: BrokerId | None = None,
        source_broker: BrokerId | None = None,
    ) -> None:
        """Propose the next version of ``bundle`` and apply it as the channel would."""
        current = self._table.get(bundle)
        value = ServiceUnitStateData(
            state=state,
            version_id=1 if current is None else current.version_id + 1,
            dst_broker=dst_broker,
            source_broker=source_broker,
            timestamp_ms=self.now_ms,
        )
        self._entry += 1
        self._table.apply(ChannelPosition(0, self._entry), bundle, encode_value(value))

    def _assign_free_bundles(self) -> None:
        owners = self.owners()
        candidates = [BrokerCandidate(b, "sim", 0) for b in self._up]
        for bundle in self._traffic:
            if bundle in owners:
                continue
            selection = select_broker(bundle, candidates, self._load, AssignmentConfig(), self._rng)
            if selection.broker is None:
                continue
            self._write(bundle, ServiceUnitState.Assigning, dst_broker=selection.broker)
            self._write(bundle, ServiceUnitState.Owned, dst_broker=selection.broker)
            owners[bundle] = selection.broker

    def _apply(self, decision: UnloadDecision) -> None:
        """Carry out a decision through the channel, as the sidecars would (DESIGN §4 flows)."""
        src, dst = decision.src, decision.dst
        self._write(decision.bundle, ServiceUnitState.Releasing, dst_broker=dst, source_broker=src)
        if dst is None:
            self._write(decision.bundle, ServiceUnitState.Free, source_broker=src)
        else:
            self._write(
                decision.bundle, ServiceUnitState.Assigning, dst_broker=dst, source_broker=src
            )
            self._write(decision.bundle, ServiceUnitState.Owned, dst_broker=dst, source_broker=src)
        self._unloaded_bundles[decision.bundle] = self.now_ms
        self._unloaded_brokers[src] = self.now_ms

    def _owned_by(self) -> dict[BrokerId, list[BundleId]]:
        owned: dict[BrokerId, list[BundleId]] = {b: [] for b in self._up}
        for bundle, owner in self.owners().items():
            owned.setdefault(owner, []).append(bundle)
        return owned

    def _report_load(self) -> None:
        capacity = BROKER_CAPACITY_MB * MB
        for broker, bundles in self._owned_by().items():
            bytes_in = sum(self._traffic[b] for b in bundles) / 2
            usage = BrokerUsage(
                # CPU follows traffic at 80% of the NIC's share, so bandwidth dominates the load.
                cpu=ResourceUsage(80.0 * bytes_in / capacity, 100.0),
                bandwidth_in=ResourceUsage(bytes_in / MB, capacity / MB),
                bandwidth_out=ResourceUsage(bytes_in / MB, capacity / MB),
                msg_throughput_in=bytes_in,
                msg_throughput_out=bytes_in,
                bundle_count=len(bundles),
            )
            previous = self._load.get(broker, BrokerLoadData(broker=broker))
            self._load[broker] = previous.update(usage, self._weights, self.now_ms)

    def _snapshot(self) -> LoadSnapshot:
        top: dict[BrokerId, tuple[BundleLoad, ...]] = {}
        for broker, bundles in self._owned_by().items():
            loads = [BundleLoad(b, self._traffic[b] / 2, self._traffic[b] / 2) for b in bundles]
            top[broker] = tuple(sorted(loads, key=lambda x: x.msg_throughput))
        brokers: Mapping[BrokerId, BrokerLoadData | None] = {b: self._load.get(b) for b in self._up}
        return LoadSnapshot(
            brokers=brokers,
            top_bundles=top,
            owners=self.owners(),
            recently_unloaded_bundles=dict(self._unloaded_bundles),
            recently_unloaded_brokers=dict(self._unloaded_brokers),
        )

    def _rows(self) -> tuple[BrokerRow, ...]:
        rows = []
        for broker, bundles in sorted(self._owned_by().items()):
            load = self._load.get(broker)
            rows.append(
                BrokerRow(
                    broker=broker,
                    bundles=len(bundles),
                    load=0.0 if load is None else load.weighted_max_ema,
                    throughput_mb=sum(self._traffic[b] for b in bundles) / MB,
                )
            )
        return tuple(rows)
