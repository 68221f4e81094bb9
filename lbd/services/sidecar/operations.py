"""Ownership operations for operators and schedulers: assign, transfer, unload, split.

Each one checks the request against the table, the registry and the namespace layout before
writing anything, so a bad request changes nothing: InvalidInputError (malformed),
NotFoundError (unknown bundle or broker), PreconditionError (the bundle's state does not allow
it). Then it proposes the first step of the flow (DESIGN §4) and waits, within the settle
deadline, until the flow has finished: the owners' sidecars carry out the rest. No bundle is
assigned or transferred to a cordoned broker (PreconditionError naming the cordon).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from lbd.core.bundles import (
    Bundle,
    BundleRange,
    SplitAlgorithm,
    TopicLoad,
    parse_bundle_id,
    split_positions,
    topic_hash,
)
from lbd.core.errors import InvalidInputError, LbdError, NotFoundError, PreconditionError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.probes import probe
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, owner_of, state_of
from lbd.core.tuning import SplitConfig
from lbd.metrics import ADMIN_REASON, FAILURE, SUCCESS, Metrics
from lbd.ports.errors import UnavailableError
from lbd.ports.history import HistoryRecorder
from lbd.services.channel.follower import ChannelFollower
from lbd.services.channel.proposals import Proposer
from lbd.services.cluster.maintenance import MaintenanceView
from lbd.services.cluster.namespaces import NamespaceService
from lbd.services.cluster.registry import BrokerRegistry
from lbd.services.sidecar.broker_link import BrokerLink
from lbd.services.sidecar.lookup import LookupService

_log = logging.getLogger(__name__)

_S = ServiceUnitState


@dataclass(frozen=True, slots=True)
class SplitOutcome:
    """A finished split: the parent, its children in hash order, and their owner."""

    parent: BundleId
    children: tuple[BundleId, ...]
    owner: BrokerId


class Operations:
    """Assign, transfer, unload and split bundles, checking each request first."""

    def __init__(
        self,
        me: BrokerId,
        *,
        follower: ChannelFollower,
        proposer: Proposer,
        registry: BrokerRegistry,
        namespaces: NamespaceService,
        maintenance: MaintenanceView,
        lookup: LookupService,
        link: BrokerLink,
        split_config: SplitConfig,
        settle_timeout_s: float,
        history: HistoryRecorder,
        metrics: Metrics,
    ) -> None:
        self._me = me
        self._history = history
        self._metrics = metrics
        self._follower = follower
        self._proposer = proposer
        self._registry = registry
        self._namespaces = namespaces
        self._maintenance = maintenance
        self._lookup = lookup
        self._link = link
        self._split_config = split_config
        self._settle_timeout_s = settle_timeout_s

    async def assign(self, bundle: BundleId, dst: BrokerId | None = None) -> BrokerId:
        """Assign an unowned bundle (to ``dst``, which must be registered); its owner.

        An Owned bundle is left as it is (PreconditionError if ``dst`` names another broker:
        that is a transfer).
        """
        value = await self._known(bundle)
        if dst is not None:
            self._registered(dst)
        state = state_of(value)
        if value is not None and state is _S.Owned:
            owner = value.dst_broker
            if dst is not None and dst != owner:
                raise PreconditionError(
                    f"bundle {bundle} is owned by {owner}; transfer it to move it to {dst}"
                )
            assert owner is not None  # an Owned value names its owner
            return owner
        if dst is not None:
            self._maintenance.refuse_cordoned(dst, f"assignment of {bundle} to {dst}")
        self._not_in_flight(bundle, value)
        settled = await self._lookup.assign(bundle, dst)
        assert settled.dst_broker is not None
        return settled.dst_broker

    async def transfer(self, bundle: BundleId, dst: BrokerId) -> tuple[BrokerId, BrokerId]:
        """Move an Owned bundle to ``dst``: ``(src, dst)`` once ``dst`` owns it.

        The source broker releases it before the destination is told to own it.
        """
        owner = await self.check_transfer(bundle, dst)
        started = self._proposer.clock.monotonic()
        await self._first_step(bundle, _S.Releasing, dst=dst, src=owner)
        self._record("transfer", bundle, src=owner, dst=dst)
        settled = await self._proposer.settle(
            bundle,
            lambda v: state_of(v) not in (_S.Releasing, _S.Assigning),
            self._settle_timeout_s,
        )
        self._observe_unload(started)
        if owner_of(settled) != dst:
            now = "gone" if settled is None else f"{settled.state.value} at {settled.dst_broker}"
            raise PreconditionError(
                f"transfer of {bundle} to {dst} did not complete: the bundle is {now} (the "
                "destination may have left during the move; the leader reassigned it)"
            )
        _log.info("transferred %s from %s to %s", bundle, owner, dst)
        return owner, dst

    async def check_transfer(self, bundle: BundleId, dst: BrokerId) -> BrokerId:
        """The owner of ``bundle``, if it may be transferred to ``dst`` now (the checks of
        :meth:`transfer`, which the leader runs before it executes an admin move)."""
        value = await self._known(bundle)
        self._registered(dst)
        owner = self._owner(bundle, value)
        if dst == owner:
            raise PreconditionError(f"bundle {bundle} is already owned by {dst}")
        self._maintenance.refuse_cordoned(dst, f"transfer of {bundle} to {dst}")
        self._reachable(f"transfer {bundle}")
        return owner

    async def check_unload(self, bundle: BundleId) -> BrokerId:
        """The owner of ``bundle``, if it may be unloaded now (the checks of :meth:`unload`)."""
        return self._owner(bundle, await self._known(bundle))

    async def unload(self, bundle: BundleId) -> BrokerId:
        """Unload an Owned bundle (it becomes Free; the next lookup assigns it); its old owner."""
        owner = await self.check_unload(bundle)
        started = self._proposer.clock.monotonic()
        await self._first_step(bundle, _S.Releasing, src=owner)
        self._record("unload", bundle, src=owner)
        await self._proposer.settle(
            bundle, lambda v: state_of(v) is not _S.Releasing, self._settle_timeout_s
        )
        self._observe_unload(started)
        _log.info("unloaded %s from %s", bundle, owner)
        return owner

    async def split(
        self,
        bundle: BundleId,
        algorithm: SplitAlgorithm | str,
        boundaries: Sequence[int] = (),
        *,
        reason: str = ADMIN_REASON,
    ) -> SplitOutcome:
        """Split a bundle this sidecar's broker owns; the children once they are Owned.

        ``boundaries`` are the split points of ``specified_positions_divide`` (and of no other
        algorithm); topic-based algorithms use the topics of the broker's latest load report.
        The request must reach the owner's sidecar (the API forwards it): PreconditionError
        otherwise. Every split is counted once here, by its outcome and ``reason`` (the split
        scheduler's reason, or ``Admin``), in ``lbd_bundle_split_total``.
        """
        try:
            outcome = await self._split(bundle, algorithm, boundaries, reason)
        except LbdError:
            self._metrics.split_total.labels(result=FAILURE, reason=reason).inc()
            raise
        self._metrics.split_total.labels(result=SUCCESS, reason=reason).inc()
        return outcome

    async def _split(
        self,
        bundle: BundleId,
        algorithm: SplitAlgorithm | str,
        boundaries: Sequence[int],
        reason: str,
    ) -> SplitOutcome:
        algo = SplitAlgorithm.parse(algorithm) if isinstance(algorithm, str) else algorithm
        if boundaries and algo is not SplitAlgorithm.SPECIFIED_POSITIONS_DIVIDE:
            raise InvalidInputError(
                f"split boundaries are only for {SplitAlgorithm.SPECIFIED_POSITIONS_DIVIDE}, "
                f"not {algo}"
            )
        value = await self._known(bundle)
        owner = self._owner(bundle, value)
        if owner != self._me:
            raise PreconditionError(
                f"bundle {bundle} is owned by {owner}: split it on that broker's sidecar"
            )
        # A split ends by cutting the namespace layout in the store: started while the store is
        # unreachable, it would stay Splitting until the leader rolled it back.
        self._reachable("split a bundle (its namespace layout is in the store)")
        parsed = parse_bundle_id(bundle)
        record = await self._namespaces.get(parsed.namespace)
        topics = self._topics(bundle, parsed.range)
        points = split_positions(
            algo,
            parsed.range,
            topics=topics,
            positions=boundaries,
            config=self._split_config,
            # As in Pulsar, positions do not split a bundle of one topic; without a report the
            # count is unknown and not checked.
            topic_count=None if self._link.latest_report is None else len(topics),
        )
        limit = record.policies.max_bundles or self._split_config.max_bundles_per_namespace
        count = len(record.bundles())
        if count + len(points) > limit:
            raise PreconditionError(
                f"splitting {bundle} into {len(points) + 1} would give {parsed.namespace} "
                f"{count + len(points)} bundles, above its max of {limit}"
            )
        edges = (parsed.range.lo, *points, parsed.range.hi)
        children = tuple(
            Bundle(parsed.namespace, BundleRange(lo, hi)).id for lo, hi in itertools.pairwise(edges)
        )
        await self._first_step(
            bundle, _S.Splitting, src=self._me, split_children=dict.fromkeys(children, self._me)
        )
        self._record("split", bundle, src=self._me, reason=reason)
        settled = await self._proposer.settle(
            bundle, lambda v: state_of(v) is not _S.Splitting, self._settle_timeout_s
        )
        if state_of(settled) is not _S.Deleted:
            probe("split.rolled_back")
            raise PreconditionError(
                f"split of {bundle} did not complete: the bundle is {state_of(settled).value} "
                "again (the leader rolled the stuck split back)"
            )
        _log.info("split %s into %s (%s)", bundle, ", ".join(children), algo)
        return SplitOutcome(bundle, children, self._me)

    def _observe_unload(self, started: float) -> None:
        self._metrics.unload_total.labels(result=SUCCESS, reason=ADMIN_REASON).inc()
        self._metrics.unload_latency.observe(self._proposer.clock.monotonic() - started)

    def _record(
        self,
        kind: str,
        bundle: BundleId,
        *,
        src: BrokerId | None = None,
        dst: BrokerId | None = None,
        reason: str = "Admin",
    ) -> None:
        self._history.record_decision(kind, bundle, reason=reason, src=src, dst=dst)

    # -- checks -----------------------------------------------------------------------------

    async def _known(self, bundle: BundleId) -> ServiceUnitStateData | None:
        """The bundle's value; NotFoundError unless it has one or its namespace layout holds it."""
        parsed = parse_bundle_id(bundle)
        if parsed.id != bundle:
            raise InvalidInputError(f"bundle id {bundle!r} is not canonical; use {parsed.id!r}")
        value = self._follower.get(bundle)
        if value is not None:
            if value.state is _S.Deleted:
                raise NotFoundError(f"bundle {bundle} no longer exists: it was split")
            return value
        record = await self._namespaces.refresh(parsed.namespace)
        try:
            record.bundles().index(parsed.range)
        except NotFoundError:
            raise NotFoundError(
                f"bundle {bundle} is not a bundle of namespace {parsed.namespace}"
            ) from None
        return None

    def _registered(self, broker: BrokerId) -> None:
        if self._registry.get(broker) is None:
            raise NotFoundError(f"broker {broker} is not registered")

    def _reachable(self, what: str) -> None:
        if not self._registry.reachable:
            raise UnavailableError(f"metadata store unreachable (safe mode): cannot {what}")

    def _not_in_flight(self, bundle: BundleId, value: ServiceUnitStateData | None) -> None:
        if value is not None and value.state.is_in_flight:
            raise PreconditionError(f"bundle {bundle} is in flight ({value.state.value})")

    def _owner(self, bundle: BundleId, value: ServiceUnitStateData | None) -> BrokerId:
        self._not_in_flight(bundle, value)
        if value is None or value.state is not _S.Owned or value.dst_broker is None:
            raise PreconditionError(f"bundle {bundle} is not owned ({state_of(value).value})")
        return value.dst_broker

    def _topics(self, bundle: BundleId, bundle_range: BundleRange) -> list[TopicLoad]:
        """The bundle's topics in the broker's latest report (ones that hash elsewhere, from a
        report older than a split, are left out)."""
        report = self._link.latest_report
        if report is None:
            return []
        return [t for t in report.topics_of(bundle) if topic_hash(t.topic) in bundle_range]

    async def _first_step(
        self,
        bundle: BundleId,
        state: ServiceUnitState,
        *,
        dst: BrokerId | None = None,
        src: BrokerId | None = None,
        split_children: dict[BundleId, BrokerId | None] | None = None,
    ) -> None:
        won = await self._proposer.propose_and_wait(
            bundle, state, dst=dst, src=src, split_children=split_children
        )
        if not won:
            now = self._follower.get(bundle)
            raise PreconditionError(
                f"bundle {bundle} changed meanwhile (now {state_of(now).value}); try again"
            )
