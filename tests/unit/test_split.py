"""The split decision: Pulsar's DefaultNamespaceBundleSplitStrategyTest scenarios, then the order of
its checks, hit counts, caps, failures, and the differences kept on purpose."""

from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace

import pytest

from lbd.config import load_settings
from lbd.core.bundles import SplitAlgorithm, TopicLoad, parse_bundle_id, topic_hash
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BundleId
from lbd.core.load import BundleLoad
from lbd.core.names import NamespaceName
from lbd.core.settings import MB, SplitConfig
from lbd.core.split import (
    SplitDecision,
    SplitPlan,
    SplitReason,
    SplitSnapshot,
    SplitState,
    find_bundles_to_split,
    hot_reason,
)

NS = NamespaceName("t", "ns")
OTHER_NS = NamespaceName("t", "other")
A = BundleId("t/ns/0x00000000_0x40000000")
B = BundleId("t/ns/0x40000000_0x80000000")
C = BundleId("t/ns/0x80000000_0xc0000000")
OTHER = BundleId("t/other/0x00000000_0xffffffff")
CONFIG = SplitConfig()


def hot(bundle: BundleId, topics: int = 2000) -> BundleLoad:
    """A bundle over the topics limit."""
    return BundleLoad(bundle, topics=topics)


def cool(bundle: BundleId) -> BundleLoad:
    return BundleLoad(bundle, topics=10)


def snap(
    *loads: BundleLoad,
    owned: Iterable[BundleId] | None = None,
    counts: Mapping[NamespaceName, int] | None = None,
    max_bundles: Mapping[NamespaceName, int] | None = None,
    splitting: Collection[BundleId] = (),
    topics: Mapping[BundleId, list[TopicLoad]] | None = None,
) -> SplitSnapshot:
    """A snapshot in which this broker owns every reported bundle unless ``owned`` says."""
    return SplitSnapshot(
        loads=loads,
        owned=frozenset(load.bundle for load in loads) if owned is None else frozenset(owned),
        bundle_counts={NS: 4, OTHER_NS: 1} if counts is None else counts,
        max_bundles=max_bundles or {},
        splitting=splitting,
        topics=topics or {},
    )


def run(
    cycles: int,
    snapshot: SplitSnapshot,
    config: SplitConfig = CONFIG,
    state: SplitState | None = None,
) -> SplitPlan:
    """The plan of the last of ``cycles`` cycles over the same snapshot."""
    plan = SplitPlan((), (), (), state or SplitState())
    for _ in range(cycles):
        plan = find_bundles_to_split(snapshot, config, plan.state)
    return plan


def split_bundles(plan: SplitPlan) -> list[BundleId]:
    return [d.bundle for d in plan.decisions]


# --- Pulsar's DefaultNamespaceBundleSplitStrategyTest ----------------------------------------
# Its setup: limits of 100 topics, 100 sessions, 100 msg/s, 100 MB/s, at most 100 bundles a
# namespace, 1 split a cycle, hit count threshold 3; two bundles of 5 topics in one namespace
# of 0 bundles (the mocked count), reported in this order. Its mocked split boundaries are
# those of range_equally_divide.

PULSAR_CONFIG = SplitConfig(
    max_topics=100,
    max_sessions=100,
    max_msg_rate=100,
    max_bandwidth_mb=100,
    max_bundles_per_namespace=100,
    max_splits_per_cycle=1,
    hit_count_threshold=3,
)
PULSAR_NS = NamespaceName("tenant", "namespace")
BUNDLE1 = BundleId("tenant/namespace/0x00000000_0xffffffff")
BUNDLE2 = BundleId("tenant/namespace/0x00000000_0x0fffffff")


def pulsar_snapshot(
    *, topics: int = 5, counts: Mapping[NamespaceName, int] | None = None, **stats: float
) -> SplitSnapshot:
    loads = [BundleLoad(b, topics=topics, **stats) for b in (BUNDLE1, BUNDLE2)]
    return snap(*loads, counts={PULSAR_NS: 0} if counts is None else counts)


HOT_MSG_RATE = {"msg_rate_in": PULSAR_CONFIG.max_msg_rate + 1}


def test_pulsar_threshold_zero_splits_on_the_first_hot_cycle() -> None:
    """testNamespaceBundleSplitConditionThreshold"""
    config = replace(PULSAR_CONFIG, hit_count_threshold=0)
    plan = find_bundles_to_split(pulsar_snapshot(**HOT_MSG_RATE), config, SplitState())
    assert len(plan.decisions) == 1


def test_pulsar_not_enough_topics() -> None:
    """testNotEnoughTopics"""
    config = replace(PULSAR_CONFIG, hit_count_threshold=0)
    plan = find_bundles_to_split(pulsar_snapshot(topics=1, **HOT_MSG_RATE), config, SplitState())
    assert plan.decisions == ()


def test_pulsar_namespace_maximum_bundles() -> None:
    """testNamespaceMaximumBundles"""
    config = replace(PULSAR_CONFIG, hit_count_threshold=0)
    snapshot = pulsar_snapshot(counts={PULSAR_NS: 100}, **HOT_MSG_RATE)
    assert find_bundles_to_split(snapshot, config, SplitState()).decisions == ()


def test_pulsar_empty_bundle_stats() -> None:
    """testEmptyBundleStats"""
    config = replace(PULSAR_CONFIG, hit_count_threshold=0)
    plan = find_bundles_to_split(snap(counts={PULSAR_NS: 0}), config, SplitState())
    assert plan.decisions == () and plan.failures == ()


def test_pulsar_no_bundle_owner() -> None:
    """testNoBundleOwner: nothing split, no failure counted."""
    config = replace(PULSAR_CONFIG, hit_count_threshold=0)
    loaded = pulsar_snapshot(**HOT_MSG_RATE)
    snapshot = snap(*loaded.loads, owned=(), counts=loaded.bundle_counts)
    plan = find_bundles_to_split(snapshot, config, SplitState())
    assert plan.decisions == () and plan.failures == ()


def test_pulsar_error_reading_the_bundle_count() -> None:
    """testError: the namespace's bundle count cannot be read; two failures counted."""
    config = replace(PULSAR_CONFIG, hit_count_threshold=0)
    plan = find_bundles_to_split(pulsar_snapshot(counts={}, **HOT_MSG_RATE), config, SplitState())
    assert plan.decisions == ()
    assert [b for b, _ in plan.failures] == [BUNDLE1, BUNDLE2]


def test_pulsar_splitting_bundle() -> None:
    """testSplittingBundle: BUNDLE1 is Splitting, BUNDLE2 starts where it does; no failure."""
    config = replace(PULSAR_CONFIG, hit_count_threshold=0)
    loaded = pulsar_snapshot(**HOT_MSG_RATE)
    snapshot = snap(*loaded.loads, counts=loaded.bundle_counts, splitting=[BUNDLE1])
    plan = find_bundles_to_split(snapshot, config, SplitState())
    assert plan.decisions == () and plan.failures == ()


@pytest.mark.parametrize(
    ("stats", "reason"),
    [
        # testMaxMsgRate
        ({"msg_rate_in": 100 // 2 + 1, "msg_rate_out": 100 // 2 + 1}, SplitReason.MSG_RATE),
        # testMaxTopics
        ({"topics": 100 + 1}, SplitReason.TOPICS),
        # testMaxSessions
        ({"producer_count": 100 // 2 + 1, "consumer_count": 100 // 2 + 1}, SplitReason.SESSIONS),
        # testMaxBandwidthMbytes
        (
            {"msg_throughput_in": 100 * MB // 2 + 1, "msg_throughput_out": 100 * MB // 2 + 1},
            SplitReason.BANDWIDTH,
        ),
    ],
)
def test_pulsar_each_limit_splits_one_bundle_a_cycle_after_the_threshold(
    stats: dict[str, float], reason: SplitReason
) -> None:
    """testMaxMsgRate, testMaxTopics, testMaxSessions, testMaxBandwidthMbytes: no split for three
    cycles, BUNDLE1 on the 4th (the cap of 1 stops the cycle), BUNDLE2 on the 5th."""
    snapshot = pulsar_snapshot(**stats)
    state = SplitState()
    for cycle in range(PULSAR_CONFIG.hit_count_threshold + 2):
        plan = find_bundles_to_split(snapshot, PULSAR_CONFIG, state)
        state = plan.state
        assert plan.failures == ()
        if cycle == PULSAR_CONFIG.hit_count_threshold:
            [decision] = plan.decisions
            assert (decision.bundle, decision.reason) == (BUNDLE1, reason)
            assert decision.children == (
                "tenant/namespace/0x00000000_0x7fffffff",
                "tenant/namespace/0x7fffffff_0xffffffff",
            )
            # BUNDLE2 was not looked at: its count did not move.
            assert state.hit_counts == {BUNDLE2: 3}
        elif cycle == PULSAR_CONFIG.hit_count_threshold + 1:
            [decision] = plan.decisions
            assert (decision.bundle, decision.reason) == (BUNDLE2, reason)
            assert decision.children == (
                "tenant/namespace/0x00000000_0x07ffffff",
                "tenant/namespace/0x07ffffff_0x0fffffff",
            )
            assert state.hit_counts == {BUNDLE1: 1}
        else:
            assert plan.decisions == ()


# --- limits ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("load", "reason", "detail"),
    [
        (BundleLoad(A, topics=1001), SplitReason.TOPICS, "topics 1001 > 1000"),
        (
            BundleLoad(A, topics=2, producer_count=600, consumer_count=401),
            SplitReason.SESSIONS,
            "sessions 1001 > 1000",
        ),
        (
            BundleLoad(A, topics=2, msg_rate_in=20000, msg_rate_out=10001),
            SplitReason.MSG_RATE,
            "msg rate 30001.0/s > 30000/s",
        ),
        (
            BundleLoad(A, topics=2, msg_throughput_in=60 * MB, msg_throughput_out=41 * MB),
            SplitReason.BANDWIDTH,
            "bandwidth 101.0 MB/s > 100 MB/s",
        ),
    ],
)
def test_each_limit(load: BundleLoad, reason: SplitReason, detail: str) -> None:
    assert hot_reason(load, CONFIG) == (reason, detail)


def test_limits_are_strict() -> None:
    at_limits = BundleLoad(
        A,
        topics=1000,
        producer_count=500,
        consumer_count=500,
        msg_rate_in=30000,
        msg_throughput_in=100 * MB,
    )
    assert hot_reason(at_limits, CONFIG) is None


def test_limits_are_checked_in_pulsar_order() -> None:
    everything = BundleLoad(
        A, topics=5000, producer_count=5000, msg_rate_in=1e6, msg_throughput_in=1e12
    )
    assert hot_reason(everything, CONFIG) == (SplitReason.TOPICS, "topics 5000 > 1000")
    no_topics = BundleLoad(A, topics=5, producer_count=5000, msg_rate_in=1e6)
    assert hot_reason(no_topics, CONFIG) == (SplitReason.SESSIONS, "sessions 5000 > 1000")


@pytest.mark.parametrize("off", [0, -1])
def test_a_sessions_limit_of_zero_or_less_is_off(off: int) -> None:
    config = SplitConfig(max_sessions=off)
    assert hot_reason(BundleLoad(A, topics=2, producer_count=10**6), config) is None
    busy = BundleLoad(A, topics=2, producer_count=10**6, msg_rate_in=1e6)
    assert hot_reason(busy, config) == (SplitReason.MSG_RATE, "msg rate 1000000.0/s > 30000/s")


# --- hit counts ------------------------------------------------------------------------------


def test_split_after_more_than_threshold_hot_cycles() -> None:
    assert run(3, snap(hot(A))).decisions == ()
    assert run(3, snap(hot(A))).state.hit_counts == {A: 3}
    assert run(3, snap(hot(A))).held_back == (
        (A, "over a limit 3 cycle(s) in a row, splits after more than 3"),
    )
    [decision] = run(4, snap(hot(A))).decisions
    assert decision == SplitDecision(
        A, SplitReason.TOPICS, SplitAlgorithm.RANGE_EQUALLY_DIVIDE, "topics 2000 > 1000", (1 << 29,)
    )
    assert decision.children == ("t/ns/0x00000000_0x20000000", "t/ns/0x20000000_0x40000000")
    assert str(decision) == (
        f"split {A} (Topics: topics 2000 > 1000) with range_equally_divide at 0x20000000"
    )


def test_threshold_zero_splits_on_the_first_hot_cycle() -> None:
    config = SplitConfig(hit_count_threshold=0)
    assert split_bundles(run(1, snap(hot(A)), config)) == [A]


def test_split_bundle_loses_its_count() -> None:
    assert run(4, snap(hot(A))).state.hit_counts == {}
    # Still hot afterwards (the caller has not split yet): counting starts over.
    assert run(5, snap(hot(A))).state.hit_counts == {A: 1}


def test_hit_count_threshold_is_configurable() -> None:
    config = SplitConfig(hit_count_threshold=1)
    assert run(1, snap(hot(A)), config).decisions == ()
    assert len(run(2, snap(hot(A)), config).decisions) == 1


def test_cool_cycle_resets_the_count() -> None:
    state = run(3, snap(hot(A), hot(B))).state
    assert state.hit_counts == {A: 3, B: 3}
    plan = find_bundles_to_split(snap(cool(A), hot(B)), CONFIG, state)
    assert split_bundles(plan) == [B]
    assert plan.state.hit_counts == {}
    # A starts over: three more hot cycles are not enough.
    assert run(3, snap(hot(A)), state=plan.state).decisions == ()
    assert len(run(4, snap(hot(A)), state=plan.state).decisions) == 1


def test_bundles_no_longer_reported_are_forgotten() -> None:
    state = run(2, snap(hot(A), hot(B))).state
    plan = find_bundles_to_split(snap(hot(B)), CONFIG, state)
    assert plan.state.hit_counts == {B: 3}


def test_bundles_skipped_before_the_limits_keep_their_count() -> None:
    # Fewer than 2 topics, or not owned (a transfer under way): not looked at, as in Pulsar.
    state = SplitState({A: 2, B: 2})
    one_topic = BundleLoad(A, topics=1, msg_rate_in=1e6)
    plan = find_bundles_to_split(snap(one_topic, hot(B), owned=[A]), CONFIG, state)
    assert plan.state.hit_counts == {A: 2, B: 2}
    assert plan.held_back == (
        (A, "1 topic(s), at least 2 needed"),
        (B, "not owned by this broker"),
    )


def test_input_state_is_not_mutated() -> None:
    state = SplitState({A: 3})
    find_bundles_to_split(snap(hot(A)), CONFIG, state)
    assert state.hit_counts == {A: 3}


# --- the cycle cap and the namespace's max bundles --------------------------------------------


def test_the_cycle_takes_bundles_in_report_order_and_stops_at_the_cap() -> None:
    config = SplitConfig(max_splits_per_cycle=1)
    state = SplitState({A: 3, B: 7, C: 3})
    plan = find_bundles_to_split(snap(hot(A), hot(B), cool(C)), config, state)
    assert split_bundles(plan) == [A]
    assert plan.held_back == ((B, "not looked at: the cycle cap of 1 splits"),)
    # B and C were not looked at: their counts are as they were, even C's, which cooled down.
    assert plan.state.hit_counts == {B: 7, C: 3}
    plan = find_bundles_to_split(snap(hot(B), hot(C)), config, plan.state)
    assert split_bundles(plan) == [B]


def test_the_cap_counts_splits_only() -> None:
    config = SplitConfig(max_splits_per_cycle=2)
    state = SplitState({A: 3, B: 3, C: 3})
    plan = find_bundles_to_split(snap(hot(A), hot(B), hot(C)), config, state)
    assert split_bundles(plan) == [A, B]
    assert plan.state.hit_counts == {C: 3}


def test_max_bundles_per_namespace_counts_this_cycles_splits() -> None:
    config = SplitConfig(max_bundles_per_namespace=5)
    state = SplitState({A: 3, B: 3})
    plan = find_bundles_to_split(snap(hot(A), hot(B)), config, state)
    assert split_bundles(plan) == [A]
    assert plan.held_back == ((B, "namespace t/ns at its max of 5 bundles"),)
    # Held back by the namespace's max: its count is kept, as in Pulsar.
    assert plan.state.hit_counts == {B: 4}


def test_namespace_policy_max_bundles_overrides_the_default() -> None:
    state = SplitState({A: 3, OTHER: 3})
    plan = find_bundles_to_split(snap(hot(A), hot(OTHER), max_bundles={NS: 4}), CONFIG, state)
    assert split_bundles(plan) == [OTHER]
    assert plan.held_back == ((A, "namespace t/ns at its max of 4 bundles"),)


# --- failures (Pulsar's Failure/Unknown) ------------------------------------------------------


def test_unknown_namespace_bundle_count_is_a_failure() -> None:
    plan = find_bundles_to_split(snap(hot(A), counts={}), CONFIG, SplitState({A: 3}))
    assert plan.decisions == () and plan.held_back == ()
    assert plan.failures == ((A, "bundle count of namespace t/ns unknown"),)
    assert plan.state.hit_counts == {A: 4}


def test_a_range_too_small_is_a_failure_even_when_cool() -> None:
    tiny = BundleId("t/ns/0x00000010_0x00000011")
    plan = run(10, snap(hot(tiny), cool(A)))
    assert plan.decisions == ()
    assert plan.failures == ((tiny, "range too small to split"),)
    assert plan.state.hit_counts == {}


def test_no_split_point_is_a_failure_that_takes_no_place_under_the_cap() -> None:
    # topic_count_equally_divide without the topics of A: no point for A; B splits instead.
    config = SplitConfig(algorithm="topic_count_equally_divide", max_splits_per_cycle=1)
    names = [f"persistent://t/ns/x{i}" for i in range(200)]
    in_b = [TopicLoad(n) for n in names if topic_hash(n) in parse_bundle_id(B).range][:4]
    state = SplitState({A: 3, B: 3})
    plan = find_bundles_to_split(snap(hot(A), hot(B), topics={B: in_b}), config, state)
    assert split_bundles(plan) == [B]
    [(bundle, why)] = plan.failures
    assert bundle == A and why.startswith("no split point: topic_count_equally_divide needs")
    assert plan.state.hit_counts == {A: 4}
    [decision] = plan.decisions
    hashes = sorted(topic_hash(t.topic) for t in in_b)
    assert decision.points == (hashes[1] + (hashes[2] - hashes[1]) // 2,)


# --- bundles Splitting in the channel -------------------------------------------------------

PARENT = BundleId("t/ns/0x00000000_0x80000000")


@pytest.mark.parametrize("child", [A, B])
def test_a_child_of_a_splitting_parent_is_held_back(child: BundleId) -> None:
    plan = run(4, snap(hot(child), splitting=[PARENT]))
    assert plan.decisions == () and plan.failures == ()
    assert plan.held_back == ((child, f"overlaps {PARENT}, which is Splitting"),)
    assert plan.state.hit_counts == {child: 4}


def test_a_neighbour_of_a_splitting_bundle_still_splits() -> None:
    # B starts where A ends: they share a boundary but no hash, and Pulsar does not hold B back.
    assert split_bundles(run(4, snap(hot(B), splitting=[A]))) == [B]


def test_bundles_split_in_the_same_cycle_do_not_hold_each_other_back() -> None:
    assert split_bundles(run(4, snap(hot(A), hot(B)))) == [A, B]


def test_kept_difference_the_middle_child_of_a_three_way_split_is_held_back() -> None:
    # PARENT was split at 0x20000000 and 0x60000000; the middle child shares neither end with
    # it, so Pulsar's check (same lower or same upper bound) would let it split.
    middle = BundleId("t/ns/0x20000000_0x60000000")
    plan = run(4, snap(hot(middle), splitting=[PARENT]))
    assert plan.decisions == ()
    assert plan.held_back == ((middle, f"overlaps {PARENT}, which is Splitting"),)


def test_kept_difference_another_namespace_never_holds_back() -> None:
    # Pulsar compares the Splitting bundle's id with a prefix: t/ns-b/... starts with t/ns.
    other = BundleId("t/ns-b/0x00000000_0x80000000")
    assert split_bundles(run(4, snap(hot(A), splitting=[other]))) == [A]


# --- the algorithm ---------------------------------------------------------------------------


def test_configured_algorithm_is_used() -> None:
    config = SplitConfig(algorithm="topic_count_equally_divide")
    names = [f"persistent://t/ns/y{i}" for i in range(200)]
    in_a = [TopicLoad(n) for n in names if topic_hash(n) in parse_bundle_id(A).range][:3]
    [decision] = run(4, snap(hot(A), topics={A: in_a}), config).decisions
    assert decision.algorithm is SplitAlgorithm.TOPIC_COUNT_EQUALLY_DIVIDE


def test_kept_difference_flow_or_qps_splits_at_every_point() -> None:
    # Four topics at 0.6 of the rate limit each: three points. Pulsar takes a single point only,
    # so it would count a failure every cycle and never split this bundle.
    config = SplitConfig(algorithm="flow_or_qps_equally_divide", max_msg_rate=1000)
    names = [f"persistent://t/ns/z{i}" for i in range(400)]
    in_a = [n for n in names if topic_hash(n) in parse_bundle_id(A).range][:4]
    busy = BundleLoad(A, topics=4, msg_rate_in=2400)
    topics = {A: [TopicLoad(n, msg_rate=600) for n in in_a]}
    [decision] = run(4, snap(busy, topics=topics), config).decisions
    assert len(decision.points) == 3 and len(decision.children) == 4
    # Its three new bundles count against the namespace's max.
    capped = replace(config, max_bundles_per_namespace=6)
    plan = run(4, snap(busy, topics=topics), capped)
    assert plan.decisions == ()
    assert plan.held_back == (
        (A, "4 children would take namespace t/ns over its max of 6 bundles"),
    )


def test_unknown_algorithm_is_an_error() -> None:
    with pytest.raises(InvalidInputError, match="unknown split algorithm 'nope'"):
        run(1, snap(hot(A)), SplitConfig(algorithm="nope"))


def test_kept_difference_specified_positions_cannot_be_automatic() -> None:
    # Pulsar accepts it, then counts a failure for every bundle it would split: no positions.
    with pytest.raises(InvalidInputError, match="cannot be the algorithm of automatic splits"):
        run(1, snap(hot(A)), SplitConfig(algorithm="specified_positions_divide"))


# --- input errors and settings ---------------------------------------------------------------


def test_duplicate_bundle_reports_are_an_error() -> None:
    with pytest.raises(InvalidInputError, match="reported twice"):
        run(1, snap(hot(A), cool(A)))


def test_bad_bundle_id_is_an_error() -> None:
    with pytest.raises(InvalidInputError, match="invalid bundle id"):
        run(1, snap(hot(BundleId("t/ns/zz"))))


def test_settings_accept_a_threshold_of_zero_and_no_sessions_limit() -> None:
    overrides = {"split.hit_count_threshold": 0, "split.max_sessions": -1}
    core = load_settings(None, env={}, overrides=overrides).split.to_core()
    assert (core.hit_count_threshold, core.max_sessions) == (0, -1)
    with pytest.raises(InvalidInputError, match="hit_count_threshold must be >= 0, got -1"):
        SplitConfig(hit_count_threshold=-1)
