"""A sidecar's own ownership operations: assign (for any caller) and split (of a bundle its
broker owns). A move of an Owned bundle (an admin Transfer or Unload, shedding, a drain) runs on
the leader, under its execution governor
(:meth:`~lbd.services.leader.tracker.OperationTracker.admin_move`).

Each one checks the request first (:class:`~lbd.services.cluster.checks.RequestChecks`), so a bad
request changes nothing. Then it proposes the first step of the flow (DESIGN §4) and waits, within
the settle deadline, until the flow has finished: the owners' sidecars carry out the rest. No
bundle is assigned to a cordoned broker (PreconditionError naming the cordon).
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
from lbd.core.errors import InvalidInputError, LbdError, PreconditionError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.probes import probe
from lbd.core.settings import SplitConfig
from lbd.core.state import ServiceUnitState, state_of
from lbd.metrics import ADMIN_REASON, FAILURE, SUCCESS, Metrics
from lbd.ports.history import HistoryRecorder
from lbd.services.channel.follower import ChannelFollower
from lbd.services.channel.proposals import Proposer
from lbd.services.cluster.checks import RequestChecks
from lbd.services.cluster.namespaces import NamespaceService
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
    """Assign and split bundles, checking each request first."""

    def __init__(
        self,
        me: BrokerId,
        *,
        follower: ChannelFollower,
        proposer: Proposer,
        checks: RequestChecks,
        namespaces: NamespaceService,
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
        self._checks = checks
        self._namespaces = namespaces
        self._lookup = lookup
        self._link = link
        self._split_config = split_config
        self._settle_timeout_s = settle_timeout_s

    async def assign(self, bundle: BundleId, dst: BrokerId | None = None) -> BrokerId:
        """Assign an unowned bundle (to ``dst``, which must be registered); its owner.

        An Owned bundle is left as it is (PreconditionError if ``dst`` names another broker:
        that is a transfer).
        """
        value = await self._checks.known(bundle)
        if dst is not None:
            self._checks.registered(dst)
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
            self._checks.refuse_cordoned(dst, f"assignment of {bundle} to {dst}")
        self._checks.not_in_flight(bundle, value)
        settled = await self._lookup.assign(bundle, dst)
        assert settled.dst_broker is not None
        return settled.dst_broker

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
        value = await self._checks.known(bundle)
        owner = self._checks.owner(bundle, value)
        if owner != self._me:
            raise PreconditionError(
                f"bundle {bundle} is owned by {owner}: split it on that broker's sidecar"
            )
        # A split ends by cutting the namespace layout in the store: started while the store is
        # unreachable, it would stay Splitting until the leader rolled it back.
        self._checks.reachable("split a bundle (its namespace layout is in the store)")
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
