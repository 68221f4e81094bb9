"""Which of its own bundles a sidecar splits (Pulsar ``DefaultNamespaceBundleSplitStrategyImpl``).

A cycle takes the broker's per-bundle stats in report order and, for each bundle, in Pulsar's
order:

1. fewer than 2 topics: skipped;
2. not owned by this broker: skipped;
3. a range too small to split: skipped and counted as a failure;
4. over a limit of :class:`SplitConfig` (checked in the order topics, sessions, message rate,
   bandwidth, each strictly greater than its limit; a sessions limit of 0 or less is off): its
   hit count grows by one; within every limit: its hit count is dropped;
5. a hit count not greater than ``hit_count_threshold``: not yet (3 splits on the 4th hot cycle
   in a row, 0 on the first);
6. its namespace's bundle count unknown: a failure; the count plus the bundles this cycle's
   splits add to that namespace at its max (its policies' ``max_bundles``, else
   ``max_bundles_per_namespace``): held back;
7. overlapping a bundle that is Splitting in the channel (its own parent, mostly): held back;
8. the configured algorithm gives no split point: a failure; points that would take the
   namespace over its max (only an algorithm giving several can): held back;
9. otherwise it is split, its hit count dropped, and the cycle stops once it has
   ``max_splits_per_cycle`` splits: the bundles after it are not looked at.

A bundle skipped at steps 1 to 3, or not looked at, keeps its hit count as it was; one held back
or failed at steps 6 to 8 keeps the count it just reached. Counts of bundles no longer in the
stats are dropped. The caller carries the counts from cycle to cycle.

Three differences from Pulsar are kept, each for a case where Pulsar's answer is wrong:

- At step 7 Pulsar holds back a bundle whose range starts or ends where a Splitting one's does,
  in a namespace whose name the Splitting bundle's id merely starts with. The middle child of a
  three-way split (specified positions, flow or QPS) shares neither end with its parent, so
  Pulsar lets it split while the parent's split is unfinished; and a Splitting bundle of
  ``t/ns-b`` holds back bundles of ``t/ns``, which share no topic with it. Ours holds back a
  bundle of the same namespace whose range overlaps the Splitting one's (tests/unit/test_split.py
  ``test_kept_difference_the_middle_child_of_a_three_way_split_is_held_back``,
  ``test_kept_difference_another_namespace_never_holds_back``).
- At step 8 Pulsar refuses more than one split point, so with ``flow_or_qps_equally_divide`` a
  bundle whose traffic needs three runs or more to stay within the limits (four topics each at
  0.6 of the message rate limit, say), the case the algorithm exists for, never splits: a failure
  every cycle. Ours splits it at every point
  (``test_kept_difference_flow_or_qps_splits_at_every_point``).
- ``specified_positions_divide`` is refused as the automatic algorithm, as it needs an
  operator's positions: Pulsar accepts it, then counts a failure for every bundle it would split,
  every cycle, and splits none
  (``test_kept_difference_specified_positions_cannot_be_automatic``).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence, Set
from dataclasses import dataclass, field
from enum import StrEnum

from lbd.core.bundles import (
    Bundle,
    BundleRange,
    SplitAlgorithm,
    TopicLoad,
    parse_bundle_id,
    split_positions,
)
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BundleId
from lbd.core.load import BundleLoad
from lbd.core.names import NamespaceName
from lbd.core.settings import MB, SplitConfig


class SplitReason(StrEnum):
    """The limit a split bundle was over (Pulsar ``SplitDecision.Reason`` names, metric labels)."""

    TOPICS = "Topics"
    SESSIONS = "Sessions"
    MSG_RATE = "MsgRate"
    BANDWIDTH = "Bandwidth"


@dataclass(frozen=True, slots=True)
class SplitDecision:
    """Split ``bundle`` at ``points`` (what ``algorithm`` gave) because it was over ``reason``."""

    bundle: BundleId
    reason: SplitReason
    algorithm: SplitAlgorithm
    detail: str
    """The measurement against its limit, e.g. ``topics 1500 > 1000``."""
    points: tuple[int, ...]
    """Split points strictly inside the bundle's range, in order."""

    @property
    def children(self) -> tuple[BundleId, ...]:
        """The bundles the split makes, in hash order."""
        parent = parse_bundle_id(self.bundle)
        edges = (parent.range.lo, *self.points, parent.range.hi)
        return tuple(
            Bundle(parent.namespace, BundleRange(lo, hi)).id for lo, hi in itertools.pairwise(edges)
        )

    def __str__(self) -> str:
        at = ", ".join(f"0x{p:08x}" for p in self.points)
        return f"split {self.bundle} ({self.reason}: {self.detail}) with {self.algorithm} at {at}"


@dataclass(frozen=True, slots=True)
class SplitState:
    """Consecutive hot cycles of each bundle, carried across cycles."""

    hit_counts: Mapping[BundleId, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SplitSnapshot:
    """What one cycle decides on, read by the caller before deciding."""

    loads: Sequence[BundleLoad]
    """The broker's per-bundle stats, in the order of its report."""
    owned: Set[BundleId]
    """The bundles the channel says this broker owns."""
    bundle_counts: Mapping[NamespaceName, int]
    """Each namespace's number of bundles; a namespace left out is unknown (a failure)."""
    max_bundles: Mapping[NamespaceName, int] = field(default_factory=dict)
    """A namespace's own max bundles where its policies set one."""
    splitting: Collection[BundleId] = ()
    """Every bundle in the Splitting state in the channel, whoever splits it."""
    topics: Mapping[BundleId, Sequence[TopicLoad]] = field(default_factory=dict)
    """A bundle's topics with their traffic (topic_count and flow_or_qps split with them)."""


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """One cycle's outcome: the splits to do, the bundles held back and why, the failures (each
    counted as Pulsar's ``Failure``/``Unknown``), and the next state."""

    decisions: tuple[SplitDecision, ...]
    held_back: tuple[tuple[BundleId, str], ...]
    failures: tuple[tuple[BundleId, str], ...]
    state: SplitState


def hot_reason(load: BundleLoad, config: SplitConfig) -> tuple[SplitReason, str] | None:
    """The first limit the bundle is over, with the measurement; None when it is within all."""
    max_bytes = config.max_bandwidth_mb * MB
    if load.topics > config.max_topics:
        return SplitReason.TOPICS, f"topics {load.topics} > {config.max_topics}"
    if config.max_sessions > 0 and load.sessions > config.max_sessions:
        return SplitReason.SESSIONS, f"sessions {load.sessions} > {config.max_sessions}"
    if load.msg_rate > config.max_msg_rate:
        return SplitReason.MSG_RATE, f"msg rate {load.msg_rate:.1f}/s > {config.max_msg_rate:g}/s"
    if load.msg_throughput > max_bytes:
        return (
            SplitReason.BANDWIDTH,
            f"bandwidth {load.msg_throughput / MB:.1f} MB/s > {config.max_bandwidth_mb:g} MB/s",
        )
    return None


def automatic_algorithm(config: SplitConfig) -> SplitAlgorithm:
    """The configured algorithm; InvalidInputError for specified_positions_divide."""
    algorithm = SplitAlgorithm.parse(config.algorithm)
    if algorithm is SplitAlgorithm.SPECIFIED_POSITIONS_DIVIDE:
        raise InvalidInputError(
            "split algorithm specified_positions_divide needs positions from an operator; "
            "it cannot be the algorithm of automatic splits"
        )
    return algorithm


def find_bundles_to_split(
    snapshot: SplitSnapshot, config: SplitConfig, state: SplitState
) -> SplitPlan:
    """Decide this cycle's splits among the broker's bundles (the module docstring's steps)."""
    algorithm = automatic_algorithm(config)
    loads = list(snapshot.loads)
    bundles = [parse_bundle_id(load.bundle) for load in loads]
    seen: set[BundleId] = set()
    for load in loads:
        if load.bundle in seen:
            raise InvalidInputError(f"bundle {load.bundle} is reported twice")
        seen.add(load.bundle)
    splitting = [parse_bundle_id(b) for b in snapshot.splitting]
    counts = {b: n for b, n in state.hit_counts.items() if b in seen}
    decisions: list[SplitDecision] = []
    held_back: list[tuple[BundleId, str]] = []
    failures: list[tuple[BundleId, str]] = []
    pending: dict[NamespaceName, int] = {}

    def hold(load: BundleLoad, why: str) -> None:
        """Note a bundle over a limit that does not split (a cool one is not worth a line)."""
        if hot_reason(load, config) is not None:
            held_back.append((load.bundle, why))

    for i, (load, bundle) in enumerate(zip(loads, bundles, strict=True)):
        # Steps 1 to 3: not looked at further, the count left as it was.
        if load.topics < 2:
            hold(load, f"{load.topics} topic(s), at least 2 needed")
            continue
        if load.bundle not in snapshot.owned:
            hold(load, "not owned by this broker")
            continue
        if not bundle.range.can_split():
            failures.append((load.bundle, "range too small to split"))
            continue
        # Steps 4 and 5: the hit count.
        over = hot_reason(load, config)
        if over is None:
            counts.pop(load.bundle, None)
            continue
        count = counts[load.bundle] = counts.get(load.bundle, 0) + 1
        if count <= config.hit_count_threshold:
            held_back.append(
                (
                    load.bundle,
                    f"over a limit {count} cycle(s) in a row, splits after more than "
                    f"{config.hit_count_threshold}",
                )
            )
            continue
        # Steps 6 to 8: held back or failed, the count kept.
        namespace = bundle.namespace
        current = snapshot.bundle_counts.get(namespace)
        if current is None:
            failures.append((load.bundle, f"bundle count of namespace {namespace} unknown"))
            continue
        limit = snapshot.max_bundles.get(namespace, config.max_bundles_per_namespace)
        if current + pending.get(namespace, 0) >= limit:
            held_back.append((load.bundle, f"namespace {namespace} at its max of {limit} bundles"))
            continue
        parent = next((s for s in splitting if s.overlaps(bundle)), None)
        if parent is not None:
            held_back.append((load.bundle, f"overlaps {parent.id}, which is Splitting"))
            continue
        try:
            points = split_positions(
                algorithm,
                bundle.range,
                topics=snapshot.topics.get(load.bundle, ()),
                config=config,
                topic_count=load.topics,
            )
        except InvalidInputError as e:
            failures.append((load.bundle, f"no split point: {e}"))
            continue
        if current + pending.get(namespace, 0) + len(points) > limit:
            held_back.append(
                (
                    load.bundle,
                    f"{len(points) + 1} children would take namespace {namespace} over its max "
                    f"of {limit} bundles",
                )
            )
            continue
        # Step 9.
        reason, detail = over
        decisions.append(SplitDecision(load.bundle, reason, algorithm, detail, tuple(points)))
        pending[namespace] = pending.get(namespace, 0) + len(points)
        del counts[load.bundle]
        if len(decisions) == config.max_splits_per_cycle:
            for rest in loads[i + 1 :]:
                hold(rest, f"not looked at: the cycle cap of {config.max_splits_per_cycle} splits")
            break
    return SplitPlan(tuple(decisions), tuple(held_back), tuple(failures), SplitState(counts))
