"""The safety auditor's checks, as functions of plain data (the leader runs them:
:mod:`lbd.services.leader.auditor`, whose docstring tells an operator what each finding means).

The leader's ownership monitor repairs orphans and stuck in-flight values within known bounds.
The auditor checks that it did: each check allows the bound the monitor works to plus a *slack*
of two monitor sweeps (:class:`AuditBounds`), so a finding means that a repair did not happen in
time, not that one is under way. It also compares every sidecar's table with the leader's (by a
digest taken at the same channel position, :class:`DigestHistory`) and looks at the lookups each
sidecar answered with an owner that has left.

Every :class:`Finding` names what to do about it: an operator reads it in ``lbd ctl audit``.
"""

from __future__ import annotations

import bisect
import enum
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final

from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.settings import MonitorConfig
from lbd.core.state import ServiceUnitState, ServiceUnitStateData, server_of
from lbd.core.table import DIGEST_MODULUS, ChannelPosition

_S = ServiceUnitState

CONFIRMING_REPORTS: Final = 2
"""A sidecar's table is reported divergent once this many of its load reports in a row disagree
with the leader's table at their positions: one odd report never sends an operator to restart a
sidecar."""

_BEFORE_ANY: Final = ChannelPosition(-1, -1, -1)
"""Stands for "no message applied yet" in :class:`DigestHistory` (positions are >= 0)."""

_HEX_DIGEST = re.compile(r"[0-9a-f]{16}")


class FindingKind(enum.StrEnum):
    """What the auditor found (the ``kind`` of a finding and of ``lbd_audit_findings``)."""

    STALE_OWNER = "stale_owner"
    """A bundle Owned by a broker that left the registry longer ago than the monitor needs."""
    STUCK_IN_FLIGHT = "stuck_in_flight"
    """A bundle Assigning, Releasing or Splitting longer than the monitor lets it."""
    TABLE_DIVERGENCE = "table_divergence"
    """A sidecar whose table differs from the leader's at the same channel position."""
    LOOKUP_DEAD_OWNER = "lookup_dead_owner"
    """A sidecar answering lookups with an owner that left, past the time a failover explains."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing the auditor found wrong, and what an operator should do about it."""

    kind: FindingKind
    bundle: BundleId | None
    """The bundle concerned (None for a sidecar's divergent table)."""
    broker: BrokerId | None
    """The broker concerned: the gone owner, the stuck bundle's server, or the sidecar."""
    detail: str
    """What is wrong, with the numbers."""
    action: str
    """What to do about it."""
    since_ms: int = 0
    """When the auditor first saw it, in consecutive audits (set by :class:`FindingTracker`;
    0 on a finding fresh from a check)."""

    @property
    def key(self) -> tuple[FindingKind, str]:
        """What identifies the finding from one audit to the next: its bundle, or for the
        findings about a sidecar (divergence, lookups) the sidecar."""
        if self.kind in (FindingKind.TABLE_DIVERGENCE, FindingKind.LOOKUP_DEAD_OWNER):
            return self.kind, self.broker or ""
        return self.kind, self.bundle or ""


@dataclass(frozen=True, slots=True)
class AuditBounds:
    """How long the monitor may take before a problem becomes a finding (seconds)."""

    grace_s: float
    """G, ``monitor.orphan_cleanup_grace_s``: a gone broker's bundles are announced after it."""
    inflight_s: float
    """I, ``monitor.inflight_timeout_s``: an older in-flight value with a live server is fixed."""
    handover_s: float
    """D, the hand-over wait: an announced move off a gone broker is handed over after it."""
    slack_s: float
    """Added to every bound: two monitor sweeps (it acts at its first sweep past a bound)."""
    monitor_interval_s: float = 0.0
    """The monitor's sweep interval, named in the findings' actions."""
    unseen_extra_s: float = 0.0
    """What a broker never seen registered waits on top of G (``MonitorConfig.unseen_extra_s``)."""

    @classmethod
    def of(cls, monitor: MonitorConfig, handover_wait_s: float) -> AuditBounds:
        """The bounds of a monitor configured with ``monitor`` and ``handover_wait_s``."""
        return cls(
            grace_s=monitor.orphan_cleanup_grace_s,
            inflight_s=monitor.inflight_timeout_s,
            handover_s=handover_wait_s,
            slack_s=2 * monitor.interval_s,
            monitor_interval_s=monitor.interval_s,
            unseen_extra_s=monitor.unseen_extra_s,
        )

    @property
    def announce_due_s(self) -> float:
        """Away this long, a gone broker's bundles should have been announced (G + slack)."""
        return self.grace_s + self.slack_s


# -- what a sidecar publishes for the audit (with its load report) ---------------------------


@dataclass(frozen=True, slots=True)
class DeadOwnerAnswers:
    """The lookups a sidecar answered with an owner its broker registry does not have."""

    count: int = 0
    """How many since the sidecar started."""
    bundle: BundleId | None = None
    """The bundle of the latest one."""
    owner: BrokerId | None = None
    """The owner the latest one named."""
    away_s: float | None = None
    """How long the sidecar's registry had seen that owner gone when it answered (None: it
    never saw it registered)."""

    def answered(self, bundle: BundleId, owner: BrokerId, away_s: float | None) -> DeadOwnerAnswers:
        """These answers and one more."""
        return DeadOwnerAnswers(self.count + 1, bundle, owner, away_s)


@dataclass(frozen=True, slots=True)
class AuditData:
    """What a sidecar publishes with its load report for the leader's safety auditor.

    Carried in the ``audit`` object of :class:`~lbd.core.load.BrokerLoadData`'s JSON; a report
    without it (an older sidecar) is not audited.
    """

    position: ChannelPosition | None
    """The last channel position its table applied (None: none yet)."""
    digest: int
    """Its table's :attr:`~lbd.core.table.StateTable.digest` at ``position``."""
    dead_owners: DeadOwnerAnswers = field(default_factory=DeadOwnerAnswers)

    def __post_init__(self) -> None:
        if not isinstance(self.digest, int) or not 0 <= self.digest < DIGEST_MODULUS:
            raise InvalidInputError(f"digest must be a 64-bit unsigned integer, got {self.digest}")

    def to_json_object(self) -> dict[str, object]:
        """The JSON object (the digest as 16 hex digits: JSON numbers lose 64-bit precision)."""
        d = self.dead_owners
        return {
            "position": None if self.position is None else self.position.to_json(),
            "digest": f"{self.digest:016x}",
            "dead_owner_lookups": d.count,
            "dead_owner_bundle": d.bundle,
            "dead_owner_broker": d.owner,
            "dead_owner_away_s": d.away_s,
        }

    @classmethod
    def from_json_object(cls, obj: object, what: str) -> AuditData:
        """Read :meth:`to_json_object`'s output; InvalidInputError naming the wrong field."""
        if not isinstance(obj, dict):
            raise InvalidInputError(f"{what} must be a JSON object, got {obj!r}")
        raw_position = obj.get("position")
        try:
            position = None if raw_position is None else ChannelPosition.from_json(raw_position)
        except InvalidInputError as e:
            raise InvalidInputError(f"{what}.position: {e}") from None
        digest = obj.get("digest")
        if not isinstance(digest, str) or not _HEX_DIGEST.fullmatch(digest):
            raise InvalidInputError(f"{what}.digest must be 16 hex digits, got {digest!r}")
        count = obj.get("dead_owner_lookups", 0)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise InvalidInputError(
                f"{what}.dead_owner_lookups must be an integer >= 0, got {count!r}"
            )
        away = obj.get("dead_owner_away_s")
        if away is not None and (not isinstance(away, int | float) or isinstance(away, bool)):
            raise InvalidInputError(f"{what}.dead_owner_away_s must be a number, got {away!r}")
        bundle = _optional_text(obj, "dead_owner_bundle", what)
        owner = _optional_text(obj, "dead_owner_broker", what)
        answers = DeadOwnerAnswers(
            count,
            None if bundle is None else BundleId(bundle),
            None if owner is None else BrokerId(owner),
            None if away is None else float(away),
        )
        return cls(position, int(digest, 16), answers)


def _optional_text(obj: Mapping[str, Any], name: str, what: str) -> str | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise InvalidInputError(f"{what}.{name} must be a non-blank string or null, got {value!r}")
    return value


# -- the table and the registry --------------------------------------------------------------


def value_age_s(
    bundle: BundleId,
    value: ServiceUnitStateData,
    now_ms: int,
    first_seen_ms: Mapping[tuple[BundleId, int], int],
) -> float:
    """Seconds since ``value`` was written (its timestamp), or, for a writer that sets none,
    since the auditor first saw it (``first_seen_ms`` by bundle and version; now if never)."""
    written = value.timestamp_ms or first_seen_ms.get((bundle, value.version_id), now_ms)
    return (now_ms - written) / 1000


def check_bundle(
    bundle: BundleId,
    value: ServiceUnitStateData,
    *,
    live: Collection[BrokerId],
    away_s: Mapping[BrokerId, float],
    age_s: float,
    responsible_s: float,
    bounds: AuditBounds,
) -> Finding | None:
    """The finding about one bundle's value, if any.

    ``live``: the registered brokers; ``away_s``: how long each unregistered broker has been
    away; ``age_s``: the value's age (:func:`value_age_s`); ``responsible_s``: how long this
    leader's monitor has been able to act (since it was elected, or safe mode ended). Every
    duration is cut to ``responsible_s``: a monitor is not late for what happened before it ran.
    """
    server = server_of(value)
    age = min(age_s, responsible_s)
    if server is not None and server not in live:
        away = min(away_s.get(server, 0.0), responsible_s)
        if value.state is _S.Owned:
            if away <= bounds.announce_due_s:
                return None
            return _stale_owner(bundle, server, away, bounds)
        if value.state is _S.Releasing:
            # The announcement of an orphan's move: it is handed over D after it was seen.
            if away <= bounds.announce_due_s + bounds.handover_s or age <= (
                bounds.handover_s + bounds.slack_s
            ):
                return None
            return _stuck_handover(bundle, value, server, away, age, bounds)
        if away <= bounds.announce_due_s:
            return None
        return _stuck_orphan(bundle, value, server, away, bounds)
    if value.state.is_in_flight and age > bounds.inflight_s + bounds.slack_s:
        return _stuck(bundle, value, server, age, bounds)
    return None


def check_table(
    values: Iterable[tuple[BundleId, ServiceUnitStateData]],
    *,
    live: Collection[BrokerId],
    away_s: Mapping[BrokerId, float],
    now_ms: int,
    first_seen_ms: Mapping[tuple[BundleId, int], int],
    responsible_s: float,
    bounds: AuditBounds,
) -> list[Finding]:
    """:func:`check_bundle` over every value of a table, in bundle order."""
    findings = []
    for bundle, value in sorted(values, key=lambda bv: bv[0]):
        finding = check_bundle(
            bundle,
            value,
            live=live,
            away_s=away_s,
            age_s=value_age_s(bundle, value, now_ms, first_seen_ms),
            responsible_s=responsible_s,
            bounds=bounds,
        )
        if finding is not None:
            findings.append(finding)
    return findings


def _monitor_evidence(bundle: BundleId) -> str:
    return (
        f"check the leader's log for 'monitor' lines about {bundle} (a 'could not fix' line says "
        "why) and `lbd ctl decisions`"
    )


def _stale_owner(bundle: BundleId, owner: BrokerId, away: float, b: AuditBounds) -> Finding:
    return Finding(
        FindingKind.STALE_OWNER,
        bundle,
        owner,
        f"Owned by {owner}, which left the broker registry {away:.0f}s ago; the leader's monitor "
        f"announces a gone broker's bundles {b.grace_s:g}s after it left (monitor."
        f"orphan_cleanup_grace_s) at its next sweep (every {b.monitor_interval_s:g}s)",
        f"Nobody serves {bundle}. The leader's monitor should have moved it off {owner}: "
        f"{_monitor_evidence(bundle)}. Usual causes: no live broker may take it (isolation "
        "policy, assignment.max_topics_per_broker, required version: `lbd ctl brokers`), or the "
        f"leader cannot reach etcd (safe mode). If {owner} is gone for good, `lbd ctl transfer "
        f"{bundle} <live broker>` announces the move by hand; the leader still hands it over "
        f"after the hand-over wait ({b.handover_s:g}s), so fix what stops its monitor too.",
    )


def _stuck_orphan(
    bundle: BundleId, value: ServiceUnitStateData, server: BrokerId, away: float, b: AuditBounds
) -> Finding:
    state = value.state.value
    return Finding(
        FindingKind.STUCK_IN_FLIGHT,
        bundle,
        server,
        f"{state} with {server}, which left the broker registry {away:.0f}s ago; the leader's "
        f"monitor announces a gone broker's bundles {b.grace_s:g}s after it left "
        f"(monitor.orphan_cleanup_grace_s)",
        f"The {state} cannot finish without {server}, and the leader's monitor should have moved "
        f"{bundle} off it: {_monitor_evidence(bundle)}. Usual causes: no live broker may take it "
        "(`lbd ctl brokers`), or the leader cannot reach etcd (safe mode).",
    )


def _stuck_handover(
    bundle: BundleId,
    value: ServiceUnitStateData,
    server: BrokerId,
    away: float,
    age: float,
    b: AuditBounds,
) -> Finding:
    dst = value.dst_broker or "a live broker"
    return Finding(
        FindingKind.STUCK_IN_FLIGHT,
        bundle,
        server,
        f"Releasing from {server} (left the broker registry {away:.0f}s ago) to {dst} for "
        f"{age:.0f}s; the leader hands an announced move over {b.handover_s:g}s after it saw "
        "it (the hand-over wait)",
        f"Nobody serves {bundle} until the hand-over. The leader writes Assigning({dst}) only "
        f"after reading from etcd itself that {server} is still unregistered: check that the "
        f"leader reaches etcd, and {_monitor_evidence(bundle)}. If {dst} cannot take it, the "
        "monitor picks another live broker; `lbd ctl brokers` shows which are left.",
    )


def _stuck(
    bundle: BundleId,
    value: ServiceUnitStateData,
    server: BrokerId | None,
    age: float,
    b: AuditBounds,
) -> Finding:
    state = value.state
    detail = (
        f"{state.value} for {age:.0f}s (src {value.source_broker or '-'}, dst "
        f"{value.dst_broker or '-'}); the leader's monitor fixes an in-flight value after "
        f"{b.inflight_s:g}s (monitor.inflight_timeout_s)"
    )
    who = server or "-"
    if state is _S.Assigning:
        what = (
            f"The broker {who} never confirmed owning {bundle}: check that it is attached "
            f"(`lbd ctl brokers`) and its sidecar's log for Own acknowledgement timeouts. The "
            f"monitor should have moved it on (a Releasing from {who})"
        )
    elif state is _S.Releasing:
        what = (
            f"The sidecar of {who} did not finish releasing {bundle} (its broker never "
            f"acknowledged Release, or the sidecar is stuck): check that sidecar's log for "
            f"{bundle}, and restart it if it is wedged. The monitor should have given {bundle} "
            f"back to {who}"
        )
    else:
        what = (
            f"The split of {bundle} on the sidecar of {who} did not finish: check that "
            f"sidecar's log for 'split' and `lbd ctl bundles` for the children. The monitor "
            "should have finished it or undone it"
        )
    return Finding(
        FindingKind.STUCK_IN_FLIGHT, bundle, server, detail, f"{what}: {_monitor_evidence(bundle)}."
    )


# -- the sidecars' tables --------------------------------------------------------------------


class DigestHistory:
    """The leader's table digest at each of its recent channel positions, in bounded memory.

    Built from the table's position and digest at one moment, then told every accepted change
    after it, in channel order (:meth:`record`): the digest is the same from one recorded
    position up to the next, since only accepted changes change it. The oldest entries are
    dropped beyond ``limit``, so only positions since the oldest kept one can be answered.
    """

    def __init__(self, position: ChannelPosition | None, digest: int, *, limit: int) -> None:
        if limit < 1:
            raise InvalidInputError(f"digest history limit must be >= 1, got {limit}")
        self._limit = limit
        self._positions = [_BEFORE_ANY if position is None else position]
        self._digests = [digest]

    @property
    def latest(self) -> int:
        """The digest after the last recorded change."""
        return self._digests[-1]

    @property
    def last_recorded(self) -> ChannelPosition | None:
        """The position of the last recorded change (or of the start; None: before any)."""
        last = self._positions[-1]
        return None if last == _BEFORE_ANY else last

    def record(self, position: ChannelPosition, digest: int) -> None:
        """The table's digest is ``digest`` from ``position`` on (an accepted change there)."""
        if position <= self._positions[-1]:
            return  # replayed: the table refuses it too
        self._positions.append(position)
        self._digests.append(digest)
        if len(self._positions) > 2 * self._limit:
            # Trimmed in halves: amortised O(1) per change, never more than 2 * limit kept.
            del self._positions[: -self._limit]
            del self._digests[: -self._limit]

    def at(
        self, position: ChannelPosition | None, *, known_until: ChannelPosition | None
    ) -> int | None:
        """The leader's digest at ``position`` (None: the table had applied nothing yet); None
        when it is not known: older than the oldest entry kept, or past ``known_until`` (up to
        where every accepted change has been recorded)."""
        wanted = _BEFORE_ANY if position is None else position
        until = _BEFORE_ANY if known_until is None else known_until
        if wanted > until:
            return None
        index = bisect.bisect_right(self._positions, wanted) - 1
        if index < 0:
            return None
        return self._digests[index]

    def __len__(self) -> int:
        return len(self._positions)


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A sidecar's digest that differs from the leader's at the same position."""

    position: ChannelPosition | None
    theirs: int
    ours: int
    reports: int
    """Consecutive reports of the sidecar that disagreed."""


class DivergenceTracker:
    """Confirms a sidecar's divergence over :data:`CONFIRMING_REPORTS` of its reports in a row.

    A report that agrees clears the sidecar; one that cannot be compared (its position is not
    in the leader's :class:`DigestHistory`) changes nothing; the same report seen again in a
    later audit does not count twice.
    """

    def __init__(self) -> None:
        self._mismatches: dict[BrokerId, tuple[int, Mismatch]] = {}

    def observe(
        self,
        sidecar: BrokerId,
        report_id: int,
        position: ChannelPosition | None,
        theirs: int,
        ours: int | None,
    ) -> Mismatch | None:
        """Note one comparison (``ours`` None: not comparable); the sidecar's confirmed
        mismatch, or None."""
        previous = self._mismatches.get(sidecar)
        if ours is not None and ours == theirs:
            self._mismatches.pop(sidecar, None)
            return None
        if ours is not None and (previous is None or previous[0] != report_id):
            reports = 1 if previous is None else previous[1].reports + 1
            previous = (report_id, Mismatch(position, theirs, ours, reports))
            self._mismatches[sidecar] = previous
        if previous is None or previous[1].reports < CONFIRMING_REPORTS:
            return None
        return previous[1]

    def retain(self, sidecars: Collection[BrokerId]) -> None:
        """Forget every sidecar but ``sidecars`` (those still reporting)."""
        self._mismatches = {s: m for s, m in self._mismatches.items() if s in sidecars}


def divergence(
    sidecar: BrokerId,
    mismatch: Mismatch,
    *,
    address: str | None,
    leader: BrokerId,
    disagreeing: int,
    compared: int,
) -> Finding:
    """The finding of a sidecar whose table differs from the leader's (``leader``); when most
    of the ``compared`` sidecars disagree, the leader's own table is the likelier culprit."""
    at = "the start" if mismatch.position is None else str(mismatch.position)
    server = f"--server {address} " if address else ""
    action = (
        f"Restart sidecar {sidecar}: it rebuilds its table from the newest checkpoint and the "
        f"channel. Before that, compare `lbd ctl {server}bundles` with the leader's `lbd ctl "
        f"bundles` to see which bundles differ, and keep its log ('malformed' and 'rejected' "
        "lines): a difference at the same position is a bug worth reporting."
    )
    if compared >= 2 and 2 * disagreeing > compared:
        action = (
            f"{disagreeing} of {compared} sidecars disagree with the leader {leader}: its own "
            f"table is the likelier odd one out. Restart the leader's sidecar {leader} first "
            f"(another sidecar takes over the lead), then audit again. {action}"
        )
    return Finding(
        FindingKind.TABLE_DIVERGENCE,
        None,
        sidecar,
        f"at channel position {at} its table digest is {mismatch.theirs:016x}, the leader's is "
        f"{mismatch.ours:016x} ({mismatch.reports} reports in a row disagree)",
        action,
    )


# -- the lookups -----------------------------------------------------------------------------


class DeadOwnerWatch:
    """Tells, from each sidecar's running count of dead-owner answers, whether it answered
    more since the previous audit (a first count, or one that went down with a restart, only
    sets the baseline)."""

    def __init__(self) -> None:
        self._counts: dict[BrokerId, int] = {}

    def grew(self, sidecar: BrokerId, count: int) -> bool:
        """Whether ``sidecar``'s count grew since the previous call for it."""
        previous = self._counts.get(sidecar)
        self._counts[sidecar] = count
        return previous is not None and count > previous

    def retain(self, sidecars: Collection[BrokerId]) -> None:
        """Forget every sidecar but ``sidecars``."""
        self._counts = {s: c for s, c in self._counts.items() if s in sidecars}


def check_dead_owner_answers(
    sidecar: BrokerId,
    answers: DeadOwnerAnswers,
    *,
    registered: bool,
    leader_away_s: float | None,
    leader_value: ServiceUnitStateData | None,
    responsible_s: float,
    bounds: AuditBounds,
) -> Finding | None:
    """The finding about a sidecar that answered lookups with a gone owner since the previous
    audit (``answers``: its latest), unless a failover explains it.

    A broker that left has its bundles answered with it as owner (and no address) until the
    leader announces their move, which is due G + slack after it left; such answers are the
    failover, not a finding. Past that the sidecar's registry is behind etcd (``registered``:
    the leader sees the owner registered), or the monitor did not move the bundle (the
    leader's ``leader_value`` still has that server), or the sidecar's table is behind.
    ``leader_away_s`` is how long the leader has seen the owner gone (None: registered).
    """
    owner, bundle = answers.owner, answers.bundle
    if owner is None or bundle is None:
        return None
    away = answers.away_s
    if away is None:  # the sidecar never saw it registered: the leader's view decides
        away = float("inf") if registered else (leader_away_s or 0.0)
    if min(away, responsible_s) <= bounds.announce_due_s:
        return None
    detail = (
        f"{answers.count} lookups answered with an owner missing from its broker registry; the "
        f"latest: {bundle} -> {owner}"
        + ("" if answers.away_s is None else f", gone {answers.away_s:.0f}s in its view")
    )
    if registered:
        return Finding(
            FindingKind.LOOKUP_DEAD_OWNER,
            bundle,
            sidecar,
            f"{detail}; the leader sees {owner} registered",
            f"Sidecar {sidecar}'s view of the broker registry is behind etcd: it sends clients "
            f"of {owner}'s bundles off without an address. Check its connection to etcd (its log: "
            f"'metadata store unreachable, safe mode'); if it does not catch up, restart "
            f"sidecar {sidecar}: it lists the registry again at start.",
        )
    if server_of(leader_value) == owner:
        return Finding(
            FindingKind.LOOKUP_DEAD_OWNER,
            bundle,
            sidecar,
            f"{detail}; the leader's table still has {bundle} with {owner}",
            f"Clients of {bundle} are sent to {owner}, which left: the leader's monitor did not "
            f"move the bundle in time. See the stale_owner or stuck_in_flight finding of "
            f"{bundle} and do what it says.",
        )
    now = "no value" if leader_value is None else leader_value.state.value
    held = server_of(leader_value)
    return Finding(
        FindingKind.LOOKUP_DEAD_OWNER,
        bundle,
        sidecar,
        f"{detail}; the leader's table has {bundle} {now}" + (f" with {held}" if held else ""),
        f"Sidecar {sidecar}'s table is behind the channel (it still gives {bundle} to {owner}): "
        f"see its table_divergence finding, if any, and restart sidecar {sidecar}: it rebuilds "
        "its table from the newest checkpoint and the channel.",
    )


# -- findings over time ----------------------------------------------------------------------


class FindingTracker:
    """Dates findings: ``since_ms`` is when a finding was first seen, in consecutive audits."""

    def __init__(self) -> None:
        self._first_seen: dict[tuple[FindingKind, str], int] = {}

    def update(self, findings: Iterable[Finding], now_ms: int) -> tuple[Finding, ...]:
        """This audit's findings, each with its ``since_ms``, sorted by kind then subject; a
        finding absent from this audit is forgotten."""
        seen: dict[tuple[FindingKind, str], int] = {}
        dated = []
        for finding in findings:
            since = self._first_seen.get(finding.key, now_ms)
            seen[finding.key] = since
            dated.append(replace(finding, since_ms=since))
        self._first_seen = seen
        return tuple(sorted(dated, key=lambda f: (f.kind.value, f.key[1], f.bundle or "")))


@dataclass(frozen=True, slots=True)
class AuditReport:
    """One audit: its findings and what it looked at."""

    findings: tuple[Finding, ...]
    checked_at_ms: int
    bundles_checked: int
    """Table values checked against the registry (0 when skipped)."""
    sidecars_compared: int
    """Sidecars whose table digest could be compared with the leader's."""
    not_compared: tuple[BrokerId, ...] = ()
    """Sidecars whose report could not be compared (no digest, or a position the leader does
    not have: too old, or ahead of the leader)."""
    skipped: str | None = None
    """Why the table and lookup checks were skipped (safe mode, the channel not caught up)."""

    def counts(self) -> dict[FindingKind, int]:
        """How many findings of each kind (every kind present)."""
        counts = dict.fromkeys(FindingKind, 0)
        for finding in self.findings:
            counts[finding.kind] += 1
        return counts
