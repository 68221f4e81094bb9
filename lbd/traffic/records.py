"""What real clients saw, message by message, and the figures a user judges a cluster by.

Every message a producer sends carries its producer's index and a sequence number in its
payload. The record keeps, per producer, when each message was sent and how its send ended (a
receipt, or the error the client reported), and, per consumer, every message it received. From
that alone (nothing the brokers say) :func:`summarize` counts:

- **failed**: sends the client reported failed (a timeout, a full queue, a refusal);
- **lost**: sends the client saw acknowledged that no consumer received;
- **duplicates**: deliveries of a message after its first (to any consumer of the subscription);
  of those, **stored twice**: the ones under another storage id than the first, a message storage
  holds twice (a send written, then written again by the producer's resend after a reconnect, or
  by the client's new broker) rather than one delivered again;
- **reordered**: first deliveries of a message that came after a later message of the same
  producer on the same consumer (a Shared subscription reorders by design: count those there
  only as a figure);
- **send latency**: from the send call to the receipt, its median, p99, p99.99 and maximum;
- **delivery gap**: the longest time a topic went without a first delivery, while its producer
  was sending.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

PAYLOAD_SEPARATOR = b":"


def payload(producer: int, seq: int, size: int) -> bytes:
    """A message body naming its producer and sequence, padded to ``size`` bytes."""
    head = b"%d:%d:" % (producer, seq)
    return head + b"x" * max(size - len(head), 0)


def parse_payload(body: bytes) -> tuple[int, int] | None:
    """The producer and sequence of a body :func:`payload` made; None for any other."""
    parts = body.split(PAYLOAD_SEPARATOR, 2)
    if len(parts) < 3:
        return None
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return None


@dataclass(slots=True)
class Send:
    """One send: when it was made, and how and when it ended (None: still pending)."""

    sent_ns: int
    ended_ns: int | None = None
    error: str | None = None
    message_id: str | None = None
    """The id storage gave the message, as the client prints it (an acknowledged send)."""


@dataclass(slots=True)
class ProducerRecord:
    """Every send of one producer, by sequence number."""

    topic: str
    sends: list[Send] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One message a consumer received."""

    consumer: int
    producer: int
    seq: int
    at_ns: int
    redelivery_count: int
    message_id: str = ""
    """The storage id the consumer saw, as the client prints it."""


class TrafficRecord:
    """The record of one run; written from the client's callback threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.producers: list[ProducerRecord] = []
        self.consumer_topics: list[str] = []
        self.deliveries: list[Delivery] = []
        self.strangers = 0
        """Messages received that no producer of this record sent."""

    def add_producer(self, topic: str) -> int:
        """A new producer's index."""
        with self._lock:
            self.producers.append(ProducerRecord(topic))
            return len(self.producers) - 1

    def add_consumer(self, topic: str) -> int:
        """A new consumer's index."""
        with self._lock:
            self.consumer_topics.append(topic)
            return len(self.consumer_topics) - 1

    def sent(self, producer: int, sent_ns: int) -> Send:
        """A send was made (its sequence is its place in the producer's list)."""
        send = Send(sent_ns)
        self.producers[producer].sends.append(send)
        return send

    def delivered(
        self,
        consumer: int,
        body: bytes,
        at_ns: int,
        redelivery_count: int,
        message_id: str = "",
    ) -> None:
        """A consumer received a message."""
        parsed = parse_payload(body)
        if parsed is None or parsed[0] >= len(self.producers):
            self.strangers += 1
            return
        self.deliveries.append(
            Delivery(consumer, parsed[0], parsed[1], at_ns, redelivery_count, message_id)
        )


@dataclass(frozen=True, slots=True)
class TrafficSummary:
    """The figures of :func:`summarize` (the module docstring)."""

    sent: int
    acknowledged: int
    failed: int
    pending: int
    lost: int
    duplicates: int
    reordered: int
    latency_p50_ms: float
    latency_p99_ms: float
    latency_p9999_ms: float
    latency_max_ms: float
    longest_gap_ms: float
    failures: tuple[str, ...] = ()
    """The distinct errors of the failed sends, with their counts."""
    lost_examples: tuple[str, ...] = ()
    stored_twice: int = 0
    """Duplicates under another storage id than the message's first delivery."""

    def line(self) -> str:
        """One line for a log or a terminal."""
        return (
            f"sent {self.sent}, acked {self.acknowledged}, failed {self.failed}, pending "
            f"{self.pending}, lost {self.lost}, duplicates {self.duplicates} ("
            f"{self.stored_twice} stored twice), reordered "
            f"{self.reordered}, send latency p50 {self.latency_p50_ms:.1f} ms p99 "
            f"{self.latency_p99_ms:.1f} ms max {self.latency_max_ms:.1f} ms, longest gap "
            f"{self.longest_gap_ms:.0f} ms"
        )


def summarize(
    record: TrafficRecord, *, since_ns: int = 0, until_ns: int | None = None
) -> TrafficSummary:
    """The figures of the sends made in ``[since_ns, until_ns)`` (all by default), and of every
    delivery of those messages. Loss is judged for acknowledged sends only."""
    until = math.inf if until_ns is None else until_ns
    latencies: list[int] = []
    failures: dict[str, int] = {}
    wanted: set[tuple[int, int]] = set()
    sent = acked = pending = 0
    for p, producer in enumerate(record.producers):
        for seq, send in enumerate(list(producer.sends)):
            if not since_ns <= send.sent_ns < until:
                continue
            sent += 1
            if send.ended_ns is None:
                pending += 1
            elif send.error is not None:
                failures[send.error] = failures.get(send.error, 0) + 1
            else:
                acked += 1
                latencies.append(send.ended_ns - send.sent_ns)
                wanted.add((p, seq))
    deliveries = list(record.deliveries)
    seen: dict[tuple[int, int], str] = {}
    duplicates = reordered = stored_twice = 0
    highest: dict[tuple[int, int], int] = {}
    first_at: dict[str, list[int]] = {}
    for d in deliveries:
        key = (d.producer, d.seq)
        if key in seen:
            counted = _in_window(record, d, since_ns, until)
            duplicates += counted
            stored_twice += counted and d.message_id != seen[key]
            continue
        seen[key] = d.message_id
        if not _in_window(record, d, since_ns, until):
            continue
        stream = (d.consumer, d.producer)
        if d.seq < highest.get(stream, -1):
            reordered += 1
        highest[stream] = max(highest.get(stream, -1), d.seq)
        first_at.setdefault(record.producers[d.producer].topic, []).append(d.at_ns)
    lost = sorted(wanted - seen.keys())
    latencies.sort()
    return TrafficSummary(
        sent=sent,
        acknowledged=acked,
        failed=sum(failures.values()),
        pending=pending,
        lost=len(lost),
        duplicates=duplicates,
        reordered=reordered,
        latency_p50_ms=_quantile(latencies, 0.5),
        latency_p99_ms=_quantile(latencies, 0.99),
        latency_p9999_ms=_quantile(latencies, 0.9999),
        latency_max_ms=latencies[-1] / 1e6 if latencies else 0.0,
        longest_gap_ms=_longest_gap(first_at.values()) / 1e6,
        failures=tuple(f"{n} x {error}" for error, n in sorted(failures.items())),
        lost_examples=tuple(
            f"{record.producers[p].topic} #{seq} (producer {p})" for p, seq in lost[:5]
        ),
        stored_twice=stored_twice,
    )


def _in_window(record: TrafficRecord, d: Delivery, since_ns: int, until: float) -> int:
    sends = record.producers[d.producer].sends
    return int(d.seq < len(sends) and since_ns <= sends[d.seq].sent_ns < until)


def _quantile(sorted_ns: Sequence[int], q: float) -> float:
    if not sorted_ns:
        return 0.0
    index = min(len(sorted_ns) - 1, math.ceil(q * len(sorted_ns)) - 1)
    return sorted_ns[max(index, 0)] / 1e6


def _longest_gap(per_topic: Iterable[list[int]]) -> int:
    longest = 0
    for times in per_topic:
        times.sort()
        for a, b in itertools.pairwise(times):
            longest = max(longest, b - a)
    return longest


def lost_sends(record: TrafficRecord) -> list[tuple[int, int]]:
    """Every acknowledged send no consumer received, as (producer, sequence), in order."""
    received = {(d.producer, d.seq) for d in list(record.deliveries)}
    return [
        (p, seq)
        for p, producer in enumerate(record.producers)
        for seq, send in enumerate(list(producer.sends))
        if send.ended_ns is not None and send.error is None and (p, seq) not in received
    ]
