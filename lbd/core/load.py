"""Broker load: resource usage, the weighted max, and its exponential moving average.

Mirrors Pulsar's ``BrokerLoadData``: a broker's load is the largest of its resource usages, each
multiplied by a weight, divided by 100; it is smoothed with ``ema = h * old + (1 - h) * new``
(``h`` = the history percentage, 0.9), the first sample taken as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId

HISTORY_PERCENTAGE = 0.9
"""Weight of the previous EMA value (Pulsar's ``loadBalancerHistoryResourcePercentage``)."""


@dataclass(frozen=True, slots=True)
class ResourceUsage:
    """One resource's usage and limit, in the same unit (percent, MB, Mbit/s...)."""

    usage: float = 0.0
    limit: float = 0.0

    def percent(self) -> float:
        """Usage as a percentage of the limit; 0 when the limit is unknown (<= 0)."""
        return 100.0 * self.usage / self.limit if self.limit > 0 else 0.0


@dataclass(frozen=True, slots=True)
class ResourceWeights:
    """Weights of each resource in the broker load (Pulsar ``loadBalancer*ResourceWeight``)."""

    cpu: float = 1.0
    memory: float = 1.0
    direct_memory: float = 1.0
    bandwidth_in: float = 1.0
    bandwidth_out: float = 1.0

    def __post_init__(self) -> None:
        for name in ("cpu", "memory", "direct_memory", "bandwidth_in", "bandwidth_out"):
            if getattr(self, name) < 0:
                raise InvalidInputError(f"resource weight {name} must be >= 0")


@dataclass(frozen=True, slots=True)
class BrokerUsage:
    """A raw load report of one broker (what the broker or the host measured)."""

    cpu: ResourceUsage = ResourceUsage()
    memory: ResourceUsage = ResourceUsage()
    direct_memory: ResourceUsage = ResourceUsage()
    bandwidth_in: ResourceUsage = ResourceUsage()
    bandwidth_out: ResourceUsage = ResourceUsage()
    msg_throughput_in: float = 0.0
    msg_throughput_out: float = 0.0
    msg_rate_in: float = 0.0
    msg_rate_out: float = 0.0
    bundle_count: int = 0
    topics: int = 0


def max_resource_usage(u: BrokerUsage) -> float:
    """The largest unweighted resource usage as a fraction (Pulsar ``maxResourceUsage``)."""
    return (
        max(
            u.cpu.percent(),
            u.memory.percent(),
            u.direct_memory.percent(),
            u.bandwidth_in.percent(),
            u.bandwidth_out.percent(),
        )
        / 100.0
    )


def weighted_max_usage(u: BrokerUsage, w: ResourceWeights) -> float:
    """``max(cpu%·w, mem%·w, direct_mem%·w, bw_in%·w, bw_out%·w) / 100``."""
    return (
        max(
            u.cpu.percent() * w.cpu,
            u.memory.percent() * w.memory,
            u.direct_memory.percent() * w.direct_memory,
            u.bandwidth_in.percent() * w.bandwidth_in,
            u.bandwidth_out.percent() * w.bandwidth_out,
        )
        / 100.0
    )


def ema(old: float | None, new: float, history: float = HISTORY_PERCENTAGE) -> float:
    """Exponential moving average; the first sample (``old is None``) is taken as is."""
    return new if old is None else history * old + (1.0 - history) * new


@dataclass(frozen=True, slots=True)
class BrokerLoadData:
    """What a sidecar publishes on the broker-load topic, keyed by broker id."""

    broker: BrokerId
    usage: BrokerUsage = field(default_factory=BrokerUsage)
    max_resource_usage: float = 0.0
    weighted_max_ema: float = 0.0
    msg_throughput_ema: float = 0.0
    updated_at_ms: int = 0
    reported_at_ms: int = 0

    @property
    def msg_throughput(self) -> float:
        """Bytes/s in plus out of the latest sample."""
        return self.usage.msg_throughput_in + self.usage.msg_throughput_out

    def update(self, usage: BrokerUsage, weights: ResourceWeights, now_ms: int) -> BrokerLoadData:
        """A new value with ``usage`` folded into the EMAs (first sample when never updated)."""
        first = self.updated_at_ms == 0
        throughput = usage.msg_throughput_in + usage.msg_throughput_out
        return replace(
            self,
            usage=usage,
            max_resource_usage=max_resource_usage(usage),
            weighted_max_ema=ema(
                None if first else self.weighted_max_ema, weighted_max_usage(usage, weights)
            ),
            msg_throughput_ema=ema(None if first else self.msg_throughput_ema, throughput),
            updated_at_ms=now_ms,
        )


@dataclass(frozen=True, slots=True)
class BundleLoad:
    """Load of one bundle, as reported in a broker's top-bundles data."""

    bundle: BundleId
    msg_throughput_in: float = 0.0
    msg_throughput_out: float = 0.0
    msg_rate_in: float = 0.0
    msg_rate_out: float = 0.0
    topics: int = 0
    consumer_count: int = 0
    producer_count: int = 0

    @property
    def msg_throughput(self) -> float:
        """Bytes/s in plus out."""
        return self.msg_throughput_in + self.msg_throughput_out

    @property
    def msg_rate(self) -> float:
        """Messages/s in plus out."""
        return self.msg_rate_in + self.msg_rate_out

    @property
    def sessions(self) -> int:
        """Producers plus consumers (Pulsar's split ``sessions`` threshold)."""
        return self.consumer_count + self.producer_count
