"""The split decision: thresholds, hit counts, caps and bundles that cannot split."""

import pytest

from lbd.core.bundles import SplitAlgorithm
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BundleId
from lbd.core.load import BundleLoad
from lbd.core.names import NamespaceName
from lbd.core.split import (
    SplitPlan,
    SplitReason,
    SplitState,
    find_bundles_to_split,
    hot_reason,
)
from lbd.core.tuning import MB, SplitConfig

NS = NamespaceName("t", "ns")
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


def run(
    cycles: int,
    loads: list[BundleLoad],
    config: SplitConfig = CONFIG,
    counts: dict[NamespaceName, int] | None = None,
    state: SplitState | None = None,
) -> SplitPlan:
    """The plan of the last of ``cycles`` cycles over the same loads."""
    state = state or SplitState()
    counts = counts if counts is not None else {NS: 4, NamespaceName("t", "other"): 1}
    plan = SplitPlan((), (), state)
    for _ in range(cycles):
        plan = find_bundles_to_split(loads, counts, config, plan.state)
    return plan


# --- thresholds ------------------------------------------------------------------------------


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
def test_each_threshold(load: BundleLoad, reason: SplitReason, detail: str) -> None:
    assert hot_reason(load, CONFIG) == (reason, detail)


def test_thresholds_are_strict() -> None:
    at_limits = BundleLoad(
        A,
        topics=1000,
        producer_count=500,
        consumer_count=500,
        msg_rate_in=30000,
        msg_throughput_in=100 * MB,
    )
    assert hot_reason(at_limits, CONFIG) is None


def test_thresholds_are_checked_in_pulsar_order() -> None:
    everything = BundleLoad(
        A, topics=5000, producer_count=5000, msg_rate_in=1e6, msg_throughput_in=1e12
    )
    assert hot_reason(everything, CONFIG) == (SplitReason.TOPICS, "topics 5000 > 1000")
    no_topics = BundleLoad(A, topics=5, producer_count=5000, msg_rate_in=1e6)
    assert hot_reason(no_topics, CONFIG) == (SplitReason.SESSIONS, "sessions 5000 > 1000")


# --- hit counts ------------------------------------------------------------------------------


def test_split_after_more_than_threshold_hot_cycles() -> None:
    assert run(3, [hot(A)]).decisions == ()
    assert run(3, [hot(A)]).state.hit_counts == {A: 3}
    [decision] = run(4, [hot(A)]).decisions
    assert decision.bundle == A
    assert decision.reason is SplitReason.TOPICS
    assert decision.algorithm is SplitAlgorithm.RANGE_EQUALLY_DIVIDE
    assert decision.detail == "topics 2000 > 1000"
    assert str(decision) == f"split {A} (Topics: topics 2000 > 1000) with range_equally_divide"


def test_split_bundle_loses_its_count() -> None:
    assert run(4, [hot(A)]).state.hit_counts == {}
    # Still hot afterwards (the caller has not split yet): counting starts over.
    assert run(5, [hot(A)]).state.hit_counts == {A: 1}


def test_hit_count_threshold_is_configurable() -> None:
    config = SplitConfig(hit_count_threshold=1)
    assert run(1, [hot(A)], config).decisions == ()
    assert len(run(2, [hot(A)], config).decisions) == 1


def test_cool_cycle_resets_the_count() -> None:
    state = run(3, [hot(A), hot(B)]).state
    assert state.hit_counts == {A: 3, B: 3}
    plan = find_bundles_to_split([cool(A), hot(B)], {NS: 4}, CONFIG, state)
    assert [d.bundle for d in plan.decisions] == [B]
    assert plan.state.hit_counts == {}
    # A starts over: three more hot cycles are not enough.
    assert run(3, [hot(A)], state=plan.state).decisions == ()
    assert len(run(4, [hot(A)], state=plan.state).decisions) == 1


def test_bundles_no_longer_reported_are_forgotten() -> None:
    state = run(2, [hot(A), hot(B)]).state
    plan = find_bundles_to_split([hot(B)], {NS: 4}, CONFIG, state)
    assert plan.state.hit_counts == {B: 3}


def test_input_state_is_not_mutated() -> None:
    state = SplitState({A: 3})
    find_bundles_to_split([hot(A)], {NS: 4}, CONFIG, state)
    assert state.hit_counts == {A: 3}


# --- caps and unsplittable bundles -----------------------------------------------------------


def test_max_splits_per_cycle_prefers_the_longest_waiting() -> None:
    config = SplitConfig(max_splits_per_cycle=1)
    state = SplitState({A: 3, B: 7, C: 3})
    plan = find_bundles_to_split([hot(A), hot(B), hot(C)], {NS: 4}, config, state)
    assert [d.bundle for d in plan.decisions] == [B]
    assert plan.held_back == (
        (A, "cycle cap of 1 splits reached"),
        (C, "cycle cap of 1 splits reached"),
    )
    # The held-back ones keep counting and go next.
    plan = find_bundles_to_split([hot(A), hot(C)], {NS: 5}, config, plan.state)
    assert [d.bundle for d in plan.decisions] == [A]


def test_max_bundles_per_namespace_counts_this_cycles_splits() -> None:
    config = SplitConfig(max_bundles_per_namespace=5)
    state = SplitState({A: 3, B: 3})
    plan = find_bundles_to_split([hot(A), hot(B)], {NS: 4}, config, state)
    assert [d.bundle for d in plan.decisions] == [A]
    assert plan.held_back == ((B, "namespace t/ns at its max of 5 bundles"),)
    # Held back by the namespace cap: its count is kept, as in Pulsar.
    assert plan.state.hit_counts == {B: 4}


def test_namespace_policy_max_bundles_overrides_the_default() -> None:
    state = SplitState({A: 3, OTHER: 3})
    plan = find_bundles_to_split(
        [hot(A), hot(OTHER)],
        {NS: 4, NamespaceName("t", "other"): 1},
        CONFIG,
        state,
        max_bundles={NS: 4},
    )
    assert [d.bundle for d in plan.decisions] == [OTHER]
    assert plan.held_back == ((A, "namespace t/ns at its max of 4 bundles"),)


def test_unknown_namespace_bundle_count_holds_back() -> None:
    plan = find_bundles_to_split([hot(A)], {}, CONFIG, SplitState({A: 3}))
    assert plan.decisions == ()
    assert plan.held_back == ((A, "bundle count of namespace t/ns unknown"),)


def test_bundle_with_fewer_than_two_topics_never_splits() -> None:
    load = BundleLoad(A, topics=1, msg_rate_in=1e6)
    plan = run(10, [load])
    assert plan.decisions == ()
    assert plan.state.hit_counts == {}
    assert plan.held_back == ((A, "over a limit but cannot split: 1 topic(s), at least 2 needed"),)


def test_bundle_too_small_to_split_never_splits() -> None:
    tiny = BundleId("t/ns/0x00000010_0x00000011")
    plan = run(10, [hot(tiny)])
    assert plan.decisions == ()
    assert plan.held_back == ((tiny, "over a limit but cannot split: range too small to split"),)


# --- algorithm and input errors --------------------------------------------------------------


def test_configured_algorithm_is_used() -> None:
    config = SplitConfig(algorithm="topic_count_equally_divide")
    [decision] = run(4, [hot(A)], config).decisions
    assert decision.algorithm is SplitAlgorithm.TOPIC_COUNT_EQUALLY_DIVIDE


def test_unknown_algorithm_is_an_error() -> None:
    with pytest.raises(InvalidInputError, match="unknown split algorithm 'nope'"):
        run(1, [hot(A)], SplitConfig(algorithm="nope"))


def test_specified_positions_cannot_be_automatic() -> None:
    with pytest.raises(InvalidInputError, match="cannot be the algorithm of automatic splits"):
        run(1, [hot(A)], SplitConfig(algorithm="specified_positions_divide"))


def test_duplicate_bundle_reports_are_an_error() -> None:
    with pytest.raises(InvalidInputError, match="reported twice"):
        run(1, [hot(A), cool(A)])


def test_bad_bundle_id_is_an_error() -> None:
    with pytest.raises(InvalidInputError, match="invalid bundle id"):
        run(1, [hot(BundleId("t/ns/zz"))])
