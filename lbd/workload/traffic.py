"""Synthetic traffic: of a simulated broker process (:class:`Workload`: named topics per bundle,
per-bundle stats, resource usage), and of the simulation world (:class:`HashedTopicTraffic`).

Pure and deterministic: a topic's base rate depends only on the seed and the topic's name, and the
jitter of one report only on the seed, the bundle and the report's sequence number. So the same
bundle carries the same load whichever broker serves it (a transfer moves its load along), and the
children of a split carry their parent's topics between them.

Topics of a bundle are named ``{domain}://tenant/ns/sim-<j>`` for the smallest ``j`` whose CRC-32
falls in the bundle's range, so that the split algorithms working on topic hashes see topics that
really belong to the bundle. A few topics are hot (``hot_fraction`` of them carry ``hot_factor``
times the mean rate), which is what makes some bundles worth moving or splitting.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import math
import random
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from lbd.core.broker_info import LoadReport
from lbd.core.bundles import FULL_UPPER, Bundle, parse_bundle_id, topic_hash
from lbd.core.ids import BundleId
from lbd.core.load import BundleLoad, ResourceUsage
from lbd.workload.model import usage_of

MAX_NAME_PROBES = 200_000
"""Most candidate names tried per bundle; a very narrow bundle may end up with fewer topics."""

MB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """The shape of the synthetic traffic and the broker's capacity."""

    topics_per_bundle: int = 10
    msg_rate: float = 50.0
    """Mean messages/s produced per topic (each also consumed ``fanout`` times)."""
    msg_size_bytes: int = 1024
    fanout: float = 1.0
    hot_fraction: float = 0.05
    hot_factor: float = 20.0
    jitter: float = 0.1
    """Each report scales a bundle's rates by a factor drawn in ``[1 - jitter, 1 + jitter]``."""
    seed: int = 0
    cpu_capacity_msg_rate: float = 100_000.0
    """Messages/s (in plus out) that take the broker's CPU to 100%."""
    nic_mbit: float = 1000.0
    memory_limit_mb: float = 4096.0
    memory_base_mb: float = 512.0
    memory_per_topic_mb: float = 0.5
    direct_memory_limit_mb: float = 2048.0
    direct_memory_base_mb: float = 64.0

    def __post_init__(self) -> None:
        if self.topics_per_bundle < 0:
            raise ValueError(f"topics per bundle must be >= 0, got {self.topics_per_bundle}")
        if self.msg_rate < 0:
            raise ValueError(f"message rate must be >= 0, got {self.msg_rate}")
        if not 0 <= self.hot_fraction <= 1:
            raise ValueError(f"hot fraction must be in [0, 1], got {self.hot_fraction}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")
        if self.msg_size_bytes <= 0 or self.fanout < 0 or self.hot_factor < 1:
            raise ValueError("message size must be > 0, fanout >= 0 and hot factor >= 1")


@dataclass(frozen=True, slots=True)
class TopicTraffic:
    """One topic's rates in one report."""

    topic: str
    msg_rate_in: float
    msg_rate_out: float
    throughput_in: float
    """Bytes/s."""
    throughput_out: float

    @property
    def msg_rate(self) -> float:
        """Messages/s in plus out."""
        return self.msg_rate_in + self.msg_rate_out

    @property
    def throughput(self) -> float:
        """Bytes/s in plus out."""
        return self.throughput_in + self.throughput_out


@dataclass(frozen=True, slots=True)
class BundleTraffic:
    """One bundle's traffic in one report: its topics, busiest first, and their sums."""

    bundle: BundleId
    topics: tuple[TopicTraffic, ...]
    producers: int
    consumers: int

    @property
    def msg_rate_in(self) -> float:
        """Messages/s produced into the bundle's topics."""
        return sum(t.msg_rate_in for t in self.topics)

    @property
    def msg_rate_out(self) -> float:
        """Messages/s consumed from the bundle's topics."""
        return sum(t.msg_rate_out for t in self.topics)

    @property
    def throughput_in(self) -> float:
        """Bytes/s in."""
        return sum(t.throughput_in for t in self.topics)

    @property
    def throughput_out(self) -> float:
        """Bytes/s out."""
        return sum(t.throughput_out for t in self.topics)


@dataclass(frozen=True, slots=True)
class BrokerSample:
    """A broker's resource usage and per-bundle traffic for one load report."""

    cpu: ResourceUsage
    """Percent of all cores."""
    memory: ResourceUsage
    """MB."""
    direct_memory: ResourceUsage
    """MB."""
    bandwidth_in: ResourceUsage
    """Mbit/s."""
    bandwidth_out: ResourceUsage
    """Mbit/s."""
    bundles: tuple[BundleTraffic, ...]


@dataclass(frozen=True, slots=True)
class _SimTopic:
    name: str
    base_rate: float


@dataclass(slots=True)
class Workload:
    """The synthetic traffic of every bundle, computed on demand and cached per bundle."""

    spec: WorkloadSpec = field(default_factory=WorkloadSpec)
    _topics: dict[BundleId, tuple[_SimTopic, ...]] = field(default_factory=dict, init=False)
    _names: dict[str, _NamePool] = field(default_factory=dict, init=False)
    _steady: dict[BundleId, BundleTraffic] = field(default_factory=dict, init=False)
    """The traffic of bundles whose traffic is the same in every report: no jitter, or no
    messages. A broker with thousands of quiet bundles reports them every second."""

    def topics(self, bundle: BundleId) -> tuple[str, ...]:
        """The names of the bundle's synthetic topics (InvalidInputError for a bad bundle id)."""
        return tuple(t.name for t in self._topics_of(bundle))

    def bundle_traffic(self, bundle: BundleId, sequence: int) -> BundleTraffic:
        """The bundle's traffic in report number ``sequence``."""
        steady = self._steady.get(bundle)
        if steady is not None:
            return steady
        spec = self.spec
        factor = 1.0
        if spec.jitter > 0:
            # A hash, not a seeded Random: a broker with ten thousand bundles draws this for
            # each of them in every report, and seeding a Random costs microseconds.
            u = zlib.crc32(f"{spec.seed}:{bundle}:{sequence}".encode()) / 0x1_0000_0000
            factor = 1 - spec.jitter + 2 * spec.jitter * u
        topics = [
            TopicTraffic(
                topic=t.name,
                msg_rate_in=t.base_rate * factor,
                msg_rate_out=t.base_rate * factor * spec.fanout,
                throughput_in=t.base_rate * factor * spec.msg_size_bytes,
                throughput_out=t.base_rate * factor * spec.fanout * spec.msg_size_bytes,
            )
            for t in self._topics_of(bundle)
        ]
        topics.sort(key=lambda t: (-t.msg_rate, t.topic))
        active = [t for t in topics if t.msg_rate_in > 0]
        traffic = BundleTraffic(
            bundle=bundle,
            topics=tuple(topics),
            producers=len(active),
            consumers=round(len(active) * spec.fanout),
        )
        if spec.jitter <= 0 or not active:
            self._steady[bundle] = traffic
        return traffic

    def sample(self, bundles: Iterable[BundleId], sequence: int) -> BrokerSample:
        """Usage and per-bundle traffic of a broker serving ``bundles``, for report ``sequence``."""
        spec = self.spec
        traffic = tuple(self.bundle_traffic(b, sequence) for b in sorted(bundles))
        rate = sum(b.msg_rate_in + b.msg_rate_out for b in traffic)
        bytes_in = sum(b.throughput_in for b in traffic)
        bytes_out = sum(b.throughput_out for b in traffic)
        topics = sum(len(b.topics) for b in traffic)
        return BrokerSample(
            cpu=ResourceUsage(min(100.0, 100.0 * rate / spec.cpu_capacity_msg_rate), 100.0),
            memory=ResourceUsage(
                spec.memory_base_mb + topics * spec.memory_per_topic_mb, spec.memory_limit_mb
            ),
            direct_memory=ResourceUsage(
                spec.direct_memory_base_mb + (bytes_in + bytes_out) / MB,
                spec.direct_memory_limit_mb,
            ),
            bandwidth_in=ResourceUsage(bytes_in * 8 / 1e6, spec.nic_mbit),
            bandwidth_out=ResourceUsage(bytes_out * 8 / 1e6, spec.nic_mbit),
            bundles=traffic,
        )

    def prepare(self, bundle: BundleId) -> None:
        """Build the pool of candidate names of the bundle's namespace if there is none yet.
        The first bundle of a namespace builds it: 50 ms for 4,000 bundles, 0.1 s for 10,000,
        which a broker spends once, on the Own that brought it the namespace, rather than in a
        load report at some later instant. The bundle's topics are made at its first sample, a
        few microseconds each, as is a growth for narrower bundles (a split's children): on the
        Own, it would hold up every child of the split."""
        parsed = parse_bundle_id(bundle)
        if str(parsed.namespace) not in self._names:
            self._pool(parsed).first_in(parsed, self.spec.topics_per_bundle)

    def _topics_of(self, bundle: BundleId) -> tuple[_SimTopic, ...]:
        cached = self._topics.get(bundle)
        if cached is None:
            cached = self._make_topics(parse_bundle_id(bundle))
            self._topics[bundle] = cached
        return cached

    def _pool(self, bundle: Bundle) -> _NamePool:
        namespace = str(bundle.namespace)
        pool = self._names.get(namespace)
        if pool is None:
            pool = self._names[namespace] = _NamePool(namespace)
        return pool

    def _make_topics(self, bundle: Bundle) -> tuple[_SimTopic, ...]:
        spec = self.spec
        pool = self._pool(bundle)
        out: list[_SimTopic] = []
        for j in pool.first_in(bundle, spec.topics_per_bundle):
            name = pool.name(j)
            # Two uniform draws from a hash of the seed and the name, not a Random seeded with
            # them: seeding costs microseconds, for each topic of thousands of bundles.
            digest = hashlib.blake2b(f"{spec.seed}:{name}".encode(), digest_size=16).digest()
            u_rate = int.from_bytes(digest[:8], "big") / 2**64
            u_hot = int.from_bytes(digest[8:], "big") / 2**64
            # Exponential rates around the mean: most topics are quiet, a few busy.
            rate = -math.log(1.0 - u_rate) * spec.msg_rate
            if u_hot < spec.hot_fraction:
                rate *= spec.hot_factor
            out.append(_SimTopic(name, rate))
        return tuple(out)


class _NamePool:
    """The candidate names ``sim-<j>`` of one namespace, hashed once and sorted by hash.

    A bundle's topics are the smallest ``j`` whose hash falls in its range. Probing ``j`` one by
    one costs about (hash space / bundle width) hashes per topic, every bundle afresh: seconds per
    bundle in a namespace of many thousand bundles. The pool hashes each candidate once for the
    whole namespace and finds a range's candidates by bisection. It grows until a range holds
    enough of them, up to ``MAX_NAME_PROBES``: at once to ``_POOL_HEADROOM`` times the candidates
    a range of that width needs on average, so that one growth serves every bundle of a namespace.
    With twice as many, a range came up short now and then (one in 400 on average), and the
    next growth (four times the pool, 50 ms for a namespace of 4,000 bundles) stalled the
    broker's event loop in the middle of a benchmark.
    Whatever its size, the names are the same as probing gives. Each candidate is kept as one
    integer, its hash above its ``j``, so that sorting and bisecting compare plain integers.
    """

    def __init__(self, namespace: str) -> None:
        self._prefix = f"persistent://{namespace}/sim-"
        self._size = 0
        self._keys: list[int] = []  # (hash << _INDEX_BITS) | j, sorted

    def name(self, j: int) -> str:
        return f"{self._prefix}{j}"

    def first_in(self, bundle: Bundle, count: int) -> list[int]:
        """The ``count`` smallest ``j`` whose name hashes into the bundle's range (fewer when
        not even ``MAX_NAME_PROBES`` candidates hold that many)."""
        if count <= 0:
            return []
        while True:
            found = self._in(bundle)
            if len(found) >= count or self._size >= MAX_NAME_PROBES:
                return sorted(found)[:count]
            width = bundle.range.hi - bundle.range.lo + 1
            needed = _POOL_HEADROOM * (count + 2) * (FULL_UPPER + 1) // width
            self._grow(min(MAX_NAME_PROBES, max(self._size * 4, needed, 1024)))

    def _in(self, bundle: Bundle) -> list[int]:
        r = bundle.range
        start = bisect.bisect_left(self._keys, r.lo << _INDEX_BITS)
        upper = r.hi + 1 if r.hi == FULL_UPPER else r.hi  # the last bundle holds 0xffffffff
        end = bisect.bisect_left(self._keys, upper << _INDEX_BITS)
        return [key & _INDEX_MASK for key in self._keys[start:end]]

    def _grow(self, size: int) -> None:
        name = self.name
        fresh = [(topic_hash(name(j)) << _INDEX_BITS) | j for j in range(self._size, size)]
        fresh.sort()
        self._keys = list(heapq.merge(self._keys, fresh))
        self._size = size


_POOL_HEADROOM = 8
"""A range holds this many times the candidates it needs on average once the pool grew for it:
short by chance (Poisson) less than once in 10^10 ranges for one topic each, less for more."""
_INDEX_BITS = MAX_NAME_PROBES.bit_length()
_INDEX_MASK = (1 << _INDEX_BITS) - 1


class HashedTopicTraffic:
    """The messages a simulated cluster carries (the simulation world's): a fixed set of topics,
    each at a hash position with a seeded rate, so that a bundle carries what its range holds (a
    split divides it as a real one does), and load swings that make one topic hot for a while.
    A broker's report goes through the load model's conversion
    (:func:`~lbd.workload.model.usage_of`): its load is a base share plus its message rate over
    its capacity."""

    TOPICS = 200
    CAPACITY_MSG_S = 10_000.0
    """A broker is fully loaded at this many messages per second."""
    BASE_LOAD = 0.05
    """The load of a broker that carries nothing."""

    def __init__(self, rng: random.Random) -> None:
        topics = sorted(
            (rng.randrange(2**32), rng.uniform(10.0, 200.0)) for _ in range(self.TOPICS)
        )
        self._hashes = [h for h, _ in topics]
        self._rates = [r for _, r in topics]
        self._hot: dict[int, float] = {}
        self._loads: dict[BundleId, BundleLoad] = {}
        """What each bundle carries, until the next swing."""

    def swing(self, topic: int, factor: float) -> None:
        """Make ``topic`` (an index) ``factor`` times busier (1: back to normal)."""
        if factor == 1.0:
            self._hot.pop(topic, None)
        else:
            self._hot[topic] = factor
        self._loads.clear()

    def load(self, bundle: BundleId) -> BundleLoad:
        """What ``bundle`` carries now."""
        found = self._loads.get(bundle)
        if found is not None:
            return found
        r = parse_bundle_id(bundle).range
        first = bisect.bisect_left(self._hashes, r.lo)
        end = r.hi + 1 if r.includes_upper else r.hi
        last = bisect.bisect_left(self._hashes, end)
        rate = sum(self._rates[i] * self._hot.get(i, 1.0) for i in range(first, last))
        found = self._loads[bundle] = BundleLoad(
            bundle,
            msg_rate_in=rate / 2,
            msg_rate_out=rate / 2,
            msg_throughput_in=rate * 512,
            msg_throughput_out=rate * 512,
            topics=last - first,
        )
        return found

    def report(self, serving: Sequence[BundleId]) -> LoadReport:
        """A broker's load report for the bundles it serves."""
        bundles = tuple(self.load(b) for b in serving)
        rate = sum(b.msg_rate for b in bundles)
        load = min(1.0, self.BASE_LOAD + rate / self.CAPACITY_MSG_S)
        usage = usage_of(load, sum(b.msg_throughput for b in bundles), len(bundles))
        return LoadReport(
            usage=replace(usage, topics=sum(b.topics for b in bundles)), bundles=bundles
        )
