"""Choosing a broker for a bundle: filters, then ``least_resource_usage_with_weight``.

Pulsar's extensible load manager narrows the available brokers with a pipeline of filters and
hands the rest to a selection strategy. Here each filter is a pure function that also says why it
dropped a broker, and :func:`select_broker` composes them into one decision with a reason fit for
the one-line decision log. Filter order: max topics, version, isolation, anti-affinity; the last
one only ranks what the hard filters left.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from lbd.core.bundles import parse_bundle_id
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData
from lbd.core.names import NamespaceName
from lbd.core.namespace import IsolationPolicy, NamespacePolicies
from lbd.core.settings import AssignmentConfig


@dataclass(frozen=True, slots=True)
class BrokerCandidate:
    """What the filters need to know of an available broker."""

    broker: BrokerId
    version: str | None = None
    topics: int = 0
    """Topics the broker serves, from its latest load report."""


@dataclass(frozen=True, slots=True)
class Exclusion:
    """A broker a filter dropped, and why."""

    broker: BrokerId
    filter: str
    why: str

    def __str__(self) -> str:
        return f"{self.broker} ({self.filter}: {self.why})"


@dataclass(frozen=True, slots=True)
class FilterResult:
    """The candidates a filter kept and the ones it dropped."""

    kept: tuple[BrokerCandidate, ...]
    excluded: tuple[Exclusion, ...] = ()


def _split(
    candidates: Iterable[BrokerCandidate], name: str, why_not: Mapping[BrokerId, str]
) -> FilterResult:
    kept = tuple(c for c in candidates if c.broker not in why_not)
    excluded = tuple(Exclusion(b, name, why) for b, why in sorted(why_not.items()))
    return FilterResult(kept, excluded)


def max_topics_filter(candidates: Sequence[BrokerCandidate], max_topics: int) -> FilterResult:
    """Drop brokers serving ``max_topics`` topics or more (Pulsar ``BrokerMaxTopicCountFilter``)."""
    return _split(
        candidates,
        "max_topics",
        {
            c.broker: f"serves {c.topics} topics, limit {max_topics}"
            for c in candidates
            if c.topics >= max_topics
        },
    )


def version_filter(candidates: Sequence[BrokerCandidate], required: str | None) -> FilterResult:
    """Keep only brokers reporting the ``required`` version; keep all when none is required."""
    if required is None:
        return FilterResult(tuple(candidates))
    return _split(
        candidates,
        "version",
        {
            c.broker: (
                f"reports no version, {required!r} required"
                if c.version is None
                else f"runs {c.version!r}, {required!r} required"
            )
            for c in candidates
            if c.version != required
        },
    )


def isolation_filter(
    candidates: Sequence[BrokerCandidate],
    policy: IsolationPolicy | None,
    cluster_policies: Iterable[IsolationPolicy] = (),
) -> FilterResult:
    """Apply the namespace's isolation policy (Pulsar ``BrokerIsolationPoliciesFilter``).

    With a policy: its primary brokers, plus its secondary ones while fewer than
    ``min_available_primaries`` primaries are candidates. Without one: every broker that is not
    primary for any policy of ``cluster_policies`` (those are reserved for isolated namespaces).
    """
    why_not: dict[BrokerId, str] = {}
    if policy is None:
        reserved = list(cluster_policies)
        for c in candidates:
            if any(p.is_primary(c.broker) for p in reserved):
                why_not[c.broker] = "reserved as primary of an isolated namespace"
        return _split(candidates, "isolation", why_not)
    primaries = [c for c in candidates if policy.is_primary(c.broker)]
    failover = len(primaries) < policy.min_available_primaries
    for c in candidates:
        if policy.is_primary(c.broker):
            continue
        if not policy.is_secondary(c.broker):
            why_not[c.broker] = "neither primary nor secondary in the isolation policy"
        elif not failover:
            why_not[c.broker] = (
                f"secondary, not needed: {len(primaries)} primaries available, "
                f"minimum {policy.min_available_primaries}"
            )
    return _split(candidates, "isolation", why_not)


def anti_affinity_counts(
    group: str,
    ownership: Mapping[BundleId, BrokerId],
    groups: Mapping[NamespaceName, str],
) -> dict[BrokerId, int]:
    """Per broker, how many namespaces of anti-affinity ``group`` it owns a bundle of.

    ``ownership`` maps bundles to their owners; ``groups`` maps namespaces to their group (groups
    compare case-insensitively, as in Pulsar). Brokers owning none are absent.
    """
    wanted = group.casefold()
    namespaces: dict[BrokerId, set[NamespaceName]] = {}
    for bundle, broker in ownership.items():
        namespace = parse_bundle_id(bundle).namespace
        ns_group = groups.get(namespace)
        if ns_group is not None and ns_group.casefold() == wanted:
            namespaces.setdefault(broker, set()).add(namespace)
    return {broker: len(owned) for broker, owned in namespaces.items()}


def anti_affinity_filter(
    candidates: Sequence[BrokerCandidate], group: str | None, counts: Mapping[BrokerId, int]
) -> FilterResult:
    """Keep the brokers owning the fewest namespaces of the group (Pulsar's anti-affinity rule).

    ``counts`` comes from :func:`anti_affinity_counts`. Never empties a non-empty candidate set:
    when every broker already owns some, those owning the fewest stay.
    """
    if group is None or not candidates:
        return FilterResult(tuple(candidates))
    least = min(counts.get(c.broker, 0) for c in candidates)
    return _split(
        candidates,
        "anti_affinity",
        {
            c.broker: f"owns {counts.get(c.broker, 0)} namespace(s) of group {group!r}, "
            f"another candidate owns {least}"
            for c in candidates
            if counts.get(c.broker, 0) > least
        },
    )


def least_usage_pool(
    candidates: Iterable[BrokerId], load_data: Mapping[BrokerId, BrokerLoadData], margin: float
) -> tuple[list[BrokerId], str]:
    """The brokers ``least_resource_usage_with_weight`` picks from (sorted), and why.

    As Pulsar's ``LeastResourceUsageWithWeight``: the average is that of the weighted-max EMAs of
    the candidates that have load data; those with ``ema + margin <= avg`` are best; when none
    is, every candidate (with load data or not) is in the pool.
    """
    everyone = sorted(set(candidates))
    if not everyone:
        return [], "no candidate"
    loads = {b: load_data[b].weighted_max_ema for b in everyone if b in load_data}
    if not loads:
        return everyone, f"random among {len(everyone)}: no load data"
    avg = sum(loads.values()) / len(loads)
    best = [b for b in everyone if b in loads and loads[b] + margin <= avg]
    if best:
        return (
            best,
            f"random among {len(best)} of {len(everyone)} with load <= avg {avg:.3f} - {margin:g}",
        )
    return (
        everyone,
        f"random among all {len(everyone)}: none with load <= avg {avg:.3f} - {margin:g}",
    )


def least_resource_usage_with_weight(
    candidates: Iterable[BrokerId],
    load_data: Mapping[BrokerId, BrokerLoadData],
    config: AssignmentConfig,
    rng: random.Random,
) -> BrokerId | None:
    """A broker among the least loaded candidates, at random; None without candidates."""
    pool, _ = least_usage_pool(candidates, load_data, config.load_margin)
    return rng.choice(pool) if pool else None


@dataclass(frozen=True, slots=True)
class Placement:
    """What the filters need to know about the bundle's namespace and the cluster."""

    policies: NamespacePolicies = field(default_factory=NamespacePolicies)
    """Policies of the bundle's namespace."""
    cluster_isolation: tuple[IsolationPolicy, ...] = ()
    """Isolation policies of every namespace: their primaries are reserved."""
    ownership: Mapping[BundleId, BrokerId] = field(default_factory=dict)
    """Current owner of each bundle, for anti-affinity."""
    anti_affinity_groups: Mapping[NamespaceName, str] = field(default_factory=dict)
    """Anti-affinity group of each namespace that has one."""


@dataclass(frozen=True, slots=True)
class Selection:
    """The chosen broker (None when no candidate is left), why, and who was filtered out."""

    broker: BrokerId | None
    reason: str
    excluded: tuple[Exclusion, ...] = ()


def filter_candidates(
    bundle: BundleId,
    candidates: Sequence[BrokerCandidate],
    config: AssignmentConfig,
    placement: Placement | None = None,
) -> FilterResult:
    """The candidates every filter keeps for ``bundle``, and the ones dropped with why."""
    placement = placement or Placement()
    namespace = parse_bundle_id(bundle).namespace
    seen: set[BrokerId] = set()
    for c in candidates:
        if c.broker in seen:
            raise InvalidInputError(f"broker {c.broker} is listed twice among the candidates")
        seen.add(c.broker)
    policies = placement.policies
    group = policies.anti_affinity_group
    counts: Mapping[BrokerId, int] = {}
    if group is not None:
        # The namespace itself counts, so its own bundles spread too (as in Pulsar).
        groups = {**placement.anti_affinity_groups, namespace: group}
        counts = anti_affinity_counts(group, placement.ownership, groups)
    steps: tuple[Callable[[Sequence[BrokerCandidate]], FilterResult], ...] = (
        lambda cs: max_topics_filter(cs, config.max_topics_per_broker),
        lambda cs: version_filter(cs, config.required_broker_version),
        lambda cs: isolation_filter(cs, policies.isolation, placement.cluster_isolation),
        lambda cs: anti_affinity_filter(cs, group, counts),
    )
    kept: tuple[BrokerCandidate, ...] = tuple(candidates)
    excluded: list[Exclusion] = []
    for step in steps:
        result = step(kept)
        kept = result.kept
        excluded.extend(result.excluded)
    return FilterResult(kept, tuple(excluded))


def select_broker(
    bundle: BundleId,
    candidates: Sequence[BrokerCandidate],
    load_data: Mapping[BrokerId, BrokerLoadData],
    config: AssignmentConfig,
    rng: random.Random,
    placement: Placement | None = None,
) -> Selection:
    """Filter ``candidates`` for ``bundle`` and pick one with the least-usage strategy."""
    filtered = filter_candidates(bundle, candidates, config, placement)
    kept, excluded = filtered.kept, filtered.excluded
    dropped = f"; excluded {', '.join(map(str, excluded))}" if excluded else ""
    if not kept:
        return Selection(
            None,
            f"no broker for {bundle}: {len(candidates)} candidate(s){dropped}",
            tuple(excluded),
        )
    pool, why = least_usage_pool((c.broker for c in kept), load_data, config.load_margin)
    broker = rng.choice(pool)
    return Selection(broker, f"{broker} for {bundle}: {why}{dropped}", tuple(excluded))


class PlacementRules:
    """The cluster's placement rules: every namespace's policies, as the filters read them.

    The assigner places and bounds moves by them (:mod:`lbd.services.cluster.assigner`), and the
    load model does the same (:mod:`lbd.workload.model`), so a generated cluster is held to the
    rules a live one is. A namespace without policies listed has none (it still keeps off the
    brokers an isolation policy reserves).
    """

    def __init__(self, policies: Mapping[NamespaceName, NamespacePolicies]) -> None:
        self.policies = dict(policies)
        self.isolation = tuple(
            p.isolation for _, p in sorted(self.policies.items()) if p.isolation is not None
        )
        """Every isolation policy: their primaries are reserved for their namespaces."""
        self.groups = {
            ns: p.anti_affinity_group
            for ns, p in self.policies.items()
            if p.anti_affinity_group is not None
        }
        """Anti-affinity group of each namespace that has one."""

    @property
    def binds(self) -> bool:
        """Whether any rule binds any bundle."""
        return bool(self.isolation or self.groups)

    def of(self, namespace: NamespaceName) -> NamespacePolicies:
        """The policies of ``namespace`` (none when it has none listed)."""
        return self.policies.get(namespace) or NamespacePolicies()

    def placement(
        self, namespace: NamespaceName, ownership: Mapping[BundleId, BrokerId]
    ) -> Placement:
        """What the filters need to place a bundle of ``namespace``, ``ownership`` being every
        bundle's owner (read only for an anti-affinity group)."""
        policies = self.of(namespace)
        grouped = policies.anti_affinity_group is not None
        return Placement(
            policies=policies,
            cluster_isolation=self.isolation,
            ownership=ownership if grouped else {},
            anti_affinity_groups=self.groups,
        )

    def allows(
        self,
        bundle: BundleId,
        broker: BrokerId,
        candidates: Sequence[BrokerCandidate],
        config: AssignmentConfig,
        owners: Mapping[BundleId, BrokerId],
    ) -> bool:
        """Whether ``bundle`` may move to ``broker`` now (``owners``: every bundle's owner, the
        bundle's own entry left out of its anti-affinity counts)."""
        namespace = parse_bundle_id(bundle).namespace
        if self.of(namespace).anti_affinity_group is not None:
            owners = {b: o for b, o in owners.items() if b != bundle}
        kept = filter_candidates(bundle, candidates, config, self.placement(namespace, owners))
        return any(c.broker == broker for c in kept.kept)

    def at(
        self,
        candidates: Sequence[BrokerCandidate],
        config: AssignmentConfig,
        owners: Mapping[BundleId, BrokerId],
        everyone: frozenset[BrokerId] | None = None,
    ) -> MoveRules:
        """These rules over one instant of the cluster: ``candidates`` the brokers open to
        moves, ``owners`` every bundle's owner, ``everyone`` every registered broker (default:
        the candidates; a cordoned broker is no candidate)."""
        return MoveRules(self, candidates, config, owners, everyone)


Planned = Sequence[tuple[BundleId, BrokerId, BrokerId | None]]
"""Moves a shedding cycle already chose: bundle, source, destination (None: an unload)."""


class MoveRules:
    """The placement rules over one instant of the cluster: where each bundle may move, the
    moves the cycle already chose counted.

    Checked alone, each of two bundles of an anti-affinity group may move to a broker holding
    none of the group; both moving there in one cycle breaks the rule. So a strategy asks with
    the moves it chose so far (:meth:`allows`), and each is judged on the ownership as it will
    be when they are made. The filters are the assignment's (max topics, version, isolation),
    then anti-affinity's "fewest namespaces of the group", with the bundle itself left out.

    A cycle's moves only grow: the counts after them are kept and only the new ones added.
    """

    def __init__(
        self,
        rules: PlacementRules,
        candidates: Sequence[BrokerCandidate],
        config: AssignmentConfig,
        owners: Mapping[BundleId, BrokerId],
        everyone: frozenset[BrokerId] | None = None,
    ) -> None:
        self._rules = rules
        self._candidates = tuple(candidates)
        self._config = config
        self._open = frozenset(c.broker for c in candidates)
        self._everyone = self._open if everyone is None else everyone
        self._filtered: dict[NamespaceName, frozenset[BrokerId]] = {}
        self._now = _Counted(_GroupCounts(rules.groups, owners))
        self._after = self._now
        self._applied: list[tuple[BundleId, BrokerId, BrokerId | None]] = []

    def destinations(self, bundles: Iterable[BundleId]) -> dict[BundleId, frozenset[BrokerId]]:
        """For each of ``bundles`` that may not go to every registered broker, the brokers it
        may move to (while a broker is cordoned, every bundle is listed)."""
        out: dict[BundleId, frozenset[BrokerId]] = {}
        for bundle in bundles:
            kept = self.allowed(bundle)
            if kept != self._everyone:
                out[bundle] = kept
        return out

    def allows(self, bundle: BundleId, broker: BrokerId, planned: Planned = ()) -> bool:
        """Whether ``bundle`` may move to ``broker`` after the ``planned`` moves (of other
        bundles)."""
        return broker in self.allowed(bundle, planned)

    def placed(self, bundle: BundleId, broker: BrokerId) -> None:
        """``bundle``, which had no owner, now belongs to ``broker`` (a placement made bundle
        by bundle asks about the next with this one counted)."""
        self._now.move(bundle, broker)
        self._after = self._now
        self._applied = []

    def allowed(self, bundle: BundleId, planned: Planned = ()) -> frozenset[BrokerId]:
        """The candidates ``bundle`` may move to after the ``planned`` moves (of other
        bundles)."""
        namespace = parse_bundle_id(bundle).namespace
        group = self._rules.of(namespace).anti_affinity_group
        if group is None and not self._rules.isolation:
            return self._open
        kept = self._hosts(bundle, namespace)
        if group is None or not kept:
            return kept
        return self._counted(planned).fewest(bundle, namespace, group, kept)

    def hosts(self, bundle: BundleId) -> frozenset[BrokerId]:
        """The candidates ``bundle`` may be on whatever the other bundles' owners: every filter
        but anti-affinity's (the same for each bundle of a namespace)."""
        return self._hosts(bundle, parse_bundle_id(bundle).namespace)

    def _hosts(self, bundle: BundleId, namespace: NamespaceName) -> frozenset[BrokerId]:
        kept = self._filtered.get(namespace)
        if kept is None:
            unbound = dataclasses.replace(self._rules.of(namespace), anti_affinity_group=None)
            placement = dataclasses.replace(self._rules.placement(namespace, {}), policies=unbound)
            found = filter_candidates(bundle, self._candidates, self._config, placement)
            kept = self._filtered[namespace] = frozenset(c.broker for c in found.kept)
        return kept

    @property
    def isolates(self) -> bool:
        """Whether an isolation policy keeps some bundles off some brokers."""
        return bool(self._rules.isolation)

    def _counted(self, planned: Planned) -> _Counted:
        """The counts after ``planned``: those kept, with the moves not yet in them added."""
        if not planned:
            return self._now
        done = len(self._applied)
        if len(planned) < done or list(planned[:done]) != self._applied:
            self._after, self._applied, done = self._now.copy(), [], 0
        elif self._after is self._now:
            self._after = self._now.copy()
        for moved, src, dst in planned[done:]:
            self._after.move(moved, dst)
            self._applied.append((moved, src, dst))
        return self._after


class _Counted:
    """Anti-affinity counts and, per namespace, the brokers owning the fewest of its group."""

    def __init__(self, counts: _GroupCounts) -> None:
        self.counts = counts
        self._fewest: dict[NamespaceName, tuple[int, frozenset[BrokerId]]] = {}

    def copy(self) -> _Counted:
        return _Counted(self.counts.copy())

    def move(self, bundle: BundleId, dst: BrokerId | None) -> None:
        self.counts.move(bundle, dst)
        self._fewest.clear()

    def fewest(
        self, bundle: BundleId, namespace: NamespaceName, group: str, kept: frozenset[BrokerId]
    ) -> frozenset[BrokerId]:
        """Those of ``kept`` owning the fewest namespaces of ``group``, ``bundle`` left out.
        Leaving it out changes at most its owner's count: the rest is worked out once per
        namespace."""
        counts = self.counts.counts(group)
        fewest = self._fewest.get(namespace)
        if fewest is None:
            least = min(counts.get(b, 0) for b in kept)
            fewest = self._fewest[namespace] = (
                least,
                frozenset(b for b in kept if counts.get(b, 0) == least),
            )
        least, brokers = fewest
        owner = self.counts.owner_if_alone(group, bundle)
        if owner is None or owner not in kept:
            return brokers
        mine = counts.get(owner, 0) - 1
        if mine < least:
            return frozenset((owner,))
        return brokers | {owner} if mine == least else brokers


class _GroupCounts:
    """:func:`anti_affinity_counts` of every group at once, for many bundles of one ownership
    (kept up to date by :meth:`move` while a placement or a plan is made bundle by bundle)."""

    def __init__(
        self,
        groups: Mapping[NamespaceName, str],
        owners: Mapping[BundleId, BrokerId] | None = None,
    ) -> None:
        self._keyed = {ns: g.casefold() for ns, g in groups.items()}
        self._owners: dict[BundleId, BrokerId] = {}
        # group -> broker -> namespace -> bundles of it the broker owns
        self._held: dict[str, dict[BrokerId, dict[NamespaceName, int]]] = {}
        self._base: dict[str, dict[BrokerId, int]] = {}
        if self._keyed:
            for bundle, broker in (owners or {}).items():
                self.move(bundle, broker)

    def copy(self) -> _GroupCounts:
        """Counts to change apart from these."""
        out = _GroupCounts({})
        out._keyed = self._keyed
        out._owners = dict(self._owners)
        out._held = {
            g: {b: dict(held) for b, held in brokers.items()} for g, brokers in self._held.items()
        }
        out._base = {g: dict(counts) for g, counts in self._base.items()}
        return out

    def move(self, bundle: BundleId, dst: BrokerId | None) -> None:
        """``bundle`` now belongs to ``dst`` (None: to nobody, an unload)."""
        namespace = parse_bundle_id(bundle).namespace
        group = self._keyed.get(namespace)
        if group is None:
            return
        src = self._owners.pop(bundle, None)
        if src is not None:
            self._shift(group, namespace, src, -1)
        if dst is not None:
            self._owners[bundle] = dst
            self._shift(group, namespace, dst, 1)

    def _shift(self, group: str, namespace: NamespaceName, broker: BrokerId, by: int) -> None:
        held = self._held.setdefault(group, {}).setdefault(broker, {})
        before = held.get(namespace, 0)
        held[namespace] = before + by
        base = self._base.setdefault(group, {})
        base[broker] = base.get(broker, 0) + (before + by > 0) - (before > 0)

    def counts(self, group: str) -> Mapping[BrokerId, int]:
        """Per broker, the namespaces of ``group`` it owns a bundle of (not to be changed)."""
        return self._base.get(group.casefold(), {})

    def owner_if_alone(self, group: str, bundle: BundleId) -> BrokerId | None:
        """The owner of ``bundle`` if it is the only bundle of its namespace there (leaving it
        out changes that broker's count of ``group``), else None."""
        owner = self._owners.get(bundle)
        if owner is None:
            return None
        namespace = parse_bundle_id(bundle).namespace
        held = self._held.get(group.casefold(), {}).get(owner, {})
        return owner if held.get(namespace) == 1 else None
