"""Load reports from what clients really do: rates between two reports, per served bundle."""

from __future__ import annotations

from lbd.core.bundles import NamespaceBundles
from lbd.core.names import NamespaceName
from lbd.front.served import ServedBundles, Topic
from lbd.front.traffic import TrafficBook, bundle_stats

LAYOUT = NamespaceBundles.default(NamespaceName.parse("t/n"), 2)
LOW, HIGH = (b.id for b in LAYOUT.bundles())


def topic_in(bundle: str, start: int = 0) -> Topic:
    for i in range(start, 10_000):
        topic = Topic.parse(f"persistent://t/n/x{i}")
        if LAYOUT.find(topic.name).id == bundle:
            return topic
    raise AssertionError(bundle)


def test_rates_are_what_happened_between_two_reports() -> None:
    now = [0.0]
    book = TrafficBook(clock=lambda: now[0])
    t = book.of(topic_in(LOW))
    book.rates()  # the first report
    now[0] = 2.0
    t.sent(10, 1000)
    t.delivered(500)
    (rates,) = book.rates().values()
    assert (rates.msg_rate_in, rates.throughput_in) == (5.0, 500.0)
    assert (rates.msg_rate_out, rates.throughput_out) == (0.5, 250.0)
    now[0] = 4.0
    (rates,) = book.rates().values()
    assert rates.msg_rate == 0.0  # nothing since


def test_a_bundle_reports_its_busy_topics_and_the_handles_on_them() -> None:
    now = [0.0]
    book = TrafficBook(clock=lambda: now[0])
    busy, idle, elsewhere = topic_in(LOW), topic_in(LOW, 1_000), topic_in(HIGH)
    served = ServedBundles()
    served.add(LOW)
    book.of(busy).producers = 1
    book.of(busy).consumers = 2
    book.of(idle)  # counted once, idle since: left out of the report
    book.of(elsewhere).sent(100, 100)
    book.rates()
    now[0] = 1.0
    book.of(busy).sent(40, 4000)
    (stats,) = bundle_stats(served, book.topics(), book.rates())
    assert stats.bundle == LOW
    assert (stats.msg_rate_in, stats.msg_throughput_in) == (40.0, 4000.0)
    assert (stats.topics, stats.producer_count, stats.consumer_count) == (1, 1, 2)
    assert [t.topic for t in stats.topic_stats] == [busy.name]
