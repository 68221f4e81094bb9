"""What clients really send and receive, counted per topic and turned into load reports.

Each topic keeps running counters (messages and bytes in, messages and bytes out); a report
takes the difference since the previous report over the time between them, so its rates are
what clients did in that interval. Producers and consumers are counted from the open handles.
The host's (or the process's) CPU and memory come from :mod:`lbd.front.usage`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from lbd.core.ids import BundleId
from lbd.front.served import ServedBundles, Topic
from lbd.gen.v1 import lbd_pb2

TOP_TOPICS_PER_BUNDLE = 10
"""Per-topic stats sent per bundle, the busiest first (what the split algorithms read)."""


@dataclass(slots=True)
class TopicTraffic:
    """Running counters of one topic since the front first served it."""

    topic: Topic
    msgs_in: int = 0
    bytes_in: int = 0
    msgs_out: int = 0
    bytes_out: int = 0
    producers: int = 0
    consumers: int = 0

    def sent(self, messages: int, size: int) -> None:
        """A producer's SEND was written to storage."""
        self.msgs_in += messages
        self.bytes_in += size

    def delivered(self, size: int) -> None:
        """An entry was delivered to a consumer."""
        self.msgs_out += 1
        self.bytes_out += size


@dataclass(slots=True)
class _Sample:
    at: float
    counts: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Rates:
    """One topic's rates over the last report interval."""

    msg_rate_in: float
    msg_rate_out: float
    throughput_in: float
    throughput_out: float

    @property
    def msg_rate(self) -> float:
        return self.msg_rate_in + self.msg_rate_out

    @property
    def throughput(self) -> float:
        return self.throughput_in + self.throughput_out


class TrafficBook:
    """Every topic's counters, and the rates between two reports."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._topics: dict[str, TopicTraffic] = {}
        self._last = _Sample(clock())

    def of(self, topic: Topic) -> TopicTraffic:
        """The counters of ``topic`` (made on first use)."""
        traffic = self._topics.get(topic.name)
        if traffic is None:
            traffic = self._topics[topic.name] = TopicTraffic(topic)
        return traffic

    def topics(self) -> Iterable[TopicTraffic]:
        """Every topic counted so far."""
        return self._topics.values()

    def totals(self) -> tuple[int, int, int, int]:
        """Messages in, bytes in, messages out, bytes out, over every topic ever served."""
        m_in = b_in = m_out = b_out = 0
        for t in self._topics.values():
            m_in += t.msgs_in
            b_in += t.bytes_in
            m_out += t.msgs_out
            b_out += t.bytes_out
        return m_in, b_in, m_out, b_out

    def rates(self) -> dict[str, Rates]:
        """Each topic's rates since the previous call (the first call: since the book began)."""
        now = self._clock()
        span = max(now - self._last.at, 1e-3)
        counts = {
            name: (t.msgs_in, t.bytes_in, t.msgs_out, t.bytes_out)
            for name, t in self._topics.items()
        }
        previous = self._last.counts
        rates = {}
        for name, (m_in, b_in, m_out, b_out) in counts.items():
            p_in, pb_in, p_out, pb_out = previous.get(name, (0, 0, 0, 0))
            rates[name] = Rates(
                (m_in - p_in) / span,
                (m_out - p_out) / span,
                (b_in - pb_in) / span,
                (b_out - pb_out) / span,
            )
        self._last = _Sample(now, counts)
        return rates


def bundle_stats(
    served: ServedBundles,
    traffic: Iterable[TopicTraffic],
    rates: Mapping[str, Rates],
) -> list[lbd_pb2.BundleStats]:
    """The stats of every served bundle from its topics' rates and open handles (a topic of a
    split's parent and child counts in the child, the narrower)."""
    members: dict[BundleId, list[TopicTraffic]] = {b: [] for b in served.bundles()}
    for t in traffic:
        holders = served.containing(t.topic)
        if holders:
            members[min(holders, key=_width)].append(t)
    out = []
    idle = Rates(0.0, 0.0, 0.0, 0.0)
    for bundle, topics in members.items():
        live = [(t, rates.get(t.topic.name, idle)) for t in topics]
        live = [(t, r) for t, r in live if r.msg_rate > 0 or t.producers or t.consumers]
        live.sort(key=lambda tr: tr[1].msg_rate, reverse=True)
        out.append(
            lbd_pb2.BundleStats(
                bundle=bundle,
                msg_rate_in=sum(r.msg_rate_in for _, r in live),
                msg_rate_out=sum(r.msg_rate_out for _, r in live),
                msg_throughput_in=sum(r.throughput_in for _, r in live),
                msg_throughput_out=sum(r.throughput_out for _, r in live),
                topics=len(live),
                producer_count=sum(t.producers for t, _ in live),
                consumer_count=sum(t.consumers for t, _ in live),
                topic_stats=[
                    lbd_pb2.TopicStats(
                        topic=t.topic.name, msg_rate=r.msg_rate, msg_throughput=r.throughput
                    )
                    for t, r in live[:TOP_TOPICS_PER_BUNDLE]
                ],
            )
        )
    return out


def _width(bundle: BundleId) -> int:
    lo, _, hi = bundle.rpartition("/")[2].partition("_")
    return int(hi, 16) - int(lo, 16)
