"""Lookups: topic -> bundle -> owner, assigning the bundle when it has no owner.

An Owned bundle is answered from the table and the registry at once, and so is a Splitting one
(with its source, which serves it until the children are Owned). Otherwise the lookup waits
(within ``assignment.settle_timeout_s``) for the bundle to settle; an Init or Free bundle is first
assigned by the :class:`~lbd.services.cluster.assigner.Assigner`, which chooses a broker and
proposes ``Assigning(dst)``. The destination's sidecar then tells its broker to Own the bundle and,
once acknowledged, proposes ``Owned(dst)`` (:mod:`lbd.services.sidecar.reactor`); the channel
follower applies it on every sidecar, which wakes this lookup. Whoever's proposal won, the bundle
ends Owned by one broker, and every lookup answers that broker.

Concurrent lookups of one bundle on this sidecar share one task: one proposal, one wait. A bundle
found Deleted was split: the namespace layout is read again and the lookup retried.

Safe mode (metadata store unreachable): Owned bundles are still answered from the table, but no
new assignment is made (UnavailableError). A fenced sidecar never answers with its own broker.

An answer whose owner is missing from the registry (it left, and the leader has not moved its
bundles yet; or this sidecar's registry is behind) is counted (``lbd_lookup_dead_owner_total``,
:attr:`LookupService.dead_owners`), for the leader's safety auditor.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from lbd.core.audit import DeadOwnerAnswers
from lbd.core.broker_info import BrokerInfo
from lbd.core.errors import DeadlineError, NotFoundError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.names import NamespaceName, TopicName
from lbd.core.namespace import NamespaceRecord
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, state_of
from lbd.metrics import FAILURE, SUCCESS, Metrics
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.services.channel.follower import ChannelFollower
from lbd.services.channel.proposals import Predicate, Proposer
from lbd.services.cluster.assigner import Assigner
from lbd.services.cluster.namespaces import NamespaceService
from lbd.services.cluster.registry import BrokerRegistry
from lbd.services.sidecar.fencing import Fence

_log = logging.getLogger(__name__)

_S = ServiceUnitState

MAX_LAYOUT_RETRIES = 16
"""Namespace layouts a lookup reads before giving up (each retry follows a split)."""

LOCATED_LIMIT = 100_000
"""Topics whose bundle is remembered (the memo is emptied when it reaches this size)."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    """A topic's bundle, its state, and its owner (when Owned).

    ``owner_id`` is set for an Owned bundle, and for a Splitting one (its source, which serves it
    until the children are Owned); ``owner`` is that broker's registration, None when it is not
    (or no longer) registered.
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
        assigner: Assigner,
        fence: Fence,
        clock: Clock,
        settle_timeout_s: float,
        metrics: Metrics,
    ) -> None:
        """``settle_timeout_s`` bounds how long a lookup waits for its bundle to be Owned."""
        self._me = me
        self._metrics = metrics
        self._follower = follower
        self._proposer = proposer
        self._registry = registry
        self._namespaces = namespaces
        self._assigner = assigner
        self._fence = fence
        self._clock = clock
        self._settle_timeout_s = settle_timeout_s
        self._shared: dict[BundleId, asyncio.Task[None]] = {}
        self._dead_owners = DeadOwnerAnswers()
        self._located: dict[str, tuple[NamespaceRecord, BundleId]] = {}
        """Topic -> the layout it was found in and its bundle there: valid while that very
        record is the cached one (a split or a refresh replaces it)."""

    @property
    def dead_owners(self) -> DeadOwnerAnswers:
        """The lookups answered with an owner missing from the registry, and the latest one."""
        return self._dead_owners

    @property
    def settle_timeout_s(self) -> float:
        """How long a lookup or assignment waits for its bundle to settle."""
        return self._settle_timeout_s

    # -- lookups ----------------------------------------------------------------------------

    async def bundle_of(self, topic: str) -> BundleId:
        """The bundle ``topic`` belongs to now (InvalidInputError, NotFoundError)."""
        _, bundle = await self._locate(topic)
        return bundle

    async def _locate(self, topic: str) -> tuple[NamespaceName, BundleId]:
        """The namespace of ``topic`` and its bundle in the cached layout (parsed, hashed and
        searched once per topic and layout: a lookup's answer is mostly this)."""
        hit = self._located.get(topic)
        if hit is not None:
            record, bundle = hit
            if self._namespaces.cached(record.name) is record:
                return record.name, bundle
        name = TopicName.parse(topic)
        record = await self._namespaces.get(name.namespace)
        bundle = record.bundles().find(name).id
        if len(self._located) >= LOCATED_LIMIT:
            self._located.clear()
        self._located[topic] = (record, bundle)
        return name.namespace, bundle

    def answer_now(self, topic: str) -> LookupResult | None:
        """:meth:`lookup`'s answer when it needs nothing but memory: ``topic`` was located in
        the cached layout before and its bundle is Owned. None otherwise (then :meth:`lookup`
        answers). Raises UnavailableError as :meth:`lookup` does (fenced, and the owner is this
        sidecar's broker). Most lookups are this, and a call without a coroutine costs less."""
        hit = self._located.get(topic)
        if hit is None:
            return None
        record, bundle = hit
        if self._namespaces.cached(record.name) is not record:
            return None
        value = self._follower.get(bundle)
        if value is None or value.state is not _S.Owned:
            return None
        return self._answer(bundle, value)

    async def lookup(self, topic: str, *, read_only: bool = False) -> LookupResult:
        """The bundle of ``topic`` and its owner, assigning the bundle when it has none.

        With ``read_only``, the table's answer as it is (no assignment, no wait). Raises
        InvalidInputError (bad topic name), NotFoundError (no such namespace), DeadlineError
        (not Owned in time), UnavailableError (safe mode and an assignment is needed; fenced
        and this broker is the owner; no broker available).
        """
        for _ in range(MAX_LAYOUT_RETRIES):
            namespace, bundle = await self._locate(topic)
            value = self._follower.get(bundle)
            if value is not None and value.state is _S.Owned:
                return self._answer(bundle, value)
            if value is not None and value.state is _S.Splitting and value.source_broker:
                # Its source serves it until the children are Owned (as Pulsar answers a
                # Splitting bundle): a split that cannot finish (the metadata store unreachable,
                # say) must not leave its topics without an answer until it is rolled back.
                return self._answer(bundle, value, value.source_broker)
            state = state_of(value)
            if state is _S.Deleted:
                await self._namespaces.refresh(namespace)
                continue
            if read_only:
                return LookupResult(bundle, state)
            await self._settle_shared(bundle)
        raise DeadlineError(
            f"lookup of {topic}: the layout of {TopicName.parse(topic).namespace} kept changing "
            f"({MAX_LAYOUT_RETRIES} reads)"
        )

    def _answer(
        self, bundle: BundleId, value: ServiceUnitStateData, server: BrokerId | None = None
    ) -> LookupResult:
        """The answer for ``bundle`` at ``value``: its owner, or ``server`` when given (the
        source of a split)."""
        owner = value.dst_broker if server is None else server
        if owner == self._me and self._fence.fenced:
            raise UnavailableError(
                f"bundle {bundle} is owned by {owner}, whose sidecar is fenced (its metadata "
                "lease could not be renewed): ask another sidecar"
            )
        info = None if owner is None else self._registry.get(owner)
        if owner is not None and info is None:
            self._answered_dead_owner(bundle, owner)
        return LookupResult(bundle, value.state, info, owner)

    def _answered_dead_owner(self, bundle: BundleId, owner: BrokerId) -> None:
        since = self._registry.absent_since(owner)
        away_s = None if since is None else self._clock.monotonic() - since
        self._dead_owners = self._dead_owners.answered(bundle, owner, away_s)
        self._metrics.lookup_dead_owner.inc()
        _log.debug("lookup of %s answered with %s, which is not registered", bundle, owner)

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
        if ok:
            self._metrics.assign_total.labels(result=SUCCESS, reason=reason).inc()
            self._metrics.assign_latency.observe(self._clock.monotonic() - started)
        else:
            self._metrics.assign_total.labels(result=FAILURE, reason="Timeout").inc()

    async def _propose_assignment(self, bundle: BundleId, dst: BrokerId | None) -> bool:
        """Have ``bundle`` assigned (to ``dst``, or a chosen broker other than this one while it is
        fenced); False when it is no longer in its namespace's layout."""
        return await self._assigner.assign(
            bundle,
            dst,
            reason="Admin" if dst is not None else "Lookup",
            exclude=(self._me,) if self._fence.fenced else (),
        )


def _changed_from(seen: ServiceUnitStateData | None) -> Predicate:
    """True once the bundle's value is no longer ``seen`` (the table stores a new object for
    every accepted change)."""
    return lambda value: value is not seen
