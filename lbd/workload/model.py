"""The one load model: a cluster in load terms, where moving a bundle moves its load.

Every tool that asks "what would this strategy do to this cluster" runs on :class:`LoadModel`:
``lbd demo`` (:mod:`lbd.workload.demo`), the scenario suite of ``lbd bench balance``
(:mod:`lbd.workload.balance`) and the trace replay of ``lbd analytics replay``
(:mod:`lbd.analytics.engine`, inside Spark tasks). So one strategy gets one answer whichever
tool asks.

The model holds brokers with a capacity, bundles with traffic, and who owns what:

- A broker's **carried load** is the traffic of the bundles it owns over its capacity, plus a
  background share that comes from no bundle (zero unless the caller sets it; a replayed trace
  sets it to what its history recorded beside the bundles). It is what clients feel.
- Each :meth:`LoadModel.report` folds the carried load into the broker's EMA as a real sidecar
  folds its broker's reports (:meth:`~lbd.core.load.BrokerLoadData.update`): the load is
  bandwidth-bound, CPU at 80% of the bandwidth's share, messages of ``MESSAGE_SIZE`` bytes.
  The shedder sees the EMA, not the carried load, as the real leader does.
- :meth:`LoadModel.snapshot` is the snapshot the leader would build: registered brokers, their
  reports, each broker's busiest bundles (``top_bundles``, as ``load_report.top_bundles``), the
  owners, the record of recent unloads.
- :meth:`LoadModel.apply` carries decisions out at once: a transfer moves the bundle and its
  load; an unload leaves the bundle without an owner until :meth:`LoadModel.place_orphans`
  places it as the next lookup would (the core's ``select_broker``). A broker that leaves
  leaves its bundles without an owner the same way.
- Placement rules (isolation, anti-affinity: :class:`~lbd.core.assign.PlacementRules`) bind
  the model as they bind the assigner: placements follow them, the snapshot carries the moves
  they allow (``allowed_destinations``), and a transfer they forbid is carried out but counted
  (:attr:`LoadModel.forbidden`), so that a strategy that breaks them shows.

The model is pure and deterministic for a seed; it knows nothing of the channel, the clock or
the network.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from lbd.core.assign import BrokerCandidate, PlacementRules, select_broker
from lbd.core.bundles import parse_bundle_id
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import (
    BrokerLoadData,
    BrokerUsage,
    BundleLoad,
    ResourceUsage,
    ResourceWeights,
    top_bundles,
)
from lbd.core.settings import MB, AssignmentConfig, SheddingConfig
from lbd.core.shedding import (
    STRATEGIES,
    LoadSnapshot,
    ShedderState,
    SheddingResult,
    UnloadDecision,
    mean_and_std,
)

_K = TypeVar("_K")

START_MS = 1_700_000_000_000
"""The model's clock at the start (any fixed instant: only differences matter)."""
TOP_BUNDLES = 10
"""Bundles per top-bundles report (the ``load_report.top_bundles`` default)."""
MESSAGE_SIZE = 1024
"""Bytes per message, to derive message rates from throughput."""
CPU_SHARE = 0.8
"""CPU usage as a share of the bandwidth usage: the load is bandwidth-bound."""


def usage_of(
    load: float, throughput: float, bundles: int, capacity_mbit: float = 100.0
) -> BrokerUsage:
    """What a broker carrying ``load`` (share of its capacity, 0..1+) and ``throughput`` (bytes/s
    in plus out, half each way) over ``bundles`` bundles reports; its bandwidth against its
    network capacity, ``capacity_mbit`` each way (as a broker front reports its link)."""
    bandwidth = ResourceUsage(capacity_mbit * load, capacity_mbit)
    each_way = throughput / 2
    return BrokerUsage(
        cpu=ResourceUsage(100.0 * CPU_SHARE * load, 100.0),
        bandwidth_in=bandwidth,
        bandwidth_out=bandwidth,
        msg_throughput_in=each_way,
        msg_throughput_out=each_way,
        msg_rate_in=each_way / MESSAGE_SIZE,
        msg_rate_out=each_way / MESSAGE_SIZE,
        bundle_count=bundles,
    )


@dataclass(frozen=True, slots=True)
class Move:
    """A bundle changing hands in the model: ``src`` None is a placement of a bundle without an
    owner, ``dst`` None an unload (the bundle waits for :meth:`LoadModel.place_orphans`)."""

    at_ms: int
    bundle: BundleId
    src: BrokerId | None
    dst: BrokerId | None
    throughput: float
    """The bundle's traffic when it moved, bytes/s in plus out."""


class LoadModel:
    """Brokers, bundles, owners and load reports; see the module's docstring."""

    def __init__(
        self,
        capacity: Mapping[BrokerId, float],
        traffic: Mapping[BundleId, float],
        owners: Mapping[BundleId, BrokerId] | None = None,
        *,
        seed: int = 1,
        now_ms: int = START_MS,
        top_count: int | None = TOP_BUNDLES,
        assignment: AssignmentConfig | None = None,
        rules: PlacementRules | None = None,
    ) -> None:
        """``capacity``: each broker's network capacity, MB/s each way; ``traffic``: each
        bundle's bytes/s in plus out; ``owners``: the initial placement (the rest are placed by
        the first :meth:`place_orphans`); ``top_count``: bundles per top-bundles report (None:
        all of them); ``rules``: the namespaces' placement rules (none by default)."""
        self.capacity: dict[BrokerId, float] = dict(capacity)
        self.traffic: dict[BundleId, float] = dict(traffic)
        self.owners: dict[BundleId, BrokerId] = dict(owners or {})
        self.background: dict[BrokerId, float] = {}
        """Load share a broker carries beside its bundles (none unless set)."""
        self.background_throughput: dict[BrokerId, float] = {}
        """Bytes/s a broker carries beside its bundles (none unless set)."""
        self.ema_only: set[BrokerId] = set()
        """Brokers whose reports carry only the EMAs, no raw sample (as scenario files give
        them, and brokers of a version that does not send one)."""
        self.report_every_s: dict[BrokerId, float] = {}
        """Brokers that report less often than every :meth:`report` call: at most once in this
        many seconds (a broker whose reports lag the leader's cycle)."""
        self.loads: dict[BrokerId, BrokerLoadData] = {}
        self.now_ms = now_ms
        self.rng = random.Random(seed)
        self._top_count = top_count
        self._assignment = assignment or AssignmentConfig()
        self._weights = ResourceWeights()
        self.shedder = ShedderState()
        self.unloaded_bundles: dict[BundleId, int] = {}
        self.unloaded_brokers: dict[BrokerId, int] = {}
        self.moves: list[Move] = []
        """Every move so far, placements of unloaded bundles included (not first placements)."""
        self._unloaded: set[BundleId] = set()
        self.rules = rules or PlacementRules({})
        self.forbidden: list[Move] = []
        """Transfers the placement rules did not allow when they were made."""

    # -- the world ------------------------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass."""
        self.now_ms += round(seconds * 1000)

    def join(self, broker: BrokerId, capacity: float) -> None:
        """A broker comes up (or changes capacity), MB/s each way."""
        self.capacity[broker] = capacity

    def leave(self, broker: BrokerId) -> list[BundleId]:
        """A broker goes away: its load data with it, its bundles without an owner."""
        del self.capacity[broker]
        self.loads.pop(broker, None)
        self.background.pop(broker, None)
        self.background_throughput.pop(broker, None)
        orphans = [b for b, o in self.owners.items() if o == broker]
        for bundle in orphans:
            del self.owners[bundle]
        return orphans

    def place(self, bundle: BundleId, broker: BrokerId) -> None:
        """Put ``bundle`` on ``broker`` from outside the model (a recorded placement)."""
        self.owners[bundle] = broker

    def place_orphans(self) -> list[Move]:
        """Place every bundle with traffic and no owner as the next lookup would; the moves."""
        candidates = self._candidates()
        placed: list[Move] = []
        for bundle in self.traffic:
            if bundle in self.owners:
                continue
            placement = self.rules.placement(parse_bundle_id(bundle).namespace, self.owners)
            selection = select_broker(
                bundle, candidates, self.loads, self._assignment, self.rng, placement
            )
            if selection.broker is None:
                continue
            self.owners[bundle] = selection.broker
            if bundle in self._unloaded:
                self._unloaded.remove(bundle)
                move = Move(self.now_ms, bundle, None, selection.broker, self.traffic[bundle])
                self.moves.append(move)
                placed.append(move)
        return placed

    # -- what the brokers carry and report ------------------------------------------------------

    def owned(self) -> dict[BrokerId, list[BundleId]]:
        """Each broker's bundles with traffic (every broker, an empty list for none)."""
        out: dict[BrokerId, list[BundleId]] = {b: [] for b in self.capacity}
        for bundle in self.traffic:
            owner = self.owners.get(bundle)
            if owner in out:
                out[owner].append(bundle)
        return out

    def throughputs(self) -> dict[BrokerId, float]:
        """Bytes/s in plus out each broker carries."""
        return self._throughputs(self.owned())

    def carried(self) -> dict[BrokerId, float]:
        """Each broker's load now (share of its capacity): what clients feel."""
        return self._carried(self.owned())

    def report(self) -> None:
        """Every broker reports, its carried load folded into its EMA at the model's time; but a
        broker of :attr:`report_every_s` only when that long has passed since its last report."""
        owned = self.owned()
        carried, throughputs = self._carried(owned), self._throughputs(owned)
        for broker, load in carried.items():
            every_ms = self.report_every_s.get(broker, 0.0) * 1000
            last = self.loads.get(broker)
            if last is not None and self.now_ms - last.updated_at_ms < every_ms:
                continue
            capacity_mbit = self.capacity[broker] * 8
            usage = usage_of(load, throughputs[broker], len(owned[broker]), capacity_mbit)
            previous = self.loads.get(broker, BrokerLoadData(broker=broker))
            data = previous.update(usage, self._weights, self.now_ms)
            if broker in self.ema_only:
                data = replace(data, usage=BrokerUsage())
            self.loads[broker] = data

    def _throughputs(self, owned: Mapping[BrokerId, list[BundleId]]) -> dict[BrokerId, float]:
        return {
            broker: max(
                0.0,
                self.background_throughput.get(broker, 0.0) + sum(self.traffic[b] for b in bundles),
            )
            for broker, bundles in owned.items()
        }

    def _carried(self, owned: Mapping[BrokerId, list[BundleId]]) -> dict[BrokerId, float]:
        out: dict[BrokerId, float] = {}
        for broker, bundles in owned.items():
            each_way = sum(self.traffic[b] for b in bundles) / 2
            load = self.background.get(broker, 0.0) + each_way / (self.capacity[broker] * MB)
            out[broker] = max(0.0, load)
        return out

    def seen(self) -> dict[BrokerId, float]:
        """Each broker's load EMA, what the shedder sees (0 for a broker that never reported)."""
        return {
            b: 0.0 if (d := self.loads.get(b)) is None else d.weighted_max_ema
            for b in self.capacity
        }

    def stds(self) -> tuple[float, float]:
        """The std of the carried load and of the EMA the shedder sees, across brokers."""
        return mean_and_std(self.carried().values())[1], mean_and_std(self.seen().values())[1]

    # -- the leader -----------------------------------------------------------------------------

    def snapshot(self, config: SheddingConfig | None = None) -> LoadSnapshot:
        """The snapshot the leader would build now; with ``config``, the record of unloads
        older than every window of its strategies is forgotten first."""
        if config is not None:
            horizon = self.now_ms - max(config.bundle_grace_period_s, config.cooldown_s) * 1000
            _forget_before(self.unloaded_bundles, horizon)
            _forget_before(self.unloaded_brokers, horizon)
        tops: dict[BrokerId, tuple[BundleLoad, ...]] = {}
        for broker, bundles in self.owned().items():
            loads = [BundleLoad(b, self.traffic[b] / 2, self.traffic[b] / 2) for b in bundles]
            count = len(loads) if self._top_count is None else self._top_count
            tops[broker] = top_bundles(loads, count)
        allowed: dict[BundleId, frozenset[BrokerId]] = {}
        rules = None
        if self.rules.binds:  # as the leader: for the bundles the brokers reported
            rules = self.rules.at(self._candidates(), self._assignment, self.owners)
            allowed = rules.destinations(b.bundle for top in tops.values() for b in top)
        return LoadSnapshot(
            brokers={b: self.loads.get(b) for b in self.capacity},
            top_bundles=tops,
            owners={b: o for b, o in self.owners.items() if b in self.traffic},
            recently_unloaded_bundles=dict(self.unloaded_bundles),
            recently_unloaded_brokers=dict(self.unloaded_brokers),
            allowed_destinations=allowed,
            move_rules=rules,
        )

    def shed(self, strategy: str, config: SheddingConfig) -> SheddingResult:
        """Run ``strategy`` over the snapshot, as the leader's shedder does (not applied)."""
        result, self.shedder = STRATEGIES[strategy](
            self.snapshot(config), config, self.shedder, self.now_ms, self.rng
        )
        return result

    def apply(self, decisions: Iterable[UnloadDecision]) -> list[Move]:
        """Carry ``decisions`` out at once; the moves made (a decision whose bundle is no longer
        on its source is dropped, as the leader's would be)."""
        made: list[Move] = []
        candidates = self._candidates() if self.rules.binds else []
        for d in decisions:
            if self.owners.get(d.bundle) != d.src:
                continue
            throughput = self.traffic.get(d.bundle, 0.0)
            self.unloaded_bundles[d.bundle] = self.now_ms
            self.unloaded_brokers[d.src] = self.now_ms
            if d.dst is None or d.dst not in self.capacity:
                del self.owners[d.bundle]
                self._unloaded.add(d.bundle)
                move = Move(self.now_ms, d.bundle, d.src, None, throughput)
            else:
                move = Move(self.now_ms, d.bundle, d.src, d.dst, throughput)
                if self.rules.binds and not self.rules.allows(
                    d.bundle, d.dst, candidates, self._assignment, self.owners
                ):
                    self.forbidden.append(move)
                self.owners[d.bundle] = d.dst
            self.moves.append(move)
            made.append(move)
        return made

    def _candidates(self) -> list[BrokerCandidate]:
        return [BrokerCandidate(b) for b in sorted(self.capacity)]


def moves_per_broker(moves: Sequence[Move]) -> dict[BrokerId, int]:
    """Moves in plus out of each broker among ``moves``."""
    out: dict[BrokerId, int] = {}
    for move in moves:
        for broker in (move.src, move.dst):
            if broker is not None:
                out[broker] = out.get(broker, 0) + 1
    return out


def _forget_before(table: dict[_K, int], horizon: int) -> None:
    """Entries older than every window the strategies look at can never matter again."""
    for key in [k for k, at in table.items() if at < horizon]:
        del table[key]
