"""The cluster ``lbd demo`` draws: the load model, its moves carried out through the channel.

A deterministic cluster in the core's own terms (no network, no clock, no threads): the load model
(:class:`~lbd.workload.model.LoadModel`) reports and sheds, and every move it makes is written as
the state-channel values the sidecars would write, applied by the core's resolver
(:class:`~lbd.core.table.StateTable`), so the channel's table and the model's owners agree after
every cycle. It shows a skewed cluster converging: a scale-up from a few brokers, then a hot
namespace. Each cycle reports two spreads: the std of the load the brokers carry (what clients
feel) and the std of the EMA the shedder sees (what it acts on); the second lags the first.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from lbd.core.bundles import NamespaceBundles
from lbd.core.ids import BrokerId, BundleId
from lbd.core.names import NamespaceName
from lbd.core.settings import MB, SheddingConfig
from lbd.core.shedding import DEFAULT_STRATEGY, STRATEGIES, UnloadDecision
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, encode_value
from lbd.core.table import ChannelPosition, StateTable
from lbd.workload.model import LoadModel, Move

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
    carried: float
    """The load it carries now (traffic over capacity, 0..1+), what its clients feel."""
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
    """Std of the load EMAs, as the shedder computed it (0 when it did not run)."""
    carried_std: float
    """Std of the load the brokers carry after the cycle's moves."""
    decisions: tuple[UnloadDecision, ...]
    skip_reason: str | None
    events: tuple[str, ...]
    moves_total: int
    notes: tuple[str, ...] = ()
    """What the strategy could not read from the reports and how it decided instead."""


class CoreCluster:
    """The simulated cluster; :meth:`step` runs one cycle and reports it."""

    def __init__(self, spec: SimSpec) -> None:
        self.spec = spec
        rng = random.Random(spec.seed)
        self._table = StateTable()
        self._entry = 0
        self._cycle = 0
        self._moves = 0
        self._all_brokers = [BrokerId(f"broker-{i + 1}") for i in range(spec.brokers)]
        self._namespaces = [NamespaceName("tenant", f"ns-{i}") for i in range(spec.namespaces)]
        capacity = spec.brokers * BROKER_CAPACITY_MB * MB * spec.utilisation
        bundles = [
            b.id
            for ns in self._namespaces
            for b in NamespaceBundles.default(ns, spec.bundles_per_namespace).bundles()
        ]
        weights = [rng.lognormvariate(0.0, 0.8) for _ in bundles]
        traffic = {b: capacity * w / sum(weights) for b, w in zip(bundles, weights, strict=True)}
        up = {b: BROKER_CAPACITY_MB for b in self._all_brokers[: spec.initial_brokers]}
        self.model = LoadModel(up, traffic, seed=spec.seed)

    @property
    def now_ms(self) -> int:
        return self.model.now_ms

    @property
    def table(self) -> StateTable:
        """The channel table every sidecar of this cluster would materialise."""
        return self._table

    def owners(self) -> dict[BundleId, BrokerId]:
        """Owner of every Owned bundle."""
        return self._table.owners()

    def step(self) -> CycleReport:
        """One cycle: events, assignment of free bundles, load reports, one shedding run."""
        model = self.model
        self._cycle += 1
        model.advance(self.spec.step_s)
        events = self._events()
        for move in model.place_orphans():
            self._write_move(move)
        for bundle, broker in sorted(model.owners.items()):
            if self._table.get(bundle) is None:  # a first placement
                self._write(bundle, ServiceUnitState.Assigning, dst_broker=broker)
                self._write(bundle, ServiceUnitState.Owned, dst_broker=broker)
        model.report()
        result = model.shed(self.spec.strategy, self.spec.shedding)
        for move in model.apply(result.decisions):
            self._write_move(move)
        self._moves += len(result.decisions)
        return CycleReport(
            cycle=self._cycle,
            now_ms=model.now_ms,
            brokers=self._rows(),
            avg=result.avg,
            std=result.std,
            carried_std=model.stds()[0],
            decisions=result.decisions,
            skip_reason=None if result.skip_reason is None else str(result.skip_reason),
            events=events,
            moves_total=self._moves,
            notes=result.notes,
        )

    def _events(self) -> tuple[str, ...]:
        events: list[str] = []
        up = self.model.capacity
        if self._cycle == self.spec.join_at_cycle and len(up) < len(self._all_brokers):
            joining = self._all_brokers[len(up) :]
            for broker in joining:
                self.model.join(broker, BROKER_CAPACITY_MB)
            events.append(f"{len(joining)} broker(s) joined: {', '.join(joining)}")
        if self._cycle == self.spec.hot_namespace_at_cycle:
            hot = self._namespaces[0]
            traffic = self.model.traffic
            for bundle in traffic:
                if bundle.startswith(f"{hot}/"):
                    traffic[bundle] *= HOT_FACTOR
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
            timestamp_ms=self.model.now_ms,
        )
        self._entry += 1
        self._table.apply(ChannelPosition(0, self._entry), bundle, encode_value(value))

    def _write_move(self, move: Move) -> None:
        """The channel values of a move, as the sidecars would write them (DESIGN §4 flows): an
        unload ends Free, a transfer or a placement Owned by its destination."""
        bundle, src, dst = move.bundle, move.src, move.dst
        if src is not None:
            self._write(bundle, ServiceUnitState.Releasing, dst_broker=dst, source_broker=src)
            if dst is None:
                self._write(bundle, ServiceUnitState.Free, source_broker=src)
                return
        assert dst is not None
        self._write(bundle, ServiceUnitState.Assigning, dst_broker=dst, source_broker=src)
        self._write(bundle, ServiceUnitState.Owned, dst_broker=dst, source_broker=src)

    def _rows(self) -> tuple[BrokerRow, ...]:
        model = self.model
        seen, carried = model.seen(), model.carried()
        return tuple(
            BrokerRow(
                broker=broker,
                bundles=len(bundles),
                load=seen[broker],
                carried=carried[broker],
                throughput_mb=sum(model.traffic[b] for b in bundles) / MB,
            )
            for broker, bundles in sorted(model.owned().items())
        )
