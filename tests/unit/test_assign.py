"""Assignment: the least-usage strategy's best-set rule, each filter, and their composition."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbd.core.assign import (
    BrokerCandidate,
    Placement,
    PlacementRules,
    anti_affinity_counts,
    anti_affinity_filter,
    isolation_filter,
    least_resource_usage_with_weight,
    least_usage_pool,
    max_topics_filter,
    select_broker,
    version_filter,
)
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData
from lbd.core.names import NamespaceName
from lbd.core.namespace import IsolationPolicy, NamespacePolicies
from lbd.core.settings import AssignmentConfig

B1, B2, B3, B4 = (BrokerId(f"broker-{i}:8080") for i in range(1, 5))
BUNDLE = BundleId("t/ns/0x00000000_0x40000000")
CONFIG = AssignmentConfig()


def loads(**emas: float) -> dict[BrokerId, BrokerLoadData]:
    """Load data keyed by broker, from ``b1=0.2``-style arguments."""
    return {
        BrokerId(f"broker-{name[1:]}:8080"): BrokerLoadData(
            BrokerId(f"broker-{name[1:]}:8080"), weighted_max_ema=ema
        )
        for name, ema in emas.items()
    }


def picks(candidates: list[BrokerId], data: dict[BrokerId, BrokerLoadData]) -> set[BrokerId]:
    """Every broker the strategy picks over many seeded draws."""
    rng = random.Random(42)
    return {
        b
        for _ in range(200)
        if (b := least_resource_usage_with_weight(candidates, data, CONFIG, rng)) is not None
    }


# --- least_resource_usage_with_weight --------------------------------------------------------


def test_best_brokers_are_those_margin_below_the_average() -> None:
    # avg = 0.5; best: ema + 0.10 <= 0.5 -> b1 (0.2) and b2 (0.4); not b3 (0.9).
    assert picks([B1, B2, B3], loads(b1=0.2, b2=0.4, b3=0.9)) == {B1, B2}


def test_margin_boundary_is_inclusive() -> None:
    # Binary-exact values: avg = 0.375 and 0.25 + 0.125 == 0.375 exactly.
    pool, _ = least_usage_pool([B1, B2], loads(b1=0.25, b2=0.5), margin=0.125)
    assert pool == [B1]
    pool, _ = least_usage_pool([B1, B2], loads(b1=0.25, b2=0.5), margin=0.25)
    assert pool == [B1, B2]


def test_none_best_means_random_among_all_candidates() -> None:
    pool, why = least_usage_pool([B1, B2], loads(b1=0.5, b2=0.55), margin=0.10)
    assert pool == [B1, B2]
    assert "none with load <= avg" in why
    assert picks([B1, B2], loads(b1=0.5, b2=0.55)) == {B1, B2}


def test_average_is_over_candidates_with_load_data_only() -> None:
    # b3 has no data: avg over b1, b2 = 0.5 and b1 is best. Were b3 counted as 0, the avg
    # would be 0.33, nobody best, and all three drawn.
    assert picks([B1, B2, B3], loads(b1=0.3, b2=0.7)) == {B1}


def test_brokers_without_load_data_join_only_the_fallback() -> None:
    # Equal loads: none best, so b3 (no data) is drawn too.
    assert picks([B1, B2, B3], loads(b1=0.5, b2=0.5)) == {B1, B2, B3}


def test_average_ignores_brokers_that_are_not_candidates() -> None:
    # b4 is not a candidate; with it the avg would be 0.6 and b2 best too.
    assert picks([B1, B2], loads(b1=0.2, b2=0.4, b4=1.2)) == {B1}


def test_no_load_data_at_all_is_random_among_candidates() -> None:
    pool, why = least_usage_pool([B2, B1], {}, margin=0.1)
    assert pool == [B1, B2]
    assert "no load data" in why


def test_no_candidates_is_none() -> None:
    assert least_resource_usage_with_weight([], loads(b1=0.1), CONFIG, random.Random(1)) is None


def test_choice_is_deterministic_for_a_seed_whatever_the_candidate_order() -> None:
    data = loads(b1=0.1, b2=0.1, b3=0.1, b4=0.9)
    a = least_resource_usage_with_weight([B1, B2, B3, B4], data, CONFIG, random.Random(7))
    b = least_resource_usage_with_weight([B4, B3, B2, B1], data, CONFIG, random.Random(7))
    assert a == b and a in {B1, B2, B3}


# --- filters ---------------------------------------------------------------------------------


def test_max_topics_filter() -> None:
    cands = [BrokerCandidate(B1, topics=49_999), BrokerCandidate(B2, topics=50_000)]
    result = max_topics_filter(cands, 50_000)
    assert [c.broker for c in result.kept] == [B1]
    [ex] = result.excluded
    assert (ex.broker, ex.filter) == (B2, "max_topics")
    assert "serves 50000 topics, limit 50000" in ex.why


def test_version_filter() -> None:
    cands = [
        BrokerCandidate(B1, version="3.1"),
        BrokerCandidate(B2, version="3.0"),
        BrokerCandidate(B3),
    ]
    assert version_filter(cands, None).kept == tuple(cands)
    result = version_filter(cands, "3.1")
    assert [c.broker for c in result.kept] == [B1]
    why = {e.broker: e.why for e in result.excluded}
    assert why == {B2: "runs '3.0', '3.1' required", B3: "reports no version, '3.1' required"}


def test_isolation_primaries_only_when_enough() -> None:
    policy = IsolationPolicy(primary=("broker-1",), secondary=("broker-2",))
    cands = [BrokerCandidate(b) for b in (B1, B2, B3)]
    result = isolation_filter(cands, policy)
    assert [c.broker for c in result.kept] == [B1]
    why = {e.broker: e.why for e in result.excluded}
    assert "secondary, not needed: 1 primaries available, minimum 1" in why[B2]
    assert why[B3] == "neither primary nor secondary in the isolation policy"


def test_isolation_fails_over_to_secondaries() -> None:
    policy = IsolationPolicy(
        primary=(r"broker-[12]",), secondary=("broker-3",), min_available_primaries=2
    )
    # Only one primary available: secondaries join.
    result = isolation_filter(
        [BrokerCandidate(B1), BrokerCandidate(B3), BrokerCandidate(B4)], policy
    )
    assert [c.broker for c in result.kept] == [B1, B3]
    # Both primaries available: secondaries stay out.
    result = isolation_filter([BrokerCandidate(b) for b in (B1, B2, B3)], policy)
    assert [c.broker for c in result.kept] == [B1, B2]


def test_isolation_patterns_match_the_whole_id_or_host() -> None:
    policy = IsolationPolicy(primary=("broker-1:8080",))
    assert policy.is_primary(B1)
    assert not policy.is_primary(BrokerId("broker-10:8080"))
    assert IsolationPolicy(primary=("broker-1",)).is_primary(B1)
    assert not IsolationPolicy(primary=("broker",)).is_primary(B1)


def test_isolated_primaries_are_reserved_for_their_namespaces() -> None:
    other = IsolationPolicy(primary=("broker-1",))
    result = isolation_filter([BrokerCandidate(B1), BrokerCandidate(B2)], None, [other])
    assert [c.broker for c in result.kept] == [B2]
    assert result.excluded[0].why == "reserved as primary of an isolated namespace"
    assert isolation_filter([BrokerCandidate(B1)], None).kept == (BrokerCandidate(B1),)


def test_anti_affinity_counts_namespaces_of_the_group_per_broker() -> None:
    ownership = {
        BundleId("t/a/0x00000000_0x80000000"): B1,
        BundleId("t/a/0x80000000_0xffffffff"): B1,
        BundleId("t/b/0x00000000_0xffffffff"): B1,
        BundleId("t/c/0x00000000_0xffffffff"): B2,
        BundleId("t/d/0x00000000_0xffffffff"): B3,
    }
    groups = {
        NamespaceName("t", "a"): "G",
        NamespaceName("t", "b"): "g",
        NamespaceName("t", "d"): "other",
    }
    # a and b count once each on b1 (groups compare case-insensitively); c has no group.
    assert anti_affinity_counts("G", ownership, groups) == {B1: 2}


def test_anti_affinity_prefers_brokers_owning_none() -> None:
    cands = [BrokerCandidate(b) for b in (B1, B2, B3)]
    result = anti_affinity_filter(cands, "g", {B1: 2, B2: 1})
    assert [c.broker for c in result.kept] == [B3]
    assert {e.broker for e in result.excluded} == {B1, B2}


def test_anti_affinity_keeps_the_least_when_all_own_some() -> None:
    cands = [BrokerCandidate(b) for b in (B1, B2, B3)]
    result = anti_affinity_filter(cands, "g", {B1: 2, B2: 1, B3: 1})
    assert [c.broker for c in result.kept] == [B2, B3]
    assert "owns 2 namespace(s) of group 'g', another candidate owns 1" in result.excluded[0].why


def test_anti_affinity_without_group_keeps_all() -> None:
    cands = [BrokerCandidate(B1)]
    assert anti_affinity_filter(cands, None, {B1: 5}).kept == tuple(cands)


# --- select_broker ---------------------------------------------------------------------------


def test_select_broker_composes_filters_and_strategy() -> None:
    cands = [
        BrokerCandidate(B1, version="3.1", topics=10),
        BrokerCandidate(B2, version="3.1", topics=60_000),
        BrokerCandidate(B3, version="3.0", topics=10),
        BrokerCandidate(B4, version="3.1", topics=10),
    ]
    config = AssignmentConfig(required_broker_version="3.1")
    sel = select_broker(BUNDLE, cands, loads(b1=0.1, b4=0.9), config, random.Random(3))
    # b2, b3 filtered; among b1, b4: avg 0.5, b1 best.
    assert sel.broker == B1
    assert {(e.broker, e.filter) for e in sel.excluded} == {(B2, "max_topics"), (B3, "version")}
    assert sel.reason.startswith(f"{B1} for {BUNDLE}: random among 1 of 2")
    assert "excluded" in sel.reason and B2 in sel.reason


def test_select_broker_with_no_candidate_left() -> None:
    cands = [BrokerCandidate(B1, topics=60_000)]
    sel = select_broker(BUNDLE, cands, {}, CONFIG, random.Random(1))
    assert sel.broker is None
    assert sel.reason.startswith(f"no broker for {BUNDLE}: 1 candidate(s)")
    assert "max_topics: serves 60000 topics" in sel.reason


def test_select_broker_with_no_candidates_at_all() -> None:
    sel = select_broker(BUNDLE, [], {}, CONFIG, random.Random(1))
    assert sel.broker is None
    assert sel.reason == f"no broker for {BUNDLE}: 0 candidate(s)"


def test_select_broker_applies_isolation_and_anti_affinity() -> None:
    policies = NamespacePolicies(
        isolation=IsolationPolicy(primary=(r"broker-[123]",)), anti_affinity_group="g"
    )
    placement = Placement(
        policies=policies,
        ownership={
            BundleId("t/other/0x00000000_0xffffffff"): B1,
            BundleId("t/ns/0x40000000_0xffffffff"): B2,
        },
        anti_affinity_groups={NamespaceName("t", "other"): "g"},
    )
    cands = [BrokerCandidate(b) for b in (B1, B2, B3, B4)]
    sel = select_broker(BUNDLE, cands, {}, CONFIG, random.Random(5), placement)
    # b4 not in the isolation policy; b1 owns another namespace of the group; b2 owns this
    # namespace's other bundle, which counts too.
    assert sel.broker == B3
    assert {(e.broker, e.filter) for e in sel.excluded} == {
        (B4, "isolation"),
        (B1, "anti_affinity"),
        (B2, "anti_affinity"),
    }


def test_select_broker_rejects_duplicate_candidates() -> None:
    with pytest.raises(InvalidInputError, match="listed twice"):
        select_broker(
            BUNDLE, [BrokerCandidate(B1), BrokerCandidate(B1)], {}, CONFIG, random.Random(1)
        )


def test_select_broker_rejects_a_bad_bundle_id() -> None:
    with pytest.raises(InvalidInputError, match="invalid bundle id"):
        select_broker(BundleId("nope"), [BrokerCandidate(B1)], {}, CONFIG, random.Random(1))


# -- the rules over a whole cluster, for a shedding cycle's moves ------------------------------

NAMESPACES = [NamespaceName("t", f"ns-{i}") for i in range(4)]
BROKERS = [B1, B2, B3, B4]


def bundles_of(namespace: NamespaceName, count: int) -> list[BundleId]:
    step = 0x100000000 // count
    return [
        BundleId(f"{namespace}/0x{i * step:08x}_0x{min((i + 1) * step, 0xFFFFFFFF):08x}")
        for i in range(count)
    ]


@st.composite
def clusters(
    draw: st.DrawFn,
) -> tuple[PlacementRules, dict[BundleId, BrokerId], list[tuple[BundleId, BrokerId, BrokerId]]]:
    """Rules (an anti-affinity group, maybe an isolation policy), an ownership, a cycle's moves."""
    policies: dict[NamespaceName, NamespacePolicies] = {}
    for namespace in NAMESPACES:
        kind = draw(st.sampled_from(("none", "group", "isolated")))
        if kind == "group":
            policies[namespace] = NamespacePolicies(anti_affinity_group="g")
        elif kind == "isolated":
            primaries = draw(st.lists(st.sampled_from(BROKERS), min_size=1, max_size=2))
            policies[namespace] = NamespacePolicies(
                isolation=IsolationPolicy(
                    primary=tuple(b.replace(".", r"\.") for b in primaries),
                    secondary=draw(st.sampled_from(((), (".*",)))),
                )
            )
    bundles = [b for ns in NAMESPACES for b in bundles_of(ns, draw(st.integers(1, 4)))]
    owners = {b: draw(st.sampled_from(BROKERS)) for b in bundles}
    moves = []
    now = dict(owners)
    for bundle in draw(st.lists(st.sampled_from(bundles), max_size=4, unique=True)):
        dst = draw(st.sampled_from(BROKERS))
        moves.append((bundle, now[bundle], dst))
        now[bundle] = dst
    return PlacementRules(policies), owners, moves


@given(clusters())
@settings(max_examples=150, deadline=None)
def test_the_rules_for_a_cycle_allow_what_the_filters_allow_on_the_ownership_then(
    cluster: tuple[
        PlacementRules, dict[BundleId, BrokerId], list[tuple[BundleId, BrokerId, BrokerId]]
    ],
) -> None:
    """MoveRules counts once for many bundles and adds the cycle's earlier moves by deltas;
    it must agree with the filters run afresh on the ownership those moves leave."""
    rules, owners, moves = cluster
    candidates = [BrokerCandidate(b) for b in BROKERS]
    at = rules.at(candidates, CONFIG, owners)
    after = dict(owners)
    for bundle, _, dst in moves:
        after[bundle] = dst
    for bundle in owners:
        for broker in BROKERS:
            alone = rules.allows(bundle, broker, candidates, CONFIG, owners)
            assert at.allows(bundle, broker) == alone, (bundle, broker)
            planned = [m for m in moves if m[0] != bundle]
            # Longest first: a shorter list is no continuation of the moves counted before.
            for chosen in range(len(planned), -1, -1):
                then = dict(owners)
                for moved, _, dst in planned[:chosen]:
                    then[moved] = dst
                expected = rules.allows(bundle, broker, candidates, CONFIG, then)
                assert at.allows(bundle, broker, planned[:chosen]) == expected, (
                    bundle,
                    broker,
                    planned[:chosen],
                )


def test_two_bundles_of_a_group_may_not_both_go_to_the_one_broker_without_any() -> None:
    first, second = NAMESPACES[0], NAMESPACES[1]
    rules = PlacementRules(
        {ns: NamespacePolicies(anti_affinity_group="g") for ns in (first, second)}
    )
    [a] = bundles_of(first, 1)
    [b] = bundles_of(second, 1)
    owners = {a: B1, b: B2, **dict.fromkeys(bundles_of(NAMESPACES[2], 2), B3)}
    at = rules.at([BrokerCandidate(x) for x in (B1, B2, B3)], CONFIG, owners)
    # Each alone may go to B3, which owns none of the group...
    assert at.allows(a, B3) and at.allows(b, B3)
    # ...but once one goes there, the other may not: B1 (left empty) owns fewer.
    assert not at.allows(b, B3, [(a, B1, B3)])
    assert at.allowed(b, [(a, B1, B3)]) == {B1, B2}
    # Without the cycle's moves, each may stay or go to B3 (its own broker counts it alone).
    assert at.destinations([a, b]) == {a: frozenset({B1, B3}), b: frozenset({B2, B3})}
