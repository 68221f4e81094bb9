"""Bundle math: hashing, ranges, ids, layouts, lookups, splits and the four split algorithms."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbd.core.bundles import (
    FULL_UPPER,
    MAX_BUNDLES,
    Bundle,
    BundleRange,
    NamespaceBundles,
    SplitAlgorithm,
    TopicLoad,
    bundle_id,
    default_boundaries,
    parse_bundle_id,
    split_positions,
    topic_hash,
)
from lbd.core.errors import InvalidInputError, NotFoundError
from lbd.core.names import NamespaceName, TopicName
from lbd.core.settings import MB, SplitConfig

NS = NamespaceName("public", "default")


def reference_crc32(data: bytes) -> int:
    """Bit-by-bit CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), independent of zlib."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def forge_topic(target: int, prefix: str = "persistent://public/default/forged-") -> str:
    """A topic name whose CRC-32 is ``target``.

    For messages of one length CRC-32 is affine over GF(2), so choosing 'a' or 'b' at each of
    48 suffix positions reaches any value: solve for the choices by Gaussian elimination.
    """
    width = 48
    base = reference_crc32((prefix + "a" * width).encode())
    basis: list[tuple[int, int]] = []  # (crc change, positions flipped), distinct top bits
    for i in range(width):
        flipped = prefix + "a" * i + "b" + "a" * (width - i - 1)
        vec, mask = reference_crc32(flipped.encode()) ^ base, 1 << i
        for bvec, bmask in basis:
            if vec ^ bvec < vec:
                vec, mask = vec ^ bvec, mask ^ bmask
        if vec:
            basis.append((vec, mask))
            basis.sort(reverse=True)
    want, choice = base ^ target, 0
    for bvec, bmask in basis:
        if want ^ bvec < want:
            want, choice = want ^ bvec, choice ^ bmask
    assert want == 0
    return prefix + "".join("b" if choice >> i & 1 else "a" for i in range(width))


# --- hashing ---------------------------------------------------------------------------------


def test_hash_matches_the_published_crc32_check_value() -> None:
    assert topic_hash("123456789") == 0xCBF43926


@pytest.mark.parametrize(
    "topic",
    [
        "persistent://public/default/my-topic",
        "non-persistent://pulsar/system/loadbalancer-broker-load-data",
        "persistent://pulsar/system/loadbalancer-service-unit-state",
        "persistent://t/ns/ünïcode-topic",
        "persistent://t/ns/t-partition-12",
    ],
)
def test_hash_of_topic_names_is_unsigned_crc32_of_utf8(topic: str) -> None:
    expected = reference_crc32(topic.encode("utf-8"))
    assert topic_hash(topic) == expected
    assert topic_hash(TopicName.parse(topic)) == expected
    assert 0 <= expected <= FULL_UPPER


def test_hash_is_unsigned_for_values_with_the_top_bit_set() -> None:
    # A signed 32-bit CRC (Java's int) would be negative for these.
    names = (f"persistent://t/ns/x{i}" for i in range(100))
    topic = next(n for n in names if reference_crc32(n.encode()) >= 1 << 31)
    assert topic_hash(topic) == reference_crc32(topic.encode()) >= 1 << 31


# --- ranges and ids --------------------------------------------------------------------------


def test_range_is_half_open_except_the_last() -> None:
    r = BundleRange(0x10, 0x20)
    assert 0x10 in r and 0x1F in r
    assert 0x20 not in r and 0x0F not in r
    last = BundleRange(0xC0000000, FULL_UPPER)
    assert last.includes_upper and not r.includes_upper
    assert FULL_UPPER in last and 0xFFFFFFFE in last and 0xBFFFFFFF not in last


@pytest.mark.parametrize(
    ("lo", "hi", "message"),
    [
        (5, 5, "must be below its upper bound"),
        (6, 5, "must be below its upper bound"),
        (-1, 5, "outside the hash space"),
        (0, FULL_UPPER + 1, "outside the hash space"),
    ],
)
def test_bad_ranges(lo: int, hi: int, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        BundleRange(lo, hi)


def test_can_split_needs_more_than_one_step() -> None:
    assert not BundleRange(7, 8).can_split()
    assert BundleRange(7, 9).can_split()
    assert not BundleRange(0xFFFFFFFE, FULL_UPPER).can_split()


def test_bundle_id_format_and_round_trip() -> None:
    assert bundle_id(NS, 0, 0x40000000) == "public/default/0x00000000_0x40000000"
    assert bundle_id(NS, 0xC0000000, FULL_UPPER) == "public/default/0xc0000000_0xffffffff"
    parsed = parse_bundle_id("public/default/0xC0000000_0xFFFFFFFF")
    assert parsed == Bundle(NS, BundleRange(0xC0000000, FULL_UPPER))
    assert parsed.id == "public/default/0xc0000000_0xffffffff"
    assert str(parsed) == parsed.id


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0x00000000_0x40000000", "expected tenant/namespace/0xLLLLLLLL_0xHHHHHHHH"),
        ("default/0x00000000_0x40000000", "expected tenant/namespace, got 1 segment"),
        ("t/c/ns/0x00000000_0x40000000", "got 3 segment"),
        ("t/n s/0x00000000_0x40000000", "illegal characters"),
        ("t/ns/0x0_0x40000000", "is not 0xLLLLLLLL_0xHHHHHHHH"),
        ("t/ns/00000000_40000000", "is not 0xLLLLLLLL_0xHHHHHHHH"),
        ("t/ns/0x00000000-0x40000000", "is not 0xLLLLLLLL_0xHHHHHHHH"),
        ("t/ns/0x0000000g_0x40000000", "is not 0xLLLLLLLL_0xHHHHHHHH"),
        ("t/ns/", "is not 0xLLLLLLLL_0xHHHHHHHH"),
        ("t/ns/0x40000000_0x40000000", "must be below its upper bound"),
        ("t/ns/0x80000000_0x40000000", "must be below its upper bound"),
    ],
)
def test_malformed_bundle_ids(text: str, message: str) -> None:
    with pytest.raises(InvalidInputError) as err:
        parse_bundle_id(text)
    assert message in str(err.value)
    assert str(err.value).startswith("invalid bundle id")


# --- default layouts -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (1, (0x00000000, 0xFFFFFFFF)),
        (2, (0x00000000, 0x80000000, 0xFFFFFFFF)),
        (4, (0x00000000, 0x40000000, 0x80000000, 0xC0000000, 0xFFFFFFFF)),
        (3, (0x00000000, 0x55555555, 0xAAAAAAAA, 0xFFFFFFFF)),
    ],
)
def test_default_boundaries(n: int, expected: tuple[int, ...]) -> None:
    assert default_boundaries(n) == expected


def test_default_boundaries_sixteen() -> None:
    b = default_boundaries(16)
    assert len(b) == 17
    assert b[:-1] == tuple(i * 0x10000000 for i in range(16))
    assert b[-1] == FULL_UPPER


def test_default_layout_has_four_bundles() -> None:
    layout = NamespaceBundles.default(NS)
    assert len(layout) == 4
    assert [b.id for b in layout.bundles()] == [
        "public/default/0x00000000_0x40000000",
        "public/default/0x40000000_0x80000000",
        "public/default/0x80000000_0xc0000000",
        "public/default/0xc0000000_0xffffffff",
    ]


@pytest.mark.parametrize("n", [0, -1, MAX_BUNDLES + 1])
def test_default_boundaries_rejects_bad_counts(n: int) -> None:
    with pytest.raises(InvalidInputError, match="number of bundles must be between 1 and"):
        default_boundaries(n)


@pytest.mark.parametrize(
    ("boundaries", "message"),
    [
        ((0,), "need at least 2 boundaries"),
        ((0x10, FULL_UPPER), "must start at 0x00000000 and end at 0xffffffff"),
        ((0, 0xFFFFFFF0), "must start at 0x00000000 and end at 0xffffffff"),
        ((0, 0x80000000, 0x80000000, FULL_UPPER), "strictly increasing"),
        ((0, 0x80000000, 0x40000000, FULL_UPPER), "strictly increasing, got 0x40000000 after"),
    ],
)
def test_layout_validation(boundaries: tuple[int, ...], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        NamespaceBundles(NS, boundaries)


# --- find --------------------------------------------------------------------------------------


def test_find_at_every_boundary() -> None:
    layout = NamespaceBundles.default(NS)
    b = layout.boundaries
    for i in range(4):
        assert layout.find(b[i]).range == BundleRange(b[i], b[i + 1])
        assert layout.find(b[i + 1] - 1).range == BundleRange(b[i], b[i + 1])
    assert layout.find(FULL_UPPER).range == BundleRange(0xC0000000, FULL_UPPER)


def test_find_on_a_single_bundle_layout() -> None:
    layout = NamespaceBundles.default(NS, 1)
    for h in (0, 1, 0x80000000, FULL_UPPER):
        assert layout.find(h).range == BundleRange(0, FULL_UPPER)


def test_find_by_topic_uses_its_hash() -> None:
    layout = NamespaceBundles.default(NS, 16)
    topic = "persistent://public/default/my-topic"
    found = layout.find(topic)
    assert topic_hash(topic) in found.range
    assert found.namespace == NS
    assert layout.find(TopicName.parse(topic)) == found


def test_topic_hashed_at_the_top_of_the_space_is_in_the_last_bundle() -> None:
    layout = NamespaceBundles.default(NS)
    top, bottom = forge_topic(FULL_UPPER), forge_topic(0)
    assert topic_hash(top) == FULL_UPPER and topic_hash(bottom) == 0
    assert layout.find(top).range == BundleRange(0xC0000000, FULL_UPPER)
    assert layout.find(bottom).range == BundleRange(0, 0x40000000)


def test_find_rejects_other_namespaces_and_bad_hashes() -> None:
    layout = NamespaceBundles.default(NS)
    with pytest.raises(InvalidInputError, match="is not in namespace public/default"):
        layout.find("persistent://other/ns/x")
    with pytest.raises(InvalidInputError, match="missing '://'"):
        layout.find("x")
    with pytest.raises(InvalidInputError, match="outside the hash space"):
        layout.find(FULL_UPPER + 1)
    with pytest.raises(InvalidInputError, match="outside the hash space"):
        layout.find(-1)


# --- split of a layout -----------------------------------------------------------------------


def test_split_inserts_points_in_place() -> None:
    layout = NamespaceBundles.default(NS)
    after = layout.split(BundleRange(0x40000000, 0x80000000), [0x70000000, 0x50000000])
    assert after.boundaries == (
        0,
        0x40000000,
        0x50000000,
        0x70000000,
        0x80000000,
        0xC0000000,
        FULL_UPPER,
    )
    assert layout.boundaries == default_boundaries(4)


def test_split_of_the_last_bundle() -> None:
    layout = NamespaceBundles.default(NS, 2)
    after = layout.split(BundleRange(0x80000000, FULL_UPPER), [0xFFFFFFFE])
    assert after.boundaries == (0, 0x80000000, 0xFFFFFFFE, FULL_UPPER)
    assert after.find(FULL_UPPER).range == BundleRange(0xFFFFFFFE, FULL_UPPER)


def test_split_errors() -> None:
    layout = NamespaceBundles.default(NS)
    with pytest.raises(NotFoundError, match="not in the layout"):
        layout.split(BundleRange(0, 0x80000000), [0x10])
    with pytest.raises(NotFoundError, match="not in the layout"):
        layout.split(BundleRange(0x10, 0x40000000), [0x20])
    with pytest.raises(InvalidInputError, match="no split point given"):
        layout.split(BundleRange(0, 0x40000000), [])
    with pytest.raises(InvalidInputError, match="0x40000000 not strictly inside"):
        layout.split(BundleRange(0, 0x40000000), [0x40000000])
    with pytest.raises(InvalidInputError, match="0x00000000 not strictly inside"):
        layout.split(BundleRange(0, 0x40000000), [0])


@given(st.data())
def test_layouts_after_arbitrary_splits_still_partition_the_space(data: st.DataObject) -> None:
    layout = NamespaceBundles.default(NS, data.draw(st.integers(1, 16), label="n"))
    for _ in range(data.draw(st.integers(0, 8), label="splits")):
        splittable = [b.range for b in layout.bundles() if b.range.can_split()]
        target = data.draw(st.sampled_from(splittable), label="bundle")
        points = data.draw(
            st.lists(st.integers(target.lo + 1, target.hi - 1), min_size=1, max_size=3),
            label="points",
        )
        layout = layout.split(target, points)
    ranges = [b.range for b in layout.bundles()]
    assert ranges[0].lo == 0 and ranges[-1].hi == FULL_UPPER
    assert all(a.hi == b.lo for a, b in itertools.pairwise(ranges))
    drawn = data.draw(st.lists(st.integers(0, FULL_UPPER), max_size=20), label="hashes")
    for h in [*drawn, 0, FULL_UPPER, *layout.boundaries]:
        holders = [r for r in ranges if h in r]
        assert holders == [layout.find(h).range]


@given(st.integers(0, FULL_UPPER), st.integers(1, 64))
def test_every_hash_maps_to_exactly_one_default_bundle(h: int, n: int) -> None:
    layout = NamespaceBundles.default(NS, n)
    holders = [b for b in layout.bundles() if h in b.range]
    assert holders == [layout.find(h)]


# --- split algorithms ------------------------------------------------------------------------

FIRST = BundleRange(0, 0x40000000)


def topics_in(bundle: BundleRange, count: int, prefix: str = "t") -> list[str]:
    """``count`` topic names of public/default that hash into ``bundle``."""
    found: list[str] = []
    i = 0
    while len(found) < count:
        name = f"persistent://public/default/{prefix}{i}"
        if topic_hash(name) in bundle:
            found.append(name)
        i += 1
    return found


def test_algorithm_names() -> None:
    assert [a.value for a in SplitAlgorithm] == [
        "range_equally_divide",
        "topic_count_equally_divide",
        "specified_positions_divide",
        "flow_or_qps_equally_divide",
    ]
    assert (
        SplitAlgorithm.parse("topic_count_equally_divide")
        is SplitAlgorithm.TOPIC_COUNT_EQUALLY_DIVIDE
    )


def test_unknown_algorithm_lists_the_four() -> None:
    with pytest.raises(InvalidInputError) as err:
        split_positions("midpoint", FIRST)
    assert "unknown split algorithm 'midpoint'" in str(err.value)
    for a in SplitAlgorithm:
        assert a.value in str(err.value)


def test_range_equally_divide_is_the_midpoint() -> None:
    assert split_positions("range_equally_divide", FIRST) == [0x20000000]
    assert split_positions(
        SplitAlgorithm.RANGE_EQUALLY_DIVIDE, BundleRange(0xC0000000, FULL_UPPER)
    ) == [0xC0000000 + (FULL_UPPER - 0xC0000000) // 2]
    assert split_positions("range_equally_divide", BundleRange(10, 12)) == [11]


def test_pulsar_range_equally_divide_returns_the_correct_result() -> None:
    """RangeEquallyDivideBundleSplitAlgorithmTest.testGetSplitBoundaryMethodReturnCorrectResult:
    [10, 0xffffffff] splits at 10 + (0xffffffff - 10) / 2."""
    assert split_positions("range_equally_divide", BundleRange(10, FULL_UPPER)) == [0x80000004]


@pytest.mark.parametrize("algorithm", list(SplitAlgorithm))
def test_every_algorithm_refuses_a_too_small_range(algorithm: SplitAlgorithm) -> None:
    with pytest.raises(InvalidInputError, match="too small to split"):
        split_positions(algorithm, BundleRange(10, 11), positions=[10])


def test_topics_must_hash_into_the_bundle() -> None:
    outside = topics_in(BundleRange(0x40000000, 0x80000000), 1)[0]
    with pytest.raises(InvalidInputError, match="does not hash into bundle range"):
        split_positions("topic_count_equally_divide", FIRST, topics=[TopicLoad(outside)] * 2)


WHOLE = BundleRange(0, FULL_UPPER)


def test_pulsar_topic_count_equally_divide_returns_the_correct_result() -> None:
    """TopicCountEquallyDivideBundleSplitAlgorithmTest.testAlgorithmReturnCorrectResult: topics
    a, b and c (CRC-32 0xe8b7be43, 0x71beeff9, 0x06b9df6f) split halfway between the two lowest
    hashes, rounded down."""
    topics = [TopicLoad(name) for name in ("a", "b", "c")]
    expected = 0x06B9DF6F + (0x71BEEFF9 - 0x06B9DF6F) // 2
    assert expected == 0x3C3C67B4
    assert split_positions("topic_count_equally_divide", WHOLE, topics=topics) == [expected]


def test_pulsar_topic_count_equally_divide_needs_more_than_one_topic() -> None:
    """TopicCountEquallyDivideBundleSplitAlgorithmTest.testTopicsSizeLessThan1: one topic, no
    split."""
    with pytest.raises(InvalidInputError, match="needs at least 2 topics"):
        split_positions("topic_count_equally_divide", WHOLE, topics=[TopicLoad("a")])


@pytest.mark.parametrize("count", [2, 3, 4, 7, 10])
def test_topic_count_equally_divide_balances_topics(count: int) -> None:
    names = topics_in(FIRST, count)
    [point] = split_positions(
        "topic_count_equally_divide", FIRST, topics=[TopicLoad(n) for n in names]
    )
    assert FIRST.lo < point < FIRST.hi
    lower = sum(1 for n in names if topic_hash(n) < point)
    assert lower == count // 2
    assert count - lower == count - count // 2


def test_topic_count_equally_divide_rounds_down_as_pulsar() -> None:
    # Topics at h and h + 1: the point is h, so both end up in the upper half.
    h = 0x12345678
    topics = [TopicLoad(forge_topic(h)), TopicLoad(forge_topic(h + 1))]
    assert split_positions("topic_count_equally_divide", FIRST, topics=topics) == [h]
    # Three apart: the point is h + 1, between them.
    topics = [TopicLoad(forge_topic(h)), TopicLoad(forge_topic(h + 3))]
    assert split_positions("topic_count_equally_divide", FIRST, topics=topics) == [h + 1]


def test_topic_count_equally_divide_splits_at_a_shared_middle_hash() -> None:
    name = topics_in(FIRST, 1)[0]
    topics = [TopicLoad(name)] * 2
    assert split_positions("topic_count_equally_divide", FIRST, topics=topics) == [topic_hash(name)]


def test_topic_count_equally_divide_needs_a_point_inside() -> None:
    at_lower_bound = [TopicLoad(forge_topic(0, prefix=p)) for p in ("persistent://a/b/", "x")]
    with pytest.raises(InvalidInputError, match="0x00000000, which is not strictly inside"):
        split_positions("topic_count_equally_divide", FIRST, topics=at_lower_bound)


@pytest.mark.parametrize("count", [0, 1])
def test_topic_count_equally_divide_needs_two_topics(count: int) -> None:
    names = topics_in(FIRST, count)
    with pytest.raises(InvalidInputError, match=rf"at least 2 topics .* got {count}"):
        split_positions("topic_count_equally_divide", FIRST, topics=[TopicLoad(n) for n in names])


def test_specified_positions_divide() -> None:
    points = split_positions(
        "specified_positions_divide", FIRST, positions=[0x30000000, 0x10000000, 0x10000000]
    )
    assert points == [0x10000000, 0x30000000]


PULSAR_SPECIFIED_BUNDLE = BundleRange(1, 1000)


def test_pulsar_specified_positions_returns_the_positions_inside() -> None:
    """SpecifiedPositionsBundleSplitAlgorithmTest.testAlgorithmReturnCorrectResult: a bundle
    [1, 1000] of two topics; the positions outside it, or on its bounds, are dropped."""
    positions = [-1, 0, 1, 100, 200, 500, 800, 1000, 1100]
    points = split_positions(
        "specified_positions_divide", PULSAR_SPECIFIED_BUNDLE, positions=positions, topic_count=2
    )
    assert points == [100, 200, 500, 800]


def test_pulsar_specified_positions_needs_more_than_one_topic() -> None:
    """SpecifiedPositionsBundleSplitAlgorithmTest.testTotalTopicsSizeLessThan1"""
    with pytest.raises(InvalidInputError, match=r"at least 2 topics; bundle range .* has 1"):
        split_positions(
            "specified_positions_divide", PULSAR_SPECIFIED_BUNDLE, positions=[1, 2], topic_count=1
        )


def test_pulsar_specified_positions_needs_positions() -> None:
    """SpecifiedPositionsBundleSplitAlgorithmTest.testSpecifiedPositionsLessThan1"""
    with pytest.raises(InvalidInputError, match="needs at least one position"):
        split_positions("specified_positions_divide", PULSAR_SPECIFIED_BUNDLE, topic_count=2)


def test_specified_positions_topic_count_unknown_is_not_checked() -> None:
    assert split_positions("specified_positions_divide", FIRST, positions=[0x10000000]) == [
        0x10000000
    ]


@pytest.mark.parametrize(
    ("positions", "message"),
    [
        ([0], "0x00000000 not strictly inside"),
        ([0x40000000], "0x40000000 not strictly inside"),
        ([0x50000000, 0x40000000], "0x40000000, 0x50000000 not strictly inside"),
        ([-5], "-5 not strictly inside"),
    ],
)
def test_specified_positions_with_none_inside(positions: list[int], message: str) -> None:
    with pytest.raises(InvalidInputError, match=f"{message} bundle range .*; none left"):
        split_positions("specified_positions_divide", FIRST, positions=positions)


def test_flow_or_qps_cuts_runs_within_the_limits() -> None:
    config = SplitConfig(max_msg_rate=1000, max_bandwidth_mb=1000)
    names = sorted(topics_in(FIRST, 6), key=topic_hash)
    loads = [TopicLoad(n, msg_rate=400) for n in names]  # 2400 msg/s: runs of 2 topics
    points = split_positions("flow_or_qps_equally_divide", FIRST, topics=loads, config=config)
    assert len(points) == 2
    hashes = [topic_hash(n) for n in names]
    for p, (before, after) in zip(
        points, [(hashes[1], hashes[2]), (hashes[3], hashes[4])], strict=True
    ):
        assert before < p <= after
    assert points == sorted(points)


def test_flow_or_qps_separates_adjacent_hashes() -> None:
    config = SplitConfig(max_msg_rate=100)
    h = 0x12345678
    topics = [TopicLoad(forge_topic(h), msg_rate=80), TopicLoad(forge_topic(h + 1), msg_rate=80)]
    assert split_positions("flow_or_qps_equally_divide", FIRST, topics=topics, config=config) == [
        h + 1
    ]


def test_kept_difference_flow_or_qps_never_splits_at_the_upper_bound() -> None:
    # The point after a topic at 0xfffffffe would be 0xffffffff, the bundle's own upper bound.
    last = BundleRange(0xC0000000, FULL_UPPER)
    config = SplitConfig(max_msg_rate=100)
    topics = [
        TopicLoad(forge_topic(0xC0000000), msg_rate=80),
        TopicLoad(forge_topic(0xFFFFFFFE), msg_rate=80),
        TopicLoad(forge_topic(FULL_UPPER), msg_rate=80),
    ]
    points = split_positions("flow_or_qps_equally_divide", last, topics=topics, config=config)
    assert points == [0xC0000000 + (0xFFFFFFFE - 0xC0000000) // 2 + 1]


def test_flow_or_qps_splits_on_bandwidth_too() -> None:
    config = SplitConfig(max_msg_rate=1e9, max_bandwidth_mb=10)
    names = topics_in(FIRST, 3)
    loads = [TopicLoad(n, throughput=8 * MB) for n in names]
    points = split_positions("flow_or_qps_equally_divide", FIRST, topics=loads, config=config)
    assert len(points) == 2


def test_flow_or_qps_ignores_idle_topics_and_needs_two_busy_ones() -> None:
    config = SplitConfig(max_msg_rate=100)
    busy, *idle = topics_in(FIRST, 4)
    loads = [TopicLoad(busy, msg_rate=1000), *(TopicLoad(n) for n in idle)]
    with pytest.raises(InvalidInputError, match=r"at least 2 topics with traffic .* got 1"):
        split_positions("flow_or_qps_equally_divide", FIRST, topics=loads, config=config)


def test_flow_or_qps_needs_the_bundle_over_its_limit_by_the_margin() -> None:
    config = SplitConfig(max_msg_rate=1000, max_bandwidth_mb=1000)
    names = topics_in(FIRST, 2)
    # 1090 msg/s is over 1000 but under 1000 * 1.10.
    loads = [TopicLoad(names[0], msg_rate=545), TopicLoad(names[1], msg_rate=545)]
    with pytest.raises(InvalidInputError, match="not 10% over the limits"):
        split_positions("flow_or_qps_equally_divide", FIRST, topics=loads, config=config)
    loads = [TopicLoad(names[0], msg_rate=600), TopicLoad(names[1], msg_rate=600)]
    assert (
        len(split_positions("flow_or_qps_equally_divide", FIRST, topics=loads, config=config)) == 1
    )


def test_pulsar_flow_or_qps_splits_by_flow_or_qps() -> None:
    """FlowOrQpsEquallyDivideBundleSplitAlgorithmTest.testSplitBundleByFlowOrQps: 100 topics at
    49.5 msg/s, 140 at 50.5 msg/s and one at 60 msg/s, 2000 bytes/s each; limits of 1010 msg/s
    and 100 MB/s. Every run of topics before a split point stays under both limits."""
    config = SplitConfig(max_msg_rate=1010, max_bandwidth_mb=100)
    prefix = "persistent://test-tenant1/test-namespace1/test"
    topics = [
        *(
            TopicLoad(f"{prefix}{i}-partition-{j}", 24.5 + 25, 2000)
            for i in range(1, 6)
            for j in range(20)
        ),
        *(
            TopicLoad(f"{prefix}{i}-partition-{j}", 25.5 + 25, 2000)
            for i in range(6, 13)
            for j in range(20)
        ),
        TopicLoad(f"{prefix}695-partition-0", 25 + 35, 2000),
    ]
    points = split_positions("flow_or_qps_equally_divide", WHOLE, topics=topics, config=config)
    assert len(points) >= 11  # 12080 msg/s in all
    ordered = sorted(topics, key=lambda t: topic_hash(t.topic))
    start = 0
    for point in points:
        run = [t for t in ordered[start:] if topic_hash(t.topic) < point]
        start += len(run)
        assert sum(t.msg_rate for t in run) < 1010
        assert sum(t.throughput for t in run) < 100 * MB


def test_pulsar_flow_or_qps_first_position_is_overloaded() -> None:
    """FlowOrQpsEquallyDivideBundleSplitAlgorithmTest.testFirstPositionIsOverLoad: the topic of
    the lowest hash alone is over the limit, so the first point is one above halfway between it
    and the next."""
    config = SplitConfig(max_msg_rate=1010, max_bandwidth_mb=100)
    names = sorted(
        (f"persistent://test-tenant1/test-namespace1/test-partition-{i}" for i in range(5)),
        key=topic_hash,
    )
    topics = [
        TopicLoad(names[0], 1000 + 1000, 2000),
        *(TopicLoad(n, 24.5 + 25, 2000) for n in names[1:]),
    ]
    points = split_positions("flow_or_qps_equally_divide", WHOLE, topics=topics, config=config)
    first, second = topic_hash(names[0]), topic_hash(names[1])
    assert points[0] == first + (second - first) // 2 + 1


def test_kept_difference_flow_or_qps_counts_topics_sharing_a_hash_as_one() -> None:
    # A light topic at h1, two heavy ones sharing h2. Pulsar would cut at h2 + 1, leaving all
    # three in the lower child; the cut has to fall between h1 and h2.
    config = SplitConfig(max_msg_rate=1000)
    h1, h2 = 0x10000000, 0x20000000
    topics = [
        TopicLoad(forge_topic(h1), msg_rate=10),
        TopicLoad(forge_topic(h2, prefix="persistent://t/ns/one-"), msg_rate=600),
        TopicLoad(forge_topic(h2, prefix="persistent://t/ns/two-"), msg_rate=600),
    ]
    points = split_positions("flow_or_qps_equally_divide", FIRST, topics=topics, config=config)
    assert points == [h1 + (h2 - h1) // 2 + 1]


def test_topic_load_rejects_negative_traffic() -> None:
    with pytest.raises(InvalidInputError, match="must be >= 0"):
        TopicLoad("persistent://t/ns/x", msg_rate=-1)
