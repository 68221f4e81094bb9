"""Which of its own bundles a sidecar splits (Pulsar ``DefaultNamespaceBundleSplitStrategyImpl``).

Each cycle takes the load of the bundles the broker owns. A bundle is hot when it is over one of
the limits of :class:`SplitConfig`, checked in Pulsar's order: topics, sessions, message rate,
bandwidth (each strictly greater than its limit). A hot bundle's hit count grows by one a cycle; a
bundle that is not hot, or no longer reported, loses its count. As in Pulsar, a bundle is split
once its count is **greater than** ``hit_count_threshold`` (the 4th hot cycle in a row with the
default 3), unless its namespace would exceed its max bundles, or the cycle already has
``max_splits_per_cycle`` splits. A bundle with fewer than 2 topics or too small a range never
splits. The state (hit counts) is carried from cycle to cycle by the caller.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from lbd.core.bundles import SplitAlgorithm, parse_bundle_id
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BundleId
from lbd.core.load import BundleLoad
from lbd.core.names import NamespaceName
from lbd.core.tuning import MB, SplitConfig


class SplitReason(StrEnum):
    """The limit a split bundle was over (Pulsar ``SplitDecision.Reason`` names, metric labels)."""

    TOPICS = "Topics"
    SESSIONS = "Sessions"
    MSG_RATE = "MsgRate"
    BANDWIDTH = "Bandwidth"


@dataclass(frozen=True, slots=True)
class SplitDecision:
    """Split ``bundle`` with ``algorithm`` because it was over the ``reason`` limit."""

    bundle: BundleId
    reason: SplitReason
    algorithm: SplitAlgorithm
    detail: str
    """The measurement against its limit, e.g. ``topics 1500 > 1000``."""

    def __str__(self) -> str:
        return f"split {self.bundle} ({self.reason}: {self.detail}) with {self.algorithm}"


@dataclass(frozen=True, slots=True)
class SplitState:
    """Consecutive hot cycles of each bundle, carried across cycles."""

    hit_counts: Mapping[BundleId, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """One cycle's outcome: the splits to do, the bundles held back and why, the next state."""

    decisions: tuple[SplitDecision, ...]
    held_back: tuple[tuple[BundleId, str], ...]
    state: SplitState


def hot_reason(load: BundleLoad, config: SplitConfig) -> tuple[SplitReason, str] | None:
    """The first limit the bundle is over, with the measurement; None when it is within all."""
    max_bytes = config.max_bandwidth_mb * MB
    if load.topics > config.max_topics:
        return SplitReason.TOPICS, f"topics {load.topics} > {config.max_topics}"
    if load.sessions > config.max_sessions:
        return SplitReason.SESSIONS, f"sessions {load.sessions} > {config.max_sessions}"
    if load.msg_rate > config.max_msg_rate:
        return SplitReason.MSG_RATE, f"msg rate {load.msg_rate:.1f}/s > {config.max_msg_rate:g}/s"
    if load.msg_throughput > max_bytes:
        return (
            SplitReason.BANDWIDTH,
            f"bandwidth {load.msg_throughput / MB:.1f} MB/s > {config.max_bandwidth_mb:g} MB/s",
        )
    return None


def _unsplittable(load: BundleLoad) -> str | None:
    """Why this bundle can never be split, or None."""
    if load.topics < 2:
        return f"{load.topics} topic(s), at least 2 needed"
    if not parse_bundle_id(load.bundle).range.can_split():
        return "range too small to split"
    return None


def find_bundles_to_split(
    loads: Sequence[BundleLoad],
    bundle_counts: Mapping[NamespaceName, int],
    config: SplitConfig,
    state: SplitState,
    max_bundles: Mapping[NamespaceName, int] | None = None,
) -> SplitPlan:
    """Decide this cycle's splits among the broker's own bundles.

    ``bundle_counts`` gives each namespace's current number of bundles; ``max_bundles`` each
    namespace's own limit where its policies set one (else ``config.max_bundles_per_namespace``).
    Bundles waiting longest (highest hit count) are split first when the cycle cap is reached.
    """
    algorithm = SplitAlgorithm.parse(config.algorithm)
    if algorithm is SplitAlgorithm.SPECIFIED_POSITIONS_DIVIDE:
        raise InvalidInputError(
            "split algorithm specified_positions_divide needs positions from an operator; "
            "it cannot be the algorithm of automatic splits"
        )
    limits = max_bundles or {}
    seen: set[BundleId] = set()
    held_back: list[tuple[BundleId, str]] = []
    counts: dict[BundleId, int] = {}
    hot: dict[BundleId, tuple[SplitReason, str]] = {}
    for load in loads:
        if load.bundle in seen:
            raise InvalidInputError(f"bundle {load.bundle} is reported twice")
        seen.add(load.bundle)
        over = hot_reason(load, config)
        if over is None:
            continue
        why_not = _unsplittable(load)
        if why_not is not None:
            held_back.append((load.bundle, f"over a limit but cannot split: {why_not}"))
            continue
        hot[load.bundle] = over
        counts[load.bundle] = state.hit_counts.get(load.bundle, 0) + 1

    ready = sorted(
        (b for b in hot if counts[b] > config.hit_count_threshold),
        key=lambda b: (-counts[b], b),
    )
    decisions: list[SplitDecision] = []
    pending: dict[NamespaceName, int] = {}
    for bundle in ready:
        namespace = parse_bundle_id(bundle).namespace
        if len(decisions) >= config.max_splits_per_cycle:
            held_back.append((bundle, f"cycle cap of {config.max_splits_per_cycle} splits reached"))
            continue
        current = bundle_counts.get(namespace)
        if current is None:
            held_back.append((bundle, f"bundle count of namespace {namespace} unknown"))
            continue
        limit = limits.get(namespace, config.max_bundles_per_namespace)
        if current + pending.get(namespace, 0) >= limit:
            held_back.append((bundle, f"namespace {namespace} at its max of {limit} bundles"))
            continue
        reason, detail = hot[bundle]
        decisions.append(SplitDecision(bundle, reason, algorithm, detail))
        pending[namespace] = pending.get(namespace, 0) + 1
        del counts[bundle]
    return SplitPlan(tuple(decisions), tuple(held_back), SplitState(counts))
