"""Bundles: hash ranges of a namespace's topics, their layout, and how one is split.

A topic belongs to the bundle whose range holds the CRC-32 of its full name. A namespace's bundles
partition ``[0x00000000, 0xffffffff]``: each range is ``[lo, hi)`` except the last, which is
``[lo, 0xffffffff]`` (Pulsar's ``NamespaceBundles``). The four split algorithms are Pulsar's
``NamespaceBundleSplitAlgorithm`` implementations, as pure functions returning split points; where
Pulsar's returns no boundary (null), ours raises InvalidInputError saying why.

Two differences are kept, each for a case where Pulsar's result is a split that cannot help:

- flow_or_qps_equally_divide counts topics that share a hash as one. Pulsar keeps only the last
  one's traffic under that hash but visits the hash once per topic, so it can cut just above it:
  with a light topic at h1 and two heavy ones at h2 > h1, it splits at h2 + 1 and leaves every
  topic in the lower child. Ours cuts between h1 and h2 (tests/unit/test_bundles.py
  ``test_kept_difference_flow_or_qps_counts_topics_sharing_a_hash_as_one``).
- flow_or_qps_equally_divide never returns the bundle's upper bound (a topic hashed at
  0xffffffff next to one at 0xfffffffe would give it). Pulsar returns it, and a split there
  would leave the upper child an empty range
  (``test_kept_difference_flow_or_qps_never_splits_at_the_upper_bound``).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from lbd.core.errors import InvalidInputError, NotFoundError
from lbd.core.ids import BundleId
from lbd.core.names import NamespaceName, TopicName
from lbd.core.settings import MB, SplitConfig

FULL_LOWER = 0x00000000
FULL_UPPER = 0xFFFFFFFF
"""The hash space; the bundle ending at FULL_UPPER includes it."""

DEFAULT_BUNDLES = 4
"""Bundles of a new namespace by default (Pulsar ``defaultNumberOfNamespaceBundles``)."""

MAX_BUNDLES = 1 << 16
"""Most bundles a default layout may have: guards against a typo creating millions of bundles."""

FLOW_OR_QPS_DIFFERENCE_THRESHOLD_PCT = 10.0
"""flow_or_qps_equally_divide splits only a bundle this many percent over a limit
(Pulsar ``flowOrQpsDifferenceThresholdPercentage``)."""

_RANGE_TEXT = re.compile(r"0[xX]([0-9a-fA-F]{8})_0[xX]([0-9a-fA-F]{8})")


def topic_hash(topic: str | TopicName) -> int:
    """CRC-32 (unsigned) of the full topic name in UTF-8, as Pulsar's bundle factory hashes it."""
    return zlib.crc32(str(topic).encode("utf-8"))


def _hex(value: int) -> str:
    """``0x%08x``; a negative number (only ever in an error message) as is."""
    return f"0x{value:08x}" if value >= 0 else str(value)


def _check_hash(value: int, what: str) -> None:
    if not FULL_LOWER <= value <= FULL_UPPER:
        raise InvalidInputError(
            f"{what} {value} is outside the hash space [0x00000000, 0xffffffff]"
        )


@dataclass(frozen=True, slots=True, order=True)
class BundleRange:
    """A hash range ``[lo, hi)``, or ``[lo, 0xffffffff]`` when ``hi`` is the top of the space."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        _check_hash(self.lo, "bundle lower bound")
        _check_hash(self.hi, "bundle upper bound")
        if self.lo >= self.hi:
            raise InvalidInputError(
                f"bundle lower bound {_hex(self.lo)} must be below its upper bound {_hex(self.hi)}"
            )

    @property
    def includes_upper(self) -> bool:
        """True for the last bundle of a layout, whose range includes 0xffffffff."""
        return self.hi == FULL_UPPER

    def __contains__(self, hash_value: object) -> bool:
        if not isinstance(hash_value, int):
            return False
        return self.lo <= hash_value < self.hi or (self.includes_upper and hash_value == self.hi)

    def can_split(self) -> bool:
        """Whether a split point strictly inside exists (Pulsar ``canSplitBundle``: hi - lo > 1)."""
        return self.hi - self.lo > 1

    def __str__(self) -> str:
        return f"{_hex(self.lo)}_{_hex(self.hi)}"


def bundle_id(namespace: NamespaceName, lo: int, hi: int) -> BundleId:
    """``tenant/namespace/0x%08x_0x%08x``; the range is validated."""
    return BundleId(f"{namespace}/{BundleRange(lo, hi)}")


@dataclass(frozen=True, slots=True, order=True)
class Bundle:
    """One bundle: a namespace and a hash range."""

    namespace: NamespaceName
    range: BundleRange

    @property
    def id(self) -> BundleId:
        """The canonical id, ``tenant/namespace/0x%08x_0x%08x``."""
        return BundleId(f"{self.namespace}/{self.range}")

    def overlaps(self, other: Bundle) -> bool:
        """Whether a topic can hash into both: one namespace, intersecting ranges (a split
        parent overlaps each of its children)."""
        if self.namespace != other.namespace:
            return False
        a, b = self.range, other.range
        return a.lo < b.hi + b.includes_upper and b.lo < a.hi + a.includes_upper

    def __str__(self) -> str:
        return self.id


@functools.lru_cache(maxsize=1 << 17)
def parse_bundle_id(text: str) -> Bundle:
    """Parse ``tenant/namespace/0xLLLLLLLL_0xHHHHHHHH`` (hex digits of any case).

    Raises InvalidInputError naming the part that is wrong. ``Bundle.id`` of the result is the
    canonical, lower-case spelling. Results are remembered (bundles are immutable, and the same
    ids are parsed over and over on the hot paths).
    """
    ns_text, sep, range_text = text.rpartition("/")
    if not sep:
        raise InvalidInputError(
            f"invalid bundle id {text!r}: expected tenant/namespace/0xLLLLLLLL_0xHHHHHHHH"
        )
    try:
        namespace = NamespaceName.parse(ns_text)
    except InvalidInputError as e:
        raise InvalidInputError(f"invalid bundle id {text!r}: {e}") from None
    match = _RANGE_TEXT.fullmatch(range_text)
    if match is None:
        raise InvalidInputError(
            f"invalid bundle id {text!r}: range {range_text!r} is not 0xLLLLLLLL_0xHHHHHHHH "
            "(8 hex digits each)"
        )
    try:
        bundle_range = BundleRange(int(match.group(1), 16), int(match.group(2), 16))
    except InvalidInputError as e:
        raise InvalidInputError(f"invalid bundle id {text!r}: {e}") from None
    return Bundle(namespace, bundle_range)


def default_boundaries(n: int = DEFAULT_BUNDLES) -> tuple[int, ...]:
    """Boundaries of ``n`` equal bundles: multiples of 2^32 // n, the last one 0xffffffff."""
    if not 1 <= n <= MAX_BUNDLES:
        raise InvalidInputError(f"number of bundles must be between 1 and {MAX_BUNDLES}, got {n}")
    step = (FULL_UPPER + 1) // n
    return (*(i * step for i in range(n)), FULL_UPPER)


@dataclass(frozen=True, slots=True)
class NamespaceBundles:
    """The bundle layout of one namespace: sorted boundaries partitioning the hash space."""

    namespace: NamespaceName
    boundaries: tuple[int, ...]

    def __post_init__(self) -> None:
        b = self.boundaries
        where = f"bundle boundaries of {self.namespace}"
        if len(b) < 2:
            raise InvalidInputError(f"{where}: need at least 2 boundaries, got {len(b)}")
        if b[0] != FULL_LOWER or b[-1] != FULL_UPPER:
            raise InvalidInputError(
                f"{where}: must start at 0x00000000 and end at 0xffffffff, "
                f"got {_hex(b[0])} .. {_hex(b[-1])}"
            )
        for prev, cur in itertools.pairwise(b):
            if cur <= prev:
                raise InvalidInputError(
                    f"{where}: must be strictly increasing, got {_hex(cur)} after {_hex(prev)}"
                )

    @classmethod
    def default(cls, namespace: NamespaceName, n: int = DEFAULT_BUNDLES) -> NamespaceBundles:
        """``n`` equal bundles (see :func:`default_boundaries`)."""
        return cls(namespace, default_boundaries(n))

    def __len__(self) -> int:
        return len(self.boundaries) - 1

    def bundles(self) -> list[Bundle]:
        """Every bundle, in hash order."""
        b = self.boundaries
        return [Bundle(self.namespace, BundleRange(lo, hi)) for lo, hi in itertools.pairwise(b)]

    def find(self, key: str | TopicName | int) -> Bundle:
        """The bundle holding a topic (full name, checked to be of this namespace) or a hash."""
        if isinstance(key, int):
            _check_hash(key, "hash")
            hash_value = key
        else:
            topic = key if isinstance(key, TopicName) else TopicName.parse(key)
            if topic.namespace != self.namespace:
                raise InvalidInputError(f"topic {topic} is not in namespace {self.namespace}")
            hash_value = topic_hash(topic)
        # The last boundary (0xffffffff) belongs to the last bundle, not to a bundle of its own.
        i = min(bisect.bisect_right(self.boundaries, hash_value), len(self.boundaries) - 1) - 1
        return Bundle(self.namespace, BundleRange(self.boundaries[i], self.boundaries[i + 1]))

    def index(self, bundle: BundleRange) -> int:
        """Position of ``bundle`` in the layout; NotFoundError when it is not one of its bundles."""
        i = bisect.bisect_left(self.boundaries, bundle.lo)
        if i + 1 < len(self.boundaries) and self.boundaries[i : i + 2] == (bundle.lo, bundle.hi):
            return i
        raise NotFoundError(
            f"bundle {self.namespace}/{bundle} is not in the layout of {self.namespace}"
        )

    def split(self, bundle: BundleRange, at: Iterable[int]) -> NamespaceBundles:
        """The layout with ``bundle`` cut at ``at`` (points strictly inside it; order is free)."""
        i = self.index(bundle)
        points = sorted(set(at))
        if not points:
            raise InvalidInputError(f"split of {self.namespace}/{bundle}: no split point given")
        outside = [p for p in points if not bundle.lo < p < bundle.hi]
        if outside:
            shown = ", ".join(_hex(p) for p in outside)
            raise InvalidInputError(
                f"split of {self.namespace}/{bundle}: point(s) {shown} not strictly inside it"
            )
        b = self.boundaries
        return NamespaceBundles(self.namespace, (*b[: i + 1], *points, *b[i + 1 :]))


class SplitAlgorithm(StrEnum):
    """How to choose split points (Pulsar's names)."""

    RANGE_EQUALLY_DIVIDE = "range_equally_divide"
    TOPIC_COUNT_EQUALLY_DIVIDE = "topic_count_equally_divide"
    SPECIFIED_POSITIONS_DIVIDE = "specified_positions_divide"
    FLOW_OR_QPS_EQUALLY_DIVIDE = "flow_or_qps_equally_divide"

    @classmethod
    def parse(cls, name: str) -> SplitAlgorithm:
        """The algorithm called ``name``; InvalidInputError listing the four names otherwise."""
        try:
            return cls(name)
        except ValueError:
            names = ", ".join(a.value for a in cls)
            raise InvalidInputError(
                f"unknown split algorithm {name!r}; expected one of: {names}"
            ) from None


@dataclass(frozen=True, slots=True)
class TopicLoad:
    """One topic of a bundle with its traffic (in + out), the input of the topic-based splits."""

    topic: str
    msg_rate: float = 0.0
    """Messages/s in plus out."""
    throughput: float = 0.0
    """Bytes/s in plus out."""

    def __post_init__(self) -> None:
        if self.msg_rate < 0 or self.throughput < 0:
            raise InvalidInputError(
                f"topic {self.topic!r}: msg_rate and throughput must be >= 0, "
                f"got {self.msg_rate} and {self.throughput}"
            )


def split_positions(
    algorithm: SplitAlgorithm | str,
    bundle: BundleRange,
    *,
    topics: Sequence[TopicLoad] = (),
    positions: Sequence[int] = (),
    config: SplitConfig | None = None,
    topic_count: int | None = None,
) -> list[int]:
    """Split points strictly inside ``bundle``, sorted, as ``algorithm`` chooses them.

    ``topics`` are the bundle's topics (topic_count and flow_or_qps use them), ``positions`` the
    operator's points (specified_positions), ``config`` the bundle limits (flow_or_qps),
    ``topic_count`` the number of topics in the bundle from its stats (specified_positions
    refuses fewer than 2; None: unknown, not checked). Raises InvalidInputError when the bundle
    cannot be split that way, saying why.
    """
    algo = SplitAlgorithm.parse(algorithm) if isinstance(algorithm, str) else algorithm
    if not bundle.can_split():
        raise InvalidInputError(f"bundle range {bundle} is too small to split")
    hashes = [topic_hash(t.topic) for t in topics]
    strays = [t.topic for t, h in zip(topics, hashes, strict=True) if h not in bundle]
    if strays:
        raise InvalidInputError(f"topic {strays[0]!r} does not hash into bundle range {bundle}")
    match algo:
        case SplitAlgorithm.RANGE_EQUALLY_DIVIDE:
            return [bundle.lo + (bundle.hi - bundle.lo) // 2]
        case SplitAlgorithm.TOPIC_COUNT_EQUALLY_DIVIDE:
            return _topic_count_point(bundle, sorted(hashes))
        case SplitAlgorithm.SPECIFIED_POSITIONS_DIVIDE:
            return _specified_points(bundle, positions, topic_count)
        case SplitAlgorithm.FLOW_OR_QPS_EQUALLY_DIVIDE:
            return _flow_or_qps_points(bundle, topics, hashes, config or SplitConfig())


def _topic_count_point(bundle: BundleRange, hashes: list[int]) -> list[int]:
    """Halfway between the two middle topic hashes, rounded down, as Pulsar's
    ``TopicCountEquallyDivideBundleSplitAlgorithm``: with an even count each half holds as many
    topics unless those two hashes are adjacent or equal (then the lower one moves up too)."""
    if len(hashes) < 2:
        raise InvalidInputError(
            f"topic_count_equally_divide needs at least 2 topics in bundle range {bundle}, "
            f"got {len(hashes)}"
        )
    below, above = hashes[len(hashes) // 2 - 1], hashes[len(hashes) // 2]
    point = below + (above - below) // 2
    if not bundle.lo < point < bundle.hi:
        raise InvalidInputError(
            f"topic_count_equally_divide: the middle topics of bundle range {bundle} give the "
            f"point {_hex(point)}, which is not strictly inside it"
        )
    return [point]


def _specified_points(
    bundle: BundleRange, positions: Sequence[int], topic_count: int | None
) -> list[int]:
    """The operator's points strictly inside the range; the others are dropped, as Pulsar's
    ``SpecifiedPositionsBundleSplitAlgorithm`` does. No split when none is left, nor of a bundle
    with fewer than 2 topics."""
    if not positions:
        raise InvalidInputError("specified_positions_divide needs at least one position")
    inside = sorted({p for p in positions if bundle.lo < p < bundle.hi})
    if not inside:
        shown = ", ".join(_hex(p) for p in sorted(set(positions)))
        raise InvalidInputError(
            f"specified_positions_divide: position(s) {shown} not strictly inside bundle "
            f"range {bundle}; none left to split at"
        )
    if topic_count is not None and topic_count < 2:
        raise InvalidInputError(
            f"specified_positions_divide splits only a bundle with at least 2 topics; bundle "
            f"range {bundle} has {topic_count}"
        )
    return inside


def _flow_or_qps_points(
    bundle: BundleRange, topics: Sequence[TopicLoad], hashes: list[int], config: SplitConfig
) -> list[int]:
    """Cut the hash-ordered topics into runs whose rate and throughput stay within the limits.

    As Pulsar's ``FlowOrQpsEquallyDivideBundleSplitAlgorithm``: topics with no traffic are
    ignored; the bundle is split only when its rate or throughput is over its limit by
    FLOW_OR_QPS_DIFFERENCE_THRESHOLD_PCT; a run is closed before the topic that would push it
    over a limit (strictly greater), at the point one above halfway between the previous topic's
    hash and this one's. Topics sharing a hash count as one, and the bundle's upper bound is
    never a point (see the module docstring).
    """
    max_rate = config.max_msg_rate
    max_bytes = config.max_bandwidth_mb * MB
    # Topics sharing a hash cannot be separated, so they count as one (module docstring).
    by_hash: dict[int, tuple[float, float]] = {}
    for t, h in zip(topics, hashes, strict=True):
        if t.msg_rate <= 0 and t.throughput <= 0:
            continue
        rate, size = by_hash.get(h, (0.0, 0.0))
        by_hash[h] = (rate + t.msg_rate, size + t.throughput)
    if len(by_hash) < 2:
        raise InvalidInputError(
            f"flow_or_qps_equally_divide needs at least 2 topics with traffic in bundle range "
            f"{bundle}, got {len(by_hash)}"
        )
    total_rate = sum(r for r, _ in by_hash.values())
    total_bytes = sum(s for _, s in by_hash.values())
    margin = 1 + FLOW_OR_QPS_DIFFERENCE_THRESHOLD_PCT / 100
    if total_rate < max_rate * margin and total_bytes < max_bytes * margin:
        raise InvalidInputError(
            f"flow_or_qps_equally_divide: bundle range {bundle} carries {total_rate:.1f} msg/s "
            f"and {total_bytes / MB:.1f} MB/s, not {FLOW_OR_QPS_DIFFERENCE_THRESHOLD_PCT:g}% over "
            f"the limits ({max_rate:g} msg/s, {config.max_bandwidth_mb:g} MB/s)"
        )
    ordered = sorted(by_hash)
    points: list[int] = []
    run_rate, run_bytes = by_hash[ordered[0]]
    for prev, cur in itertools.pairwise(ordered):
        rate, size = by_hash[cur]
        if run_rate + rate > max_rate or run_bytes + size > max_bytes:
            point = prev + (cur - prev) // 2 + 1
            # Only a topic hashed at 0xffffffff could put the point on the upper bound.
            if point < bundle.hi:
                points.append(point)
            run_rate, run_bytes = rate, size
        else:
            run_rate, run_bytes = run_rate + rate, run_bytes + size
    if not points:
        raise InvalidInputError(
            f"flow_or_qps_equally_divide: no split point inside bundle range {bundle}"
        )
    return points


def split_points(parent: BundleId, children: Mapping[BundleId, object]) -> list[int]:
    """The points at which ``children`` cut ``parent``; InvalidInputError unless they tile it
    (at least two children, all of the parent's namespace, together exactly its range)."""
    whole = parse_bundle_id(parent)
    parts = sorted(parse_bundle_id(child) for child in children)
    if len(parts) < 2:
        raise InvalidInputError(f"split of {parent}: needs at least 2 children, got {len(parts)}")
    if any(p.namespace != whole.namespace for p in parts):
        raise InvalidInputError(f"split of {parent}: children of another namespace")
    edges = [(p.range.lo, p.range.hi) for p in parts]
    tiles = all(a[1] == b[0] for a, b in itertools.pairwise(edges))
    if edges[0][0] != whole.range.lo or edges[-1][1] != whole.range.hi or not tiles:
        raise InvalidInputError(f"split of {parent}: children {sorted(children)} do not tile it")
    return [lo for lo, _ in edges[1:]]
