"""Broker load: resource usage, the weighted max, and its exponential moving average.

Mirrors the extensible load manager's ``BrokerLoadData``: a broker's load is the largest of its
resource usages (cpu, memory, direct memory, bandwidth in and out), each multiplied by a weight,
divided by 100; it is smoothed with ``ema = h * old + (1 - h) * new`` (``h`` = the history
percentage, 0.9), the first sample taken as is. The unweighted max usage, reported beside it,
leaves memory out, as Pulsar's does (a JVM heap's usage swings with garbage collection more than
with load).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from lbd.core.audit import AuditData
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
    """The largest unweighted usage of cpu, direct memory and bandwidth, as a fraction; memory is
    left out (Pulsar ``BrokerLoadData.maxResourceUsage``)."""
    return (
        max(
            u.cpu.percent(),
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
    audit: AuditData | None = None
    """The sidecar's table position and digest and its dead-owner lookups, for the leader's
    safety auditor (None: not reported, as by an older sidecar)."""

    @property
    def msg_throughput(self) -> float:
        """Bytes/s in plus out of the latest sample."""
        return self.usage.msg_throughput_in + self.usage.msg_throughput_out

    def update(
        self,
        usage: BrokerUsage,
        weights: ResourceWeights,
        now_ms: int,
        *,
        history: float = HISTORY_PERCENTAGE,
    ) -> BrokerLoadData:
        """A new value with ``usage`` folded into the EMAs (first sample when never updated);
        ``history`` is the weight of the previous EMA values."""
        first = self.updated_at_ms == 0
        throughput = usage.msg_throughput_in + usage.msg_throughput_out
        weighted = weighted_max_usage(usage, weights)
        return replace(
            self,
            usage=usage,
            max_resource_usage=max_resource_usage(usage),
            weighted_max_ema=ema(None if first else self.weighted_max_ema, weighted, history),
            msg_throughput_ema=ema(None if first else self.msg_throughput_ema, throughput, history),
            updated_at_ms=now_ms,
        )

    def to_json(self) -> bytes:
        """The value published on the broker-load topic (every field present)."""
        return _dump(
            {
                "broker": self.broker,
                "usage": _usage_to_dict(self.usage),
                "max_resource_usage": self.max_resource_usage,
                "weighted_max_ema": self.weighted_max_ema,
                "msg_throughput_ema": self.msg_throughput_ema,
                "updated_at_ms": self.updated_at_ms,
                "reported_at_ms": self.reported_at_ms,
                **({} if self.audit is None else {"audit": self.audit.to_json_object()}),
            }
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> BrokerLoadData:
        """Read a published value; InvalidInputError naming the field that is wrong.

        ``broker`` is required; absent numbers read as 0, an absent ``audit`` as None (unknown),
        unknown fields are ignored.
        """
        obj = _load(raw, "broker load data")
        audit = obj.get("audit")
        return cls(
            broker=_broker(obj, "broker load data"),
            usage=_usage_from_dict(obj.get("usage", {}), "broker load data.usage"),
            max_resource_usage=_number(obj, "max_resource_usage", "broker load data"),
            weighted_max_ema=_number(obj, "weighted_max_ema", "broker load data"),
            msg_throughput_ema=_number(obj, "msg_throughput_ema", "broker load data"),
            updated_at_ms=_count(obj, "updated_at_ms", "broker load data"),
            reported_at_ms=_count(obj, "reported_at_ms", "broker load data"),
            audit=None
            if audit is None
            else AuditData.from_json_object(audit, "broker load data.audit"),
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


def top_bundles(bundles: Iterable[BundleLoad], count: int) -> tuple[BundleLoad, ...]:
    """The ``count`` busiest bundles (by throughput in + out), busiest first."""
    return tuple(sorted(bundles, key=lambda b: (-b.msg_throughput, b.bundle))[:count])


@dataclass(frozen=True, slots=True)
class TopBundlesLoadData:
    """What a sidecar publishes on the top-bundles topic: its broker's busiest bundles."""

    broker: BrokerId
    bundles: tuple[BundleLoad, ...] = ()

    def to_json(self) -> bytes:
        """The published value."""
        return _dump(
            {
                "broker": self.broker,
                "bundles": [
                    {f.name: getattr(b, f.name) for f in fields(BundleLoad)} for b in self.bundles
                ],
            }
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> TopBundlesLoadData:
        """Read a published value; InvalidInputError naming the field that is wrong."""
        obj = _load(raw, "top bundles load data")
        items = obj.get("bundles", [])
        if not isinstance(items, list):
            raise InvalidInputError(f"top bundles load data: bundles must be a list, got {items!r}")
        return cls(
            broker=_broker(obj, "top bundles load data"),
            bundles=tuple(
                _bundle_load_from_dict(item, f"top bundles load data.bundles[{i}]")
                for i, item in enumerate(items)
            ),
        )


# --- JSON helpers of the codecs above --------------------------------------------------------

_RESOURCES = ("cpu", "memory", "direct_memory", "bandwidth_in", "bandwidth_out")


def _dump(obj: Mapping[str, object]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _load(raw: bytes | str, what: str) -> Mapping[str, Any]:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidInputError(f"{what} is not valid JSON: {e}") from None
    return _object(obj, what)


def _object(obj: object, what: str) -> Mapping[str, Any]:
    if not isinstance(obj, dict):
        raise InvalidInputError(f"{what} must be a JSON object, got {obj!r}")
    return obj


def _broker(obj: Mapping[str, Any], what: str) -> BrokerId:
    broker = obj.get("broker")
    if not isinstance(broker, str) or not broker.strip():
        raise InvalidInputError(f"{what}: broker must be a non-blank string, got {broker!r}")
    return BrokerId(broker)


def _number(obj: Mapping[str, Any], name: str, what: str) -> float:
    value = obj.get(name, 0.0)
    if value is None:
        return 0.0
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidInputError(f"{what}: {name} must be a number, got {value!r}")
    return float(value)


def _count(obj: Mapping[str, Any], name: str, what: str) -> int:
    value = obj.get(name, 0)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInputError(f"{what}: {name} must be an integer >= 0, got {value!r}")
    return value


def _usage_to_dict(u: BrokerUsage) -> dict[str, object]:
    out: dict[str, object] = {}
    for f in fields(BrokerUsage):
        value = getattr(u, f.name)
        out[f.name] = (
            {"usage": value.usage, "limit": value.limit}
            if isinstance(value, ResourceUsage)
            else value
        )
    return out


def _usage_from_dict(obj: object, what: str) -> BrokerUsage:
    data = _object(obj, what)
    resources = {name: _resource(data.get(name, {}), f"{what}.{name}") for name in _RESOURCES}
    return BrokerUsage(
        **resources,
        msg_throughput_in=_number(data, "msg_throughput_in", what),
        msg_throughput_out=_number(data, "msg_throughput_out", what),
        msg_rate_in=_number(data, "msg_rate_in", what),
        msg_rate_out=_number(data, "msg_rate_out", what),
        bundle_count=_count(data, "bundle_count", what),
        topics=_count(data, "topics", what),
    )


def _resource(obj: object, what: str) -> ResourceUsage:
    data = _object(obj, what)
    return ResourceUsage(usage=_number(data, "usage", what), limit=_number(data, "limit", what))


def _bundle_load_from_dict(obj: object, what: str) -> BundleLoad:
    data = _object(obj, what)
    bundle = data.get("bundle")
    if not isinstance(bundle, str) or not bundle.strip():
        raise InvalidInputError(f"{what}: bundle must be a non-blank string, got {bundle!r}")
    return BundleLoad(
        bundle=BundleId(bundle),
        msg_throughput_in=_number(data, "msg_throughput_in", what),
        msg_throughput_out=_number(data, "msg_throughput_out", what),
        msg_rate_in=_number(data, "msg_rate_in", what),
        msg_rate_out=_number(data, "msg_rate_out", what),
        topics=_count(data, "topics", what),
        consumer_count=_count(data, "consumer_count", what),
        producer_count=_count(data, "producer_count", what),
    )
