"""What a shedding strategy reads and what it returns.

A strategy is a pure function of a :class:`LoadSnapshot` (the leader's view of every broker's load,
its top bundles and its own record of recent unloads), a
:class:`~lbd.core.settings.SheddingConfig`, the strategy's :class:`ShedderState` carried from its
previous cycle, the time ``now_ms`` and a ``random.Random``. It returns a :class:`SheddingResult`
and the state to carry into the next cycle (see :data:`Strategy`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BrokerUsage, BundleLoad
from lbd.core.settings import SheddingConfig

if TYPE_CHECKING:
    from lbd.core.assign import MoveRules

MB = 1024 * 1024
"""Bytes in the megabyte of ``min_throughput_threshold`` (Pulsar's ``MB``)."""


class DecisionReason(StrEnum):
    """Why a bundle is unloaded (Pulsar ``UnloadDecision.Reason``, the success subset)."""

    OVERLOADED = "Overloaded"
    """The cluster's load spread is over target, or the source broker is overloaded."""
    UNDERLOADED = "Underloaded"
    """The destination broker is underloaded (nearly idle, e.g. newly started)."""
    ADMIN = "Admin"
    """An operator asked for it (never produced by a strategy)."""


class SkipReason(StrEnum):
    """Why a cycle decided nothing (Pulsar ``UnloadDecision.Reason``, the skip subset)."""

    HIT_COUNT = "HitCount"
    """The shedding condition has not held for ``hit_count_threshold`` cycles in a row, or the
    cluster is balanced (Pulsar reports a balanced cluster under this name too)."""
    NO_BUNDLES = "NoBundles"
    """Brokers to shed from have no bundle that may move (sole bundle, grace period, too little
    throughput)."""
    COOL_DOWN = "CoolDown"
    """A broker's latest load report predates its last unload by less than ``cooldown_s``."""
    OUT_DATED_DATA = "OutDatedData"
    """Every broker's load data is older than ``load_data_ttl_s``."""
    NO_LOAD_DATA = "NoLoadData"
    """A registered broker has not reported load yet, or a broker to shed from reported no top
    bundles."""
    NO_BROKERS = "NoBrokers"
    """No broker has load data."""
    UNKNOWN = "Unknown"
    """The strategy failed unexpectedly (Pulsar counts failures under this name)."""


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """The leader's view of the cluster at one instant: the input of every strategy.

    ``brokers`` lists every registered broker; ``None`` stands for a broker that has not published
    load data yet. ``top_bundles`` holds each broker's most loaded bundles as it last reported them.
    ``owners`` is the channel's ownership table; a reported bundle missing from it is taken to be
    owned by the broker that reported it, one owned by another broker is not moved (the report is
    older than the ownership change). The ``recently_unloaded_*`` maps are the leader's own record
    of past unloads, in epoch milliseconds.
    """

    brokers: Mapping[BrokerId, BrokerLoadData | None]
    top_bundles: Mapping[BrokerId, tuple[BundleLoad, ...]] = field(default_factory=dict)
    owners: Mapping[BundleId, BrokerId] = field(default_factory=dict)
    recently_unloaded_bundles: Mapping[BundleId, int] = field(default_factory=dict)
    recently_unloaded_brokers: Mapping[BrokerId, int] = field(default_factory=dict)
    allowed_destinations: Mapping[BundleId, frozenset[BrokerId]] = field(default_factory=dict)
    """Placement rules as the leader evaluated them (isolation, anti-affinity): a bundle listed
    here may only move to these brokers; an unlisted bundle may move to any broker."""
    move_rules: MoveRules | None = field(default=None, compare=False)
    """The rules themselves, when the leader has them (a scenario file has only the map above):
    :meth:`may_move_to` then counts the moves a cycle already chose."""

    def owner_of(self, bundle: BundleId, reporter: BrokerId) -> BrokerId:
        """The broker owning ``bundle``, defaulting to the broker that reported it."""
        return self.owners.get(bundle, reporter)

    def owned_bundles(self, broker: BrokerId) -> frozenset[BundleId]:
        """Every bundle known to be on ``broker``: its reported bundles it still owns, and the
        bundles the ownership table gives it."""
        assigned = {bundle for bundle, owner in self.owners.items() if owner == broker}
        return frozenset(self._reported_owned(broker) | assigned)

    def holdings(self) -> dict[BrokerId, frozenset[BundleId]]:
        """:meth:`owned_bundles` of every broker that reported or owns a bundle, in one pass
        over the ownership table (a broker not listed holds nothing)."""
        held: dict[BrokerId, set[BundleId]] = {}
        for bundle, owner in self.owners.items():
            held.setdefault(owner, set()).add(bundle)
        for broker in self.top_bundles:
            held.setdefault(broker, set()).update(self._reported_owned(broker))
        return {broker: frozenset(bundles) for broker, bundles in held.items()}

    def _reported_owned(self, broker: BrokerId) -> set[BundleId]:
        """The bundles ``broker`` reported among its top bundles that it still owns."""
        return {
            b.bundle
            for b in self.top_bundles.get(broker, ())
            if self.owner_of(b.bundle, broker) == broker
        }

    def may_move_to(
        self, bundle: BundleId, broker: BrokerId, chosen: Sequence[UnloadDecision] = ()
    ) -> bool:
        """Whether the placement rules let ``bundle`` move to ``broker`` after the moves this
        cycle already ``chosen`` (two bundles of an anti-affinity group may each be allowed on
        a broker alone, and not both)."""
        allowed = self.allowed_destinations.get(bundle)
        if allowed is not None and broker not in allowed:
            return False
        if self.move_rules is None or not chosen:
            return True
        planned = [(d.bundle, d.src, d.dst) for d in chosen]
        return self.move_rules.allows(bundle, broker, planned)

    def in_grace_period(self, bundle: BundleId, config: SheddingConfig, now_ms: int) -> bool:
        """Whether ``bundle`` was unloaded less than ``bundle_grace_period_s`` before ``now_ms``."""
        unloaded_at = self.recently_unloaded_bundles.get(bundle)
        return (
            unloaded_at is not None and now_ms - unloaded_at < config.bundle_grace_period_s * 1000
        )

    def with_unloads(self, decisions: Iterable[UnloadDecision], now_ms: int) -> LoadSnapshot:
        """This snapshot with ``decisions`` recorded in the leader's recent-unload maps, as Pulsar's
        unload scheduler records them (the bundle and its source broker, at ``now_ms``). Loads and
        ownership are left as they are: they change only when brokers report again."""
        bundles = dict(self.recently_unloaded_bundles)
        brokers = dict(self.recently_unloaded_brokers)
        for d in decisions:
            bundles[d.bundle] = now_ms
            brokers[d.src] = now_ms
        return LoadSnapshot(
            brokers=self.brokers,
            top_bundles=self.top_bundles,
            owners=self.owners,
            recently_unloaded_bundles=bundles,
            recently_unloaded_brokers=brokers,
            allowed_destinations=self.allowed_destinations,
            move_rules=self.move_rules,
        )


@dataclass(frozen=True, slots=True)
class UnloadDecision:
    """Move ``bundle`` off ``src``: to ``dst`` (a transfer) or, when ``dst`` is None, to whichever
    broker the next lookup assigns it (a plain unload)."""

    bundle: BundleId
    src: BrokerId
    dst: BrokerId | None
    reason: DecisionReason


@dataclass(frozen=True, slots=True)
class PastMove:
    """A bundle a strategy moved (or saw change owner), with the traffic it carried then (bytes/s
    in plus out)."""

    bundle: BundleId
    src: BrokerId
    dst: BrokerId | None
    throughput: float
    at_ms: int
    own: bool = True
    """Made by the strategy; False: a change of owner it saw in the ownership table (a lookup
    placed an orphan, an operator moved the bundle), remembered only for the load it moved."""


@dataclass(frozen=True, slots=True)
class HitCounts:
    """A broker's avg_shedder hit counts: the cycles in a row in which its pair's load difference
    reached the low and the high threshold (Pulsar AvgShedder's ``brokerHitCountForLow`` and
    ``brokerHitCountForHigh``)."""

    low: int = 0
    high: int = 0


@dataclass(frozen=True, slots=True)
class ShedderState:
    """What a strategy carries from one cycle to the next."""

    hit_count: int = 0
    """Consecutive cycles in which the shedding condition held (TransferShedder)."""
    moves: tuple[PastMove, ...] = ()
    """The strategy's own recent moves (cluster_planner): what the brokers' load reports may not
    show yet, and where each bundle must not go back to."""
    broker_hits: Mapping[BrokerId, HitCounts] = field(default_factory=dict)
    """Per broker, its avg_shedder hit counts; a broker not listed has none (avg_shedder)."""
    owned: Mapping[BrokerId, int] = field(default_factory=dict)
    """How many bundles each broker held in the previous cycle (cluster_planner: a change of
    owner is not a spike)."""
    reports: Mapping[BrokerId, tuple[int, ...]] = field(default_factory=dict)
    """Each broker's latest report times, oldest first (cluster_planner: how many reports an EMA
    has taken in since a move)."""
    balancing: bool = False
    """A balancing episode (the spread over target) is under way: it goes on until the spread is
    under the planning goal (cluster_planner)."""
    owners_seen: Mapping[BundleId, BrokerId] = field(default_factory=dict)
    """The ownership table at the previous cycle (cluster_planner: which bundles changed owner
    since, by lookups, operators or failover, not by its own moves)."""
    rates_seen: Mapping[BundleId, float] = field(default_factory=dict)
    """Each owned bundle's throughput as the previous cycle could tell it: as its owner reported
    it among its top bundles, else its owner's throughput beyond them shared by its other
    bundles (cluster_planner: what a bundle that changed owner brought)."""
    seen_at_ms: int = 0
    """When the previous cycle ran (cluster_planner; 0: none yet)."""
    calm: Mapping[BrokerId, float] = field(default_factory=dict)
    """Each broker's EMA load at the latest cycle in which the shedding condition did not hold
    (cluster_planner: what the EMAs showed before the imbalance under way began, which a spike
    under way has not moved; empty: no such cycle yet)."""


@dataclass(frozen=True, slots=True)
class SheddingResult:
    """The outcome of one cycle: decisions, or the reason there are none.

    ``avg`` and ``std`` describe the loads (``weighted_max_ema``) of the brokers with usable load
    data, before any of the decisions is applied; both are 0 when no broker has usable data.
    """

    decisions: tuple[UnloadDecision, ...]
    skip_reason: SkipReason | None
    avg: float
    std: float
    notes: tuple[str, ...] = ()
    """What the strategy could not read from the reports and how it decided instead (why it
    waits, why it acts at once), as sentences for the log."""

    def __post_init__(self) -> None:
        if bool(self.decisions) == (self.skip_reason is not None):
            raise ValueError("a result has either decisions or a skip reason, not both or neither")


Strategy = Callable[
    [LoadSnapshot, SheddingConfig, ShedderState, int, random.Random],
    tuple[SheddingResult, ShedderState],
]
"""``strategy(snapshot, config, state, now_ms, rng) -> (result, next_state)``."""


def current_throughput(data: BrokerLoadData) -> float:
    """The broker's latest raw throughput, bytes/s in plus out (Pulsar's ``msgThroughputIn +
    msgThroughputOut``), in the same time base as the top-bundles report; its EMA when the data
    carries no raw sample (scenario files give only the EMA)."""
    return data.msg_throughput if data.usage != BrokerUsage() else data.msg_throughput_ema


def mean_and_std(loads: Iterable[float]) -> tuple[float, float]:
    """Mean and population standard deviation (Pulsar's ``LoadStats``); (0, 0) when empty."""
    values = list(loads)
    if not values:
        return 0.0, 0.0
    avg = math.fsum(values) / len(values)
    return avg, math.sqrt(math.fsum((v - avg) ** 2 for v in values) / len(values))


@dataclass(frozen=True, slots=True)
class UsableLoad:
    """The brokers whose load data a strategy may use, and whether the cycle must stop here."""

    loads: Mapping[BrokerId, BrokerLoadData]
    """Brokers with load data younger than ``load_data_ttl_s``, by id."""
    skip_reason: SkipReason | None
    avg: float
    std: float


def usable_load(snapshot: LoadSnapshot, config: SheddingConfig, now_ms: int) -> UsableLoad:
    """Filter out stale load data and decide whether the load data allows a cycle at all.

    As in Pulsar's ``TransferShedder.LoadStats.update``: data older than ``load_data_ttl_s`` is
    ignored; a broker whose latest report is less than ``cooldown_s`` newer than its last unload
    stops the whole cycle (``CoolDown``), since the cluster's statistics would still count the load
    it gave away; with no usable data the cycle stops with ``OutDatedData`` (some data was stale)
    or ``NoBrokers``; a registered broker with no data at all stops it with ``NoLoadData``.
    """
    fresh: dict[BrokerId, BrokerLoadData] = {}
    stale = missing = cooling_down = False
    for broker in sorted(snapshot.brokers):
        data = snapshot.brokers[broker]
        if data is None:
            missing = True
            continue
        if now_ms - data.updated_at_ms > config.load_data_ttl_s * 1000:
            stale = True
            continue
        unloaded_at = snapshot.recently_unloaded_brokers.get(broker)
        if unloaded_at is not None and data.updated_at_ms - unloaded_at < config.cooldown_s * 1000:
            cooling_down = True
        fresh[broker] = data
    reason: SkipReason | None = None
    if cooling_down:
        reason = SkipReason.COOL_DOWN
    elif not fresh:
        reason = SkipReason.OUT_DATED_DATA if stale else SkipReason.NO_BROKERS
    elif missing:
        reason = SkipReason.NO_LOAD_DATA
    avg, std = mean_and_std(d.weighted_max_ema for d in fresh.values())
    return UsableLoad(loads=fresh, skip_reason=reason, avg=avg, std=std)
