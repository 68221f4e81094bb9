"""The one place a broker is chosen for a bundle, and where ``Assigning(dst)`` is proposed.

Lookups, the Admin Assign call and the leader's orphan and stuck-state repair all come here, so
every assignment passes the same filters (:func:`lbd.core.assign.select_broker`): max topics per
broker, the required broker version, the cluster's namespace isolation policies and the
anti-affinity groups, then least resource usage among the brokers with fresh load data. A
cordoned broker (:mod:`lbd.services.cluster.maintenance_view`) is never chosen, and an explicit
assignment to one is refused.

What happens after the proposal is the destination's business: its sidecar's ownership reactor
(:mod:`lbd.services.sidecar.reactor`) sees ``Assigning(dst=it)``, tells its broker to Own the
bundle and, once the broker acknowledged, proposes ``Owned(it)``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Collection, Mapping

from lbd.core.assign import (
    BrokerCandidate,
    MoveRules,
    Placement,
    PlacementRules,
    Selection,
    select_broker,
)
from lbd.core.broker_info import BrokerInfo
from lbd.core.bundles import parse_bundle_id
from lbd.core.errors import NotFoundError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData
from lbd.core.namespace import NamespaceRecord
from lbd.core.settings import AssignmentConfig
from lbd.core.state import ServiceUnitState
from lbd.ports.errors import UnavailableError
from lbd.ports.history import HistoryRecorder
from lbd.services.channel.follower import ChannelFollower
from lbd.services.channel.proposals import Proposer
from lbd.services.cluster.loads import LoadView
from lbd.services.cluster.maintenance_view import MaintenanceView
from lbd.services.cluster.namespaces import NamespaceService
from lbd.services.cluster.registry import BrokerRegistry

_log = logging.getLogger(__name__)


class Assigner:
    """Chooses brokers for bundles and proposes the assignments."""

    def __init__(
        self,
        *,
        follower: ChannelFollower,
        proposer: Proposer,
        registry: BrokerRegistry,
        namespaces: NamespaceService,
        loads: LoadView,
        maintenance: MaintenanceView,
        config: AssignmentConfig,
        rng: random.Random,
        history: HistoryRecorder,
    ) -> None:
        self._follower = follower
        self._maintenance = maintenance
        self._proposer = proposer
        self._registry = registry
        self._namespaces = namespaces
        self._loads = loads
        self._config = config
        self._rng = rng
        self._history = history
        self.proposals = 0
        """Assignments this sidecar proposed."""

    async def choose(
        self,
        bundle: BundleId,
        *,
        among: Mapping[BrokerId, BrokerInfo] | None = None,
        avoid: BrokerId | None = None,
        exclude: Collection[BrokerId] = (),
        records: list[NamespaceRecord] | None = None,
    ) -> Selection:
        """Choose a broker for ``bundle`` among ``among`` (default: every registered broker)
        less ``exclude`` and the cordoned ones; ``avoid`` is left out too unless it is the only
        one left. ``records``: the namespace records to place by (default: read now), for a
        caller choosing for many bundles at once.

        Raises UnavailableError when no broker passes the filters (the reason says which
        filter left none, or names the cordons), NotFoundError when the bundle's namespace does
        not exist.
        """
        if records is None:
            records = await self._namespaces.list()
        return self._choose(bundle, records, among=among, avoid=avoid, exclude=exclude)

    async def move_rules(self) -> MoveRules:
        """The placement rules over the cluster as it is now, for a shedding cycle's moves: the
        assignment filters (max topics, version, isolation, anti-affinity) over the registered
        brokers, never a cordoned one (:class:`~lbd.core.assign.MoveRules`). Its
        ``destinations`` leave out the bundles no rule binds (a namespace that no longer exists
        has no policies); while a broker is cordoned, every bundle is listed."""
        records = await self._namespaces.list()
        cordoned = self._maintenance.cordoned()
        registered = self._registry.brokers()
        candidates = self._candidates(
            {b: i for b, i in registered.items() if b not in cordoned}, self._loads.brokers()
        )
        return _rules(records).at(
            candidates, self._config, self._follower.table.owners(), frozenset(registered)
        )

    def _candidates(
        self, brokers: Mapping[BrokerId, BrokerInfo], loads: Mapping[BrokerId, BrokerLoadData]
    ) -> list[BrokerCandidate]:
        return [
            BrokerCandidate(
                broker,
                version=info.version or None,
                topics=loads[broker].usage.topics if broker in loads else 0,
            )
            for broker, info in sorted(brokers.items())
        ]

    def _choose(
        self,
        bundle: BundleId,
        records: list[NamespaceRecord],
        *,
        among: Mapping[BrokerId, BrokerInfo] | None = None,
        avoid: BrokerId | None = None,
        exclude: Collection[BrokerId] = (),
    ) -> Selection:
        brokers = dict(self._registry.brokers() if among is None else among)
        for broker in exclude:
            brokers.pop(broker, None)
        cordons = [c for b, c in sorted(self._maintenance.records().items()) if b in brokers]
        for cordon in cordons:
            del brokers[cordon.broker]
        if not brokers and cordons:
            raise UnavailableError(
                f"no broker can take {bundle}: every candidate is cordoned ("
                + "; ".join(f"{c.broker} {c.describe()}" for c in cordons)
                + "); uncordon one or add a broker"
            )
        if avoid is not None and len(brokers) > 1:
            brokers.pop(avoid, None)
        record = _record_of(bundle, records)
        loads = self._loads.brokers()
        candidates = self._candidates(brokers, loads)
        selection = select_broker(
            bundle, candidates, loads, self._config, self._rng, self._placement(record, records)
        )
        if selection.broker is None:
            raise UnavailableError(f"no broker can take {bundle}: {selection.reason}")
        return selection

    async def assign(
        self,
        bundle: BundleId,
        dst: BrokerId | None,
        *,
        reason: str,
        exclude: Collection[BrokerId] = (),
    ) -> bool:
        """Propose ``Assigning(dst)`` for an Init or Free ``bundle`` (``dst`` None: a chosen
        broker, never one of ``exclude``); False when the bundle is no longer in its namespace's
        layout (it was split: the caller reads the layout again).

        Raises UnavailableError in safe mode (the registry cannot be trusted to say who is alive)
        or when no broker can take it, NotFoundError when the namespace does not exist,
        PreconditionError when ``dst`` is cordoned.
        """
        if not self._registry.reachable:
            raise UnavailableError(
                f"metadata store unreachable (safe mode): no new assignment of {bundle}"
            )
        if dst is not None:
            self._maintenance.refuse_cordoned(dst, f"assignment of {bundle} to {dst}")
        parsed = parse_bundle_id(bundle)
        # A layout read before a split may still hold the parent, whose value may even have
        # been tombstoned since: never assign a bundle the layout does not hold now.
        records = await self._namespaces.list()
        record = _record_of(bundle, records)
        try:
            record.bundles().index(parsed.range)
        except NotFoundError:
            _log.info("%s is no longer in the layout of %s", bundle, parsed.namespace)
            return False
        if dst is None:
            selection = self._choose(bundle, records, exclude=exclude)
            assert selection.broker is not None
            dst = selection.broker
            _log.debug("assigning %s", selection.reason)
        await self._proposer.propose(bundle, ServiceUnitState.Assigning, dst=dst)
        self.proposals += 1
        self._history.record_decision("assign", bundle, reason=reason, dst=dst)
        return True

    def _placement(self, record: NamespaceRecord, records: list[NamespaceRecord]) -> Placement:
        grouped = record.policies.anti_affinity_group is not None
        return _rules(records).placement(
            record.name, self._follower.table.owners() if grouped else {}
        )


def _rules(records: list[NamespaceRecord]) -> PlacementRules:
    return PlacementRules({r.name: r.policies for r in records})


def _record_of(bundle: BundleId, records: list[NamespaceRecord]) -> NamespaceRecord:
    namespace = parse_bundle_id(bundle).namespace
    record = next((r for r in records if r.name == namespace), None)
    if record is None:
        raise NotFoundError(f"namespace {namespace} does not exist")
    return record
