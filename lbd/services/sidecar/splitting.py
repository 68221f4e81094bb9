"""The split scheduler: every sidecar splits its own broker's hot bundles (DESIGN §7).

Every ``split.interval_s`` it snapshots the per-bundle and per-topic stats of the broker's latest
load report, which of those bundles the channel says this broker owns, the bundles Splitting in
the channel and each namespace's bundle count, then asks the pure decision
(:func:`lbd.core.split.find_bundles_to_split`) which to split, carrying the hit counts from cycle
to cycle. Each decision goes to :meth:`Operations.split`, which runs the split protocol (and
computes the split points again from the report of that moment, normally the same one). The
decision's failures are counted as ``lbd_split_total{result="Failure",reason="Unknown"}``, as
Pulsar counts them. A sidecar with no broker attached has no per-bundle stats and splits nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping

from lbd.core.broker_info import LoadReport
from lbd.core.bundles import TopicLoad, parse_bundle_id, topic_hash
from lbd.core.errors import LbdError, NotFoundError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.names import NamespaceName
from lbd.core.settings import SplitConfig
from lbd.core.split import SplitPlan, SplitSnapshot, SplitState, find_bundles_to_split
from lbd.core.state import ServiceUnitState, owner_of
from lbd.metrics import FAILURE, UNKNOWN_REASON, Metrics
from lbd.ports.clock import Clock
from lbd.ports.errors import UnavailableError
from lbd.services.channel.follower import ChannelFollower
from lbd.services.cluster.namespaces import NamespaceService
from lbd.services.sidecar.assign_split import Operations
from lbd.services.sidecar.broker_link import BrokerLink
from lbd.tasks import Component, Tasks

_log = logging.getLogger(__name__)


class SplitScheduler(Component):
    """Finds ``me``'s hot bundles each cycle and splits them."""

    def __init__(
        self,
        me: BrokerId,
        operations: Operations,
        follower: ChannelFollower,
        link: BrokerLink,
        namespaces: NamespaceService,
        clock: Clock,
        config: SplitConfig,
        *,
        interval_s: float,
        metrics: Metrics | None = None,
        on_death: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        self._me = me
        self._operations = operations
        self._follower = follower
        self._link = link
        self._namespaces = namespaces
        self._clock = clock
        self._config = config
        self._interval_s = interval_s
        self._metrics = metrics
        self._on_death = on_death
        self._state = SplitState()
        self._tasks = Tasks(f"the split scheduler of {me}")

    @property
    def state(self) -> SplitState:
        """The hit counts carried into the next cycle."""
        return self._state

    async def start(self) -> None:
        """Run a cycle every interval in a guarded task; returns at once."""
        if not self._tasks:
            self._tasks.spawn(self._run(), name="split-scheduler", on_death=self._on_death)

    async def close(self) -> None:
        """Stop the cycles. Idempotent."""
        await self._tasks.close()

    async def run_once(self) -> SplitPlan:
        """One cycle: snapshot, decide, then split each decided bundle.

        A split that fails (the bundle moved meanwhile, the store is down) is logged (and counted
        by :meth:`Operations.split`, which counts every split); the other decisions still go ahead.
        """
        snapshot = await self._snapshot()
        plan = find_bundles_to_split(snapshot, self._config, self._state)
        self._state = plan.state
        for bundle, why in plan.held_back:
            _log.debug("split of %s held back: %s", bundle, why)
        for bundle, why in plan.failures:
            _log.warning("split of %s failed: %s", bundle, why)
        if plan.failures and self._metrics is not None:
            failed = self._metrics.split_total.labels(result=FAILURE, reason=UNKNOWN_REASON)
            failed.inc(len(plan.failures))
        for decision in plan.decisions:
            try:
                outcome = await self._operations.split(
                    decision.bundle, decision.algorithm, [], reason=str(decision.reason)
                )
            except LbdError as e:
                _log.warning("split decision: %s failed: %s", decision, e)
                continue
            _log.info("split decision: %s -> %s", decision, ", ".join(outcome.children))
        return plan

    async def _snapshot(self) -> SplitSnapshot:
        """What the decision needs, read now: the latest report's stats, which of its bundles
        this broker owns, the bundles Splitting in the channel, the namespaces' bundle counts."""
        report = self._link.latest_report if self._link.attached else None
        if report is None:
            return SplitSnapshot(loads=(), owned=frozenset(), bundle_counts={})
        table = self._follower.table
        owned = frozenset(
            load.bundle for load in report.bundles if owner_of(table.get(load.bundle)) == self._me
        )
        counts, limits = await self._namespace_sizes(owned)
        return SplitSnapshot(
            loads=report.bundles,
            owned=owned,
            bundle_counts=counts,
            max_bundles=limits,
            splitting=[b for b, v in table.unowned() if v.state is ServiceUnitState.Splitting],
            topics=_OwnedTopics(report, owned),
        )

    async def _namespace_sizes(
        self, bundles: frozenset[BundleId]
    ) -> tuple[dict[NamespaceName, int], dict[NamespaceName, int]]:
        """Each namespace's bundle count, and its own max bundles where its policies set one.

        A namespace whose record cannot be read is left out: the decision counts a failure for
        each of its bundles that would split.
        """
        counts: dict[NamespaceName, int] = {}
        limits: dict[NamespaceName, int] = {}
        for namespace in sorted({parse_bundle_id(b).namespace for b in bundles}):
            try:
                record = await self._namespaces.get(namespace)
            except (NotFoundError, UnavailableError) as e:
                _log.warning("split: no bundle count for namespace %s: %s", namespace, e)
                continue
            counts[namespace] = len(record.bundles())
            if record.policies.max_bundles is not None:
                limits[namespace] = record.policies.max_bundles
        return counts, limits

    async def _run(self) -> None:
        while True:
            await self._clock.sleep(self._interval_s)
            try:
                await self.run_once()
            except LbdError as e:
                _log.warning("split cycle failed: %s", e)


class _OwnedTopics(Mapping[BundleId, list[TopicLoad]]):
    """Each owned bundle's topics in the report, made when the decision asks for them: it does
    only for a bundle about to split, and a report of thousands of bundles is not converted
    whole every cycle."""

    def __init__(self, report: LoadReport, owned: frozenset[BundleId]) -> None:
        self._report = report
        self._owned = owned

    def __getitem__(self, bundle: BundleId) -> list[TopicLoad]:
        if bundle not in self._owned:
            raise KeyError(bundle)
        return _topics(self._report, bundle)

    def __iter__(self) -> Iterator[BundleId]:
        return iter(self._owned)

    def __len__(self) -> int:
        return len(self._owned)


def _topics(report: LoadReport, bundle: BundleId) -> list[TopicLoad]:
    """The bundle's topics in the report (ones that hash elsewhere, from a report older than a
    split, are left out)."""
    bundle_range = parse_bundle_id(bundle).range
    return [t for t in report.topics_of(bundle) if topic_hash(t.topic) in bundle_range]
