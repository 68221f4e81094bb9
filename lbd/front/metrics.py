"""The broker front's Prometheus metrics, in a registry of its own (``lbd_front_*``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

HANDOVER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Seconds from a Release to the clients being sent to the new owner."""


class FrontMetrics:
    """Every family the front writes; ``registry`` is what /metrics serves."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.lookups = Counter(
            "lbd_front_lookups",
            "LOOKUP commands answered, by answer (connect, redirect, failed) and whether the "
            "client marked it authoritative (it follows a redirect then)",
            ["answer", "authoritative"],
            registry=r,
        )
        self.connections = Counter(
            "lbd_front_connections", "Client connections accepted", registry=r
        )
        self.open_connections = Gauge(
            "lbd_front_open_connections", "Client connections open now", registry=r
        )
        self.rejected_connections = Counter(
            "lbd_front_rejected_connections",
            "Client connections closed on arrival, by reason (limit, limit_per_peer)",
            ["reason"],
            registry=r,
        )
        self.bad_frames = Counter(
            "lbd_front_bad_frames",
            "Connections that sent something a Pulsar client does not, by reason",
            ["reason"],
            registry=r,
        )
        self.refusals = Counter(
            "lbd_front_refusals",
            "PRODUCER or SUBSCRIBE refused with ServiceNotReady: the topic is not served here now",
            ["kind"],
            registry=r,
        )
        self.handles = Gauge(
            "lbd_front_handles", "Producers and consumers registered now", ["kind"], registry=r
        )
        self.closes = Counter(
            "lbd_front_closes",
            "Producers and consumers the front closed, by where their client was sent "
            "(redirect: to the new owner, lookup: to look the topic up again)",
            ["kind", "to"],
            registry=r,
        )
        self.repeats = Counter(
            "lbd_front_repeats_dropped",
            "Entries storage delivered again, in order, to a consumer of an Exclusive or "
            "Failover subscription, dropped (a pulsar-lite catching up repeats entries)",
            registry=r,
        )
        self.handover = Histogram(
            "lbd_front_handover_seconds",
            "From a Release to a new owner until the clients were sent there",
            buckets=HANDOVER_BUCKETS,
            registry=r,
        )

    def count_traffic(self, totals: Callable[[], tuple[int, int, int, int]]) -> None:
        """Serve the traffic counters the front keeps anyway (messages in, bytes in, messages
        out, bytes out), read at each scrape rather than counted twice per message."""
        self.registry.register(_Traffic(totals))


class _Traffic(Collector):
    def __init__(self, totals: Callable[[], tuple[int, int, int, int]]) -> None:
        self._totals = totals

    def collect(self) -> Iterator[CounterMetricFamily]:
        m_in, b_in, m_out, b_out = self._totals()
        messages = CounterMetricFamily(
            "lbd_front_messages",
            "Messages written to storage (in) and entries delivered to consumers (out)",
            labels=["direction"],
        )
        messages.add_metric(["in"], m_in)
        messages.add_metric(["out"], m_out)
        size = CounterMetricFamily(
            "lbd_front_bytes",
            "Payload bytes written to storage (in) and delivered (out)",
            labels=["direction"],
        )
        size.add_metric(["in"], b_in)
        size.add_metric(["out"], b_out)
        yield messages
        yield size
