"""Choosing a broker for a bundle: filters, then ``least_resource_usage_with_weight``.

Pulsar's extensible load manager narrows the available brokers with a pipeline of filters and
hands the rest to a selection strategy. Here each filter is a pure function that also says why it
dropped a broker, and :func:`select_broker` composes them into one decision with a reason fit for
the one-line decision log. Filter order: max topics, version, isolation, anti-affinity; the last
one only ranks what the hard filters left.
"""

from __future__ import annotations

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
