"""The leader's safety auditor: always on, it checks that the cluster's repairs happen in time.

The ownership monitor (:mod:`lbd.services.leader.monitor`) moves the bundles of gone brokers and
fixes stuck in-flight values, each within a bound. Every ``operations.audit_interval_s`` the
auditor checks that it did, and that every sidecar sees the same table. A finding means a repair
did NOT happen in time, never that one is under way: every bound below includes a *slack* of two
monitor sweeps (``2 * monitor.interval_s``), and a bound counts only from when this leader's
monitor could act (its election, or the end of safe mode). Findings are the gauge
``lbd_audit_findings{kind}`` and ``lbd ctl audit``, which prints each with what to do.

Notation: G = ``monitor.orphan_cleanup_grace_s``, I = ``monitor.inflight_timeout_s``, D = the
hand-over wait (``etcd.channel_fence_after_s + broker.serving_lease_s +
etcd.fence_margin_s``), S = the slack.

``stale_owner``: a bundle Owned by a broker missing from the registry for more than G + S.
    The monitor announces a gone broker's bundles (a forced ``Releasing``) G after it left, so
    nobody serves this one and nobody is about to. Action: read the leader's log lines
    starting with ``monitor`` about the bundle ("could not fix" says why: usually no live
    broker may take it, by isolation policy, ``assignment.max_topics_per_broker`` or required
    version) and ``lbd ctl decisions``; check that the leader reaches etcd (safe mode stops all
    repairs); ``lbd ctl transfer`` announces the move by hand, but the hand-over still comes
    from the leader's monitor.

``stuck_in_flight``: a bundle Assigning, Releasing or Splitting for longer than its bound.
    With its server (the broker that may be serving it) registered, the bound is I + S: the
    monitor moves an Assigning on, gives a Releasing back to its source, finishes or undoes a
    Splitting after I. The action names the sidecar whose step did not finish (the new
    owner's Own acknowledgement, the source's Release, the split) and the monitor's log.
    With its server gone, an Assigning or Splitting is due to be announced after G + S like an
    Owned bundle; an announced ``Releasing`` is due to be handed over D after the announcement
    (bound: the server gone G + D + S, and the value older than D + S). Action: the leader's
    ``monitor`` lines; the hand-over needs the leader to read from etcd that the broker is still
    gone, and a live broker to take the bundle.

``table_divergence``: a sidecar whose table differs from the leader's at the same channel
    position. Each sidecar publishes its table's position and digest
    (:attr:`~lbd.core.table.StateTable.digest`, kept in O(1) per change) with its load report;
    the leader keeps its own digest at each of its recent positions (a bounded
    :class:`~lbd.core.audit.DigestHistory`, fed by the channel follower's change feed) and
    compares a report only at a position it has: one it has dropped already, or one it has not
    reached, is counted as not compared. Two of the sidecar's reports in a row must disagree, so
    that one odd report never sends an operator to restart a sidecar. Action: restart that
    sidecar (it rebuilds its table from the newest checkpoint and the channel) after comparing
    ``lbd ctl bundles`` on it and on the leader; when most sidecars disagree with the leader,
    restart the leader's sidecar first.

``lookup_dead_owner``: a sidecar that, since the previous audit, answered lookups with an owner
    missing from its registry (``lbd_lookup_dead_owner_total`` on that sidecar counts every
    one), past the point a failover explains: that owner gone more than G + S in the sidecar's
    view. Until then it is the failover (the table still names the gone owner until the move is
    announced), not a finding. Action, by cause: the leader sees the owner registered (the
    sidecar's registry is behind etcd: check its connection, restart it); the leader's table
    still has the bundle with the gone owner (see its stale_owner finding); or the sidecar's
    table is behind (restart it).

The table and lookup checks are skipped while the registry is unreachable (safe mode: the
monitor repairs nothing then either) and until the channel has been caught up with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

from lbd.core.audit import (
    AuditBounds,
    AuditReport,
    DeadOwnerWatch,
    DigestHistory,
    DivergenceTracker,
    Finding,
    FindingTracker,
    Mismatch,
    check_dead_owner_answers,
    check_table,
    divergence,
)
from lbd.core.broker_info import BrokerInfo
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData
from lbd.core.state import server_of
from lbd.core.table import ChannelPosition
from lbd.metrics import Metrics
from lbd.ports.clock import Clock
from lbd.services.channel.follower import ChannelFollower
from lbd.services.cluster.loads import LoadView
from lbd.services.cluster.registry import BrokerRegistry, GoneBrokers
from lbd.tasks import yield_now

_log = logging.getLogger(__name__)

DIGEST_HISTORY = 8192
"""Positions of the leader's own digest kept for comparison (8192 to 16384 of them, a few MB at
most). A report read by an audit is up to a report interval plus an audit interval old (40 s
by default), which this covers up to about 200 accepted changes a second; on a busier channel
some reports are counted as not compared, never compared wrongly."""
_FEED_TURNS = 10
"""Loop turns an audit gives the digest feed to catch up with the table before comparing."""
AUDIT_SLICE = 2_000
"""The table check lets the event loop run after each slice of this many bundles."""


class _DigestFeed:
    """The leader's :class:`DigestHistory`, fed by every change the follower accepts.

    It knows how far its history is complete: every accepted change is counted by the follower
    (``stats.accepted``) as it is queued for the feed, so when the feed has taken as many as the
    follower accepted, no change is still queued and the history covers the table's position.
    """

    def __init__(self, follower: ChannelFollower, limit: int) -> None:
        self._follower = follower
        self._limit = limit
        self._history: DigestHistory | None = None
        self._taken = 0

    async def run(self) -> None:
        """Follow the change feed until cancelled."""
        # Subscribing and reading the table in one step: no change is missed or seen twice.
        changes = self._follower.changes()
        table = self._follower.table
        self._history = DigestHistory(table.last_position, table.digest, limit=self._limit)
        self._taken = self._follower.stats.accepted
        async with contextlib.aclosing(changes):
            async for change in changes:
                self._history.record(change.position, change.digest)
                self._taken += 1

    @property
    def caught_up(self) -> bool:
        """Whether every change the follower accepted is in the history."""
        return self._history is not None and self._taken == self._follower.stats.accepted

    def at(self, position: ChannelPosition | None) -> int | None:
        """The leader's digest at ``position``; None when the history does not cover it."""
        if self._history is None:
            return None
        known = self._follower.table.last_position if self.caught_up else None
        until = known if known is not None else self._history.last_recorded
        return self._history.at(position, known_until=until)


class SafetyAuditor:
    """The leader duty that audits the table, the registry and the sidecars' reports."""

    name = "safety-auditor"
    """The leader duty's name."""

    def __init__(
        self,
        me: BrokerId,
        follower: ChannelFollower,
        registry: BrokerRegistry,
        loads: LoadView,
        clock: Clock,
        *,
        bounds: AuditBounds,
        interval_s: float,
        metrics: Metrics,
        history_limit: int = DIGEST_HISTORY,
    ) -> None:
        """``bounds``: the monitor's, from :meth:`AuditBounds.of`; ``interval_s``: between
        audits (``operations.audit_interval_s``); ``history_limit``: positions of the leader's
        own digest kept."""
        self._me = me
        self._follower = follower
        self._registry = registry
        self._loads = loads
        self._clock = clock
        self._bounds = bounds
        self._interval_s = interval_s
        self._metrics = metrics
        self._history_limit = history_limit
        self._lock = asyncio.Lock()
        self._latest: AuditReport | None = None
        self._feed: _DigestFeed | None = None
        self._responsible_from: float | None = None
        """Since when this leader's monitor could act (None: not leading, or in safe mode)."""
        self._findings = FindingTracker()
        self._divergence = DivergenceTracker()
        self._dead_owners = DeadOwnerWatch()
        self._gone = GoneBrokers(registry, unseen_extra_s=bounds.unseen_extra_s)
        """Gone brokers, counted from when this sidecar noticed them if it did not see them go
        (as the monitor counts them)."""
        self._undated: dict[tuple[BundleId, int], int] = {}
        """Values without a timestamp, by (bundle, version): when the auditor first saw them."""

    @property
    def latest(self) -> AuditReport | None:
        """The last audit's report (None before the first)."""
        return self._latest

    async def run_leading(self, term: int) -> None:
        """The leader duty: follow the digests and audit every interval until cancelled."""
        feed = _DigestFeed(self._follower, self._history_limit)
        self._begin(feed)
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(feed.run(), name="safety-auditor-digests")
                tasks.create_task(self._audit_every_interval(), name="safety-auditor-audits")
        finally:
            self._end()

    async def _audit_every_interval(self) -> None:
        while True:
            await self._clock.sleep(self._interval_s)
            await self.run_once()

    def _begin(self, feed: _DigestFeed) -> None:
        """Start afresh for a new term: nothing seen yet, no finding yet."""
        self._feed = feed
        self._latest = None
        self._responsible_from = self._clock.monotonic()
        self._findings = FindingTracker()
        self._divergence = DivergenceTracker()
        self._dead_owners = DeadOwnerWatch()
        self._gone.clear()
        self._undated.clear()
        self._metrics.observe_audit({}, None)

    def _end(self) -> None:
        self._feed = None
        self._responsible_from = None
        self._metrics.observe_audit({}, None)

    async def run_once(self) -> AuditReport:
        """One audit now; its report (also :attr:`latest`, the metrics and one log line per new
        finding)."""
        async with self._lock:
            report = await self._audit()
        previous, self._latest = self._latest, report
        self._metrics.observe_audit(report.counts(), report.checked_at_ms)
        still = {f.key for f in report.findings}
        for finding in () if previous is None else previous.findings:
            if finding.key not in still:
                _log.info(
                    "audit finding cleared: kind=%s bundle=%s broker=%s",
                    finding.kind.value,
                    finding.bundle or "-",
                    finding.broker or "-",
                )
        for finding in report.findings:
            if finding.since_ms == report.checked_at_ms:
                _log.warning(
                    "audit finding: kind=%s bundle=%s broker=%s: %s. Action: %s",
                    finding.kind.value,
                    finding.bundle or "-",
                    finding.broker or "-",
                    finding.detail,
                    finding.action,
                )
        return report

    async def _audit(self) -> AuditReport:
        now_ms, now = self._clock.now_ms(), self._clock.monotonic()
        skipped = self._skip_reason(now)
        responsible_s = 0.0 if self._responsible_from is None else now - self._responsible_from
        live = self._registry.brokers()
        findings: list[Finding] = []
        checked = 0
        if skipped is None:
            checked = await self._check_table(findings, live, now_ms, now, responsible_s)
        reports = self._loads.brokers()
        await self._let_feed_catch_up()
        diverging, compared, not_compared = self._compare(reports, live)
        findings += diverging
        for sidecar, data in sorted(reports.items()):
            finding = self._dead_owner_finding(sidecar, data, live, now, responsible_s, skipped)
            if finding is not None:
                findings.append(finding)
        self._dead_owners.retain(reports.keys())
        return AuditReport(
            findings=self._findings.update(findings, now_ms),
            checked_at_ms=now_ms,
            bundles_checked=checked,
            sidecars_compared=compared,
            not_compared=tuple(not_compared),
            skipped=skipped,
        )

    def _skip_reason(self, now: float) -> str | None:
        """Why the table and lookup checks cannot run now; restarts the bounds after safe mode."""
        if not self._follower.is_ready:
            return "the channel is not caught up yet"
        if not self._registry.reachable:
            if self._feed is not None:
                self._responsible_from = None
            return "safe mode: the broker registry cannot be reached (the monitor waits too)"
        if self._feed is not None and self._responsible_from is None:
            self._responsible_from = now
        return None

    # -- the table and the registry ---------------------------------------------------------

    async def _check_table(
        self,
        findings: list[Finding],
        live: Mapping[BrokerId, BrokerInfo],
        now_ms: int,
        now: float,
        responsible_s: float,
    ) -> int:
        """Check every bundle of the table, a slice at a time with the event loop let run in
        between; add the findings in bundle order; the number of bundles checked."""
        table = self._follower.table
        bundles = table.bundles()
        found: list[Finding] = []
        away: dict[BrokerId, float] = {}
        first_seen: dict[tuple[BundleId, int], int] = {}
        checked = 0
        for start in range(0, len(bundles), AUDIT_SLICE):
            if start:
                await yield_now()
            values = [
                (b, v)
                for b in bundles[start : start + AUDIT_SLICE]
                if (v := table.get(b)) is not None
            ]
            for bundle, value in values:
                server = server_of(value)
                if server is not None and server not in live and server not in away:
                    away[server] = self._gone.away_s(server, now)
                if value.timestamp_ms == 0:
                    key = (bundle, value.version_id)
                    first_seen[key] = self._undated.get(key, now_ms)
            found += check_table(
                values,
                live=live,
                away_s=away,
                now_ms=now_ms,
                first_seen_ms=first_seen,
                responsible_s=responsible_s,
                bounds=self._bounds,
            )
            checked += len(values)
        self._gone.keep_only(away)
        self._undated = first_seen
        findings += sorted(found, key=lambda f: f.bundle or "")
        return checked

    # -- the sidecars -------------------------------------------------------------------------

    async def _let_feed_catch_up(self) -> None:
        feed = self._feed
        for _ in range(_FEED_TURNS):
            if feed is None or feed.caught_up:
                return
            await yield_now()

    def _compare(
        self, reports: Mapping[BrokerId, BrokerLoadData], live: Mapping[BrokerId, BrokerInfo]
    ) -> tuple[list[Finding], int, list[BrokerId]]:
        """Each sidecar's digest against the leader's at its position: the divergence findings,
        how many sidecars were compared, and which could not be."""
        confirmed: list[tuple[BrokerId, Mismatch]] = []
        not_compared: list[BrokerId] = []
        compared = disagreeing = 0
        for sidecar, data in sorted(reports.items()):
            audit = data.audit
            if audit is None:
                not_compared.append(sidecar)
                continue
            ours = None if self._feed is None else self._feed.at(audit.position)
            if ours is None:
                not_compared.append(sidecar)
            else:
                compared += 1
                disagreeing += ours != audit.digest
            mismatch = self._divergence.observe(
                sidecar, data.reported_at_ms, audit.position, audit.digest, ours
            )
            if mismatch is not None:
                confirmed.append((sidecar, mismatch))
        self._divergence.retain(reports.keys())
        findings = [
            divergence(
                sidecar,
                mismatch,
                address=None if (info := live.get(sidecar)) is None else info.sidecar_grpc_addr,
                leader=self._me,
                disagreeing=disagreeing,
                compared=compared,
            )
            for sidecar, mismatch in confirmed
        ]
        return findings, compared, not_compared

    def _dead_owner_finding(
        self,
        sidecar: BrokerId,
        data: BrokerLoadData,
        live: Mapping[BrokerId, BrokerInfo],
        now: float,
        responsible_s: float,
        skipped: str | None,
    ) -> Finding | None:
        if data.audit is None:
            return None
        answers = data.audit.dead_owners
        if not self._dead_owners.grew(sidecar, answers.count) or skipped is not None:
            return None
        owner, bundle = answers.owner, answers.bundle
        if owner is None or bundle is None:
            return None
        registered = owner in live
        return check_dead_owner_answers(
            sidecar,
            answers,
            registered=registered,
            leader_away_s=None if registered else self._gone.away_s(owner, now),
            leader_value=self._follower.get(bundle),
            responsible_s=responsible_s,
            bounds=self._bounds,
        )
