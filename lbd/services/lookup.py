"""Lookups: topic -> bundle -> owner, assigning the bundle when it has no owner.

An Owned bundle is answered from the table and the registry at once. Otherwise the lookup waits
(within a deadline) for the bundle to settle; an Init or Free bundle is first assigned: a broker is
chosen with :func:`lbd.core.assign.select_broker` and ``Assigning(dst)`` proposed. Whoever's
proposal won, the bundle ends Owned by one broker, and every lookup answers that broker.

Concurrent lookups of one bundle on this sidecar share one task: one proposal, one wait. A bundle
found Deleted was split: the namespace layout is read again and the lookup retried.

Safe mode (metadata store unreachable): Owned bundles are still answered from the table, but no
new assignment is made (UnavailableError). A fenced sidecar never answers with its own broker.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass

from lbd.core.assign import BrokerCandidate, Placement, select_broker
from lbd.core.broker import BrokerInfo
from lbd.core.bundles import parse_bundle_id
from lbd.core.errors import DeadlineError, InvalidInputError, NotFoundError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData
from lbd.core.names import NamespaceName, TopicName
from lbd.core.namespace import NamespaceRecord
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, state_of
from lbd.core.tuning import AssignmentConfig
from lbd.metrics import FAILURE, SUCCESS, Metrics
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.ports.history import HistoryRecorder
from lbd.ports.loadstore import LoadStore
from lbd.services.fencing import Fence
from lbd.services.follower import ChannelFollower
from lbd.services.namespaces import NamespaceService
from lbd.services.proposals import Predicate, Proposer
from lbd.services.registry import BrokerRegistry

_log = logging.getLogger(__name__)

_S = ServiceUnitState

MAX_LAYOUT_RETRIES = 16
"""Namespace layouts a lookup reads before giving up (each retry follows a split)."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    """A topic's bundle, its state, and its owner (when Owned).

    ``owner_id`` is set for an Owned bundle; ``owner`` is the owner's registration, None when the
    owner is not (or no longer) registered.
    """

    bundle: BundleId
    state: ServiceUnitState
    owner: BrokerInfo | None = None
    owner_id: BrokerId | None = None


class LookupService:
    """Answers lookups; assigns bundles that have no owner."""

    def __init__(
        self,
        me: BrokerId,
        *,
        follower: ChannelFollower,
        proposer: Proposer,
        registry: BrokerRegistry,
        namespaces: NamespaceService,
        load_store: LoadStore,
        clock: Clock,
        rng: random.Random | None = None,
        assignment: AssignmentConfig | None = None,
        settle_timeout_s: float = 30.0,
        load_data_ttl_s: float = 1800.0,
        fence: Fence | None = None,
        history: HistoryRecorder | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """``load_store`` is the (started) broker-load store; ``settle_timeout_s`` bounds how
        long a lookup waits for its bundle to be Owned."""
        self._me = me
        self._history = history
        self._metrics = metrics
        self._follower = follower
        self._proposer = proposer
        self._registry = registry
        self._namespaces = namespaces
        self._load_store = load_store
        self._clock = clock
        self._rng = rng or random.Random()
        self._assignment = assignment or AssignmentConfig()
        self._settle_timeout_s = settle_timeout_s
        self._load_data_ttl_ms = round(load_data_ttl_s * 1000)
        self._fence = fence
        self._shared: dict[BundleId, asyncio.Task[None]] = {}
        self.proposals = 0
        """Assignments this sidecar proposed."""

    @property
    def settle_timeout_s(self) -> float:
        """How long a lookup or assignment waits for its bundle to settle."""
        return self._settle_timeout_s

    # -- lookups ----------------------------------------------------------------------------

    async def bundle_of(self, topic: str) -> BundleId:
        """The bundle ``topic`` belongs to now (InvalidInputError, NotFoundError)."""
        name = TopicName.parse(topic)
        record = await self._namespaces.get(name.namespace)
        return record.bundles().find(name).id

    async def lookup(self, topic: str, *, read_only: bool = False) -> LookupResult:
        """The bundle of ``topic`` and its owner, assigning the bundle when it has none.

        With ``read_only``, the table's answer as it is (no assignment, no wait). Raises
        InvalidInputError (bad topic name), NotFoundError (no such namespace), DeadlineError
        (not Owned in time), UnavailableError (safe mode and an assignment is needed; fenced
        and this broker is the owner; no broker available).
        """
        name = TopicName.parse(topic)
        for _ in range(MAX_LAYOUT_RETRIES):
            record = await self._namespaces.get(name.namespace)
            bundle = record.bundles().find(name).id
            value = self._follower.get(bundle)
            state = state_of(value)
            if value is not None and state is _S.Owned:
                return self._answer(bundle, value)
            if state is _S.Deleted:
                await self._namespaces.refresh(name.namespace)
                continue
            if read_only:
                return LookupResult(bundle, state)
            await self._settle_shared(bundle)
        raise DeadlineError(
            f"lookup of {topic}: the layout of {name.namespace} kept changing "
            f"({MAX_LAYOUT_RETRIES} reads)"
        )

    def _answer(self, bundle: BundleId, value: ServiceUnitStateData) -> LookupResult:
        owner = value.dst_broker
        if owner == self._me and self._fence is not None and self._fence.fenced:
            raise UnavailableError(
                f"bundle {bundle} is owned by {owner}, whose sidecar is fenced (its metadata "
                "lease could not be renewed): ask another sidecar"
            )
        info = None if owner is None else self._registry.get(owner)
        return LookupResult(bundle, value.state, info, owner)

    async def _settle_shared(self, bundle: BundleId) -> None:
        """Wait for ``bundle`` to settle, in one task shared by every lookup of it."""
        task = self._shared.get(bundle)
        if task is None:
            task = asyncio.ensure_future(self._settle(bundle))
            self._shared[bundle] = task
            task.add_done_callback(lambda t: self._forget(bundle, t))
        await asyncio.shield(task)

    def _forget(self, bundle: BundleId, task: asyncio.Task[None]) -> None:
        if self._shared.get(bundle) is task:
            del self._shared[bundle]
        if not task.cancelled():
            task.exception()  # retrieved: every waiting lookup got it already

    async def _settle(self, bundle: BundleId) -> None:
        """Until ``bundle`` is Owned or Deleted: assign it when Init or Free, else wait."""
        started = self._clock.monotonic()
        deadline = started + self._settle_timeout_s
        proposed = False
        while True:
            value = self._follower.get(bundle)
            state = state_of(value)
            if state in (_S.Owned, _S.Deleted):
                if proposed:
                    self._observe_assignment(started, "Lookup", ok=True)
                return
            if state in (_S.Init, _S.Free):
                if not await self._propose_assignment(bundle, None):
                    return  # no longer in the layout: the caller reads it again
                proposed = True
            if self._follower.get(bundle) is not value:
                continue
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                if proposed:
                    self._observe_assignment(started, "Lookup", ok=False)
                raise DeadlineError(
                    f"bundle {bundle} did not settle within {self._settle_timeout_s:g}s; it is "
                    f"{state_of(self._follower.get(bundle)).value}"
                )
            await self._proposer.settle(bundle, _changed_from(value), remaining)

    # -- assignment -------------------------------------------------------------------------

    async def assign(self, bundle: BundleId, dst: BrokerId | None = None) -> ServiceUnitStateData:
        """Assign an Init or Free ``bundle`` (to ``dst``, or a selected broker) and wait until
        it is Owned; the value it settled on (whoever's proposal won).

        The caller checks the request (bundle and ``dst`` exist); PreconditionError-free: an
        Owned bundle is returned as is. Raises UnavailableError in safe mode, DeadlineError.
        """
        if dst is None:
            await self._settle_shared(bundle)
        else:
            value = self._follower.get(bundle)
            started = self._clock.monotonic()
            if state_of(value) in (_S.Init, _S.Free):
                await self._propose_assignment(bundle, dst)
            try:
                await self._proposer.settle(
                    bundle, lambda v: state_of(v) in (_S.Owned, _S.Deleted), self._settle_timeout_s
                )
            except DeadlineError:
                self._observe_assignment(started, "Admin", ok=False)
                raise
            self._observe_assignment(started, "Admin", ok=True)
        value = self._follower.get(bundle)
        if value is None or value.state is not _S.Owned:
            raise NotFoundError(f"bundle {bundle} is {state_of(value).value}: it was split")
        return value

    def _observe_assignment(self, started: float, reason: str, *, ok: bool) -> None:
        if self._metrics is None:
            return
        if ok:
            self._metrics.assign_total.labels(result=SUCCESS, reason=reason).inc()
            self._metrics.assign_latency.observe(self._clock.monotonic() - started)
        else:
            self._metrics.assign_total.labels(result=FAILURE, reason="Timeout").inc()

    async def _propose_assignment(self, bundle: BundleId, dst: BrokerId | None) -> bool:
        """Propose ``Assigning(dst)`` (a selected broker when None); False when the bundle is
        no longer in its namespace's layout."""
        if not self._registry.reachable:
            raise UnavailableError(
                f"metadata store unreachable (safe mode): no new assignment of {bundle}"
            )
        parsed = parse_bundle_id(bundle)
        records = await self._namespaces.list()
        record = next((r for r in records if r.name == parsed.namespace), None)
        if record is None:
            raise NotFoundError(f"namespace {parsed.namespace} does not exist")
        # A layout read before a split may still hold the parent, whose value may even have
        # been tombstoned since: never assign a bundle the layout does not hold now.
        try:
            record.bundles().index(parsed.range)
        except NotFoundError:
            _log.info("%s is no longer in the layout of %s", bundle, parsed.namespace)
            return False
        reason = "Admin" if dst is not None else "Lookup"
        if dst is None:
            dst = self._select(bundle, record, records)
        await self._proposer.propose(bundle, _S.Assigning, dst=dst)
        self.proposals += 1
        if self._history is not None:
            self._history.record_decision("assign", bundle, reason=reason, dst=dst)
        return True

    def _select(
        self, bundle: BundleId, record: NamespaceRecord, records: list[NamespaceRecord]
    ) -> BrokerId:
        brokers = dict(self._registry.brokers())
        if self._fence is not None and self._fence.fenced:
            brokers.pop(self._me, None)
        loads = self.load_data()
        candidates = [
            BrokerCandidate(
                broker,
                version=info.version or None,
                topics=loads[broker].usage.topics if broker in loads else 0,
            )
            for broker, info in sorted(brokers.items())
        ]
        placement = Placement(
            policies=record.policies,
            cluster_isolation=tuple(
                r.policies.isolation for r in records if r.policies.isolation is not None
            ),
            ownership=self._ownership() if record.policies.anti_affinity_group else {},
            anti_affinity_groups=_groups(records),
        )
        selection = select_broker(bundle, candidates, loads, self._assignment, self._rng, placement)
        if selection.broker is None:
            raise UnavailableError(selection.reason)
        _log.info("assigning %s", selection.reason)
        return selection.broker

    def load_data(self) -> dict[BrokerId, BrokerLoadData]:
        """The latest, unexpired load data of every broker (unreadable values skipped)."""
        out: dict[BrokerId, BrokerLoadData] = {}
        latest = self._load_store.latest(self._clock.now_ms(), self._load_data_ttl_ms)
        for key, raw in latest.items():
            try:
                out[BrokerId(key)] = BrokerLoadData.from_json(raw)
            except InvalidInputError as e:
                _log.warning("ignoring the load data of %s: %s", key, e)
        return out

    def _ownership(self) -> dict[BundleId, BrokerId]:
        return {
            bundle: value.dst_broker
            for bundle, value in self._follower.table.items()
            if value.state is _S.Owned and value.dst_broker is not None
        }


def _changed_from(seen: ServiceUnitStateData | None) -> Predicate:
    """True once the bundle's value is no longer ``seen`` (the table stores a new object for
    every accepted change)."""
    return lambda value: value is not seen


def _groups(records: list[NamespaceRecord]) -> dict[NamespaceName, str]:
    return {
        r.name: r.policies.anti_affinity_group
        for r in records
        if r.policies.anti_affinity_group is not None
    }
