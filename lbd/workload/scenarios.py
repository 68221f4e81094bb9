"""The standard scenarios of ``lbd bench balance``: each a cluster, its bundles, what happens.

Every scenario is built from a seed: bundle traffic is log-normal (a few heavy bundles, many light
ones, as in real tenants), brokers have a 1 Gbit/s NIC (125 MB/s each way) unless sized otherwise,
and the starting placement is balanced (each bundle, heaviest first, to the broker with the least
load for its size) unless the scenario is about a skewed start.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence

from lbd.core.bundles import NamespaceBundles
from lbd.core.ids import BrokerId, BundleId
from lbd.core.names import NamespaceName
from lbd.core.settings import MB
from lbd.workload.balance import BalanceScenario, Event

NIC_MB = 125.0
"""Network capacity of a standard broker, MB/s each way."""


def _brokers(count: int, first: int = 1, capacity: float = NIC_MB) -> dict[BrokerId, float]:
    return {BrokerId(f"broker-{i}"): capacity for i in range(first, first + count)}


def _bundles(
    namespaces: int, per_namespace: int, rng: random.Random
) -> tuple[list[NamespaceName], list[BundleId], list[float]]:
    names = [NamespaceName("tenant", f"ns-{i}") for i in range(namespaces)]
    bundles = [b.id for ns in names for b in NamespaceBundles.default(ns, per_namespace).bundles()]
    weights = [rng.lognormvariate(0.0, 0.8) for _ in bundles]
    return names, bundles, weights


def _traffic(
    bundles: Sequence[BundleId], weights: Sequence[float], total_bytes: float
) -> dict[BundleId, float]:
    scale = total_bytes / math.fsum(weights)
    return {b: w * scale for b, w in zip(bundles, weights, strict=True)}


def _balanced(
    traffic: Mapping[BundleId, float], capacity: Mapping[BrokerId, float]
) -> dict[BundleId, BrokerId]:
    """Heaviest bundle first, each to the broker with the least load for its size."""
    carried = dict.fromkeys(capacity, 0.0)
    placement: dict[BundleId, BrokerId] = {}
    for bundle in sorted(traffic, key=lambda b: (-traffic[b], b)):
        broker = min(carried, key=lambda b: (carried[b] / capacity[b], b))
        placement[bundle] = broker
        carried[broker] += traffic[bundle]
    return placement


def _total(capacity: Mapping[BrokerId, float], utilisation: float) -> float:
    """Traffic (in plus out, bytes/s) loading ``capacity`` to ``utilisation``."""
    return 2 * utilisation * math.fsum(capacity.values()) * MB


def _workload(
    seed: int,
    capacity: Mapping[BrokerId, float],
    utilisation: float,
    namespaces: int = 10,
    per_namespace: int = 16,
) -> tuple[list[NamespaceName], dict[BundleId, float]]:
    """The namespaces, and each bundle's traffic loading ``capacity`` to ``utilisation``."""
    names, bundles, weights = _bundles(namespaces, per_namespace, random.Random(seed))
    return names, _traffic(bundles, weights, _total(capacity, utilisation))


def scale_up(seed: int) -> BalanceScenario:
    """5 brokers at 70% load; 5 more join."""
    first = _brokers(5)
    _, traffic = _workload(seed, first, 0.7)
    return BalanceScenario(
        name="scale-up 5→10",
        description="5 brokers at 70% load, 5 empty brokers join at cycle 1",
        brokers=first,
        traffic=traffic,
        placement=_balanced(traffic, first),
        cycles=90,
        events=(Event(at=1, join=_brokers(5, first=6)),),
    )


def scale_down(seed: int) -> BalanceScenario:
    """10 brokers at 35% load; 5 leave."""
    brokers = _brokers(10)
    _, traffic = _workload(seed, brokers, 0.35)
    leaving = tuple(BrokerId(f"broker-{i}") for i in range(6, 11))
    return BalanceScenario(
        name="scale-down 10→5",
        description="10 brokers at 35% load, 5 leave at cycle 1; their bundles are re-placed",
        brokers=brokers,
        traffic=traffic,
        placement=_balanced(traffic, brokers),
        cycles=90,
        events=(Event(at=1, leave=leaving),),
    )


def hot_namespace(seed: int) -> BalanceScenario:
    """One namespace's traffic grows 8 times."""
    brokers = _brokers(10)
    names, traffic = _workload(seed, brokers, 0.25)
    return BalanceScenario(
        name="hot namespace 8x",
        description="10 brokers at 25% load; one namespace's traffic grows 8x at cycle 1",
        brokers=brokers,
        traffic=traffic,
        placement=_balanced(traffic, brokers),
        cycles=90,
        events=(Event(at=1, traffic={names[0]: 8.0}),),
    )


def diurnal(seed: int) -> BalanceScenario:
    """A day: the traffic of each namespace swings ±80% around its mean; half the namespaces peak
    twelve hours after the other half (tenants on two continents)."""
    brokers = _brokers(10)
    names, traffic = _workload(seed, brokers, 0.4, per_namespace=8)
    phases = {ns: (i % 2) * math.pi for i, ns in enumerate(names)}

    def swing(namespace: NamespaceName, elapsed_s: int) -> float:
        return 1.0 + 0.8 * math.sin(2 * math.pi * elapsed_s / 86_400 + phases[namespace])

    return BalanceScenario(
        name="diurnal swing",
        description="10 brokers at 40% mean load for 24 h, traffic ±80%; "
        "half the namespaces peak 12 h after the other half",
        brokers=brokers,
        traffic=traffic,
        placement=_balanced(traffic, brokers),
        cycles=24 * 60,
        seasonal=swing,
    )


def large_skew(seed: int) -> BalanceScenario:
    """100 brokers, 20 of them carrying three times the others' load."""
    brokers = _brokers(100)
    _, traffic = _workload(seed, brokers, 0.4, namespaces=100, per_namespace=20)
    # A skewed start: the first 20 brokers count as a third of their size when placing.
    skewed = {b: c / 3 if i < 20 else c for i, (b, c) in enumerate(brokers.items())}
    return BalanceScenario(
        name="100 brokers, skewed",
        description="100 brokers at 40% mean load; 20 start with 3x the others' load",
        brokers=brokers,
        traffic=traffic,
        placement=_balanced(traffic, skewed),
        cycles=120,
        disturbed_at_start=True,
    )


def three_sizes(seed: int) -> BalanceScenario:
    """Brokers of three sizes, the bundles spread by traffic as if they were equal."""
    brokers = {
        **_brokers(3, first=1, capacity=NIC_MB / 2),
        **_brokers(3, first=4, capacity=NIC_MB),
        **_brokers(3, first=7, capacity=NIC_MB * 2),
    }
    _, traffic = _workload(seed, brokers, 0.4, namespaces=9)
    return BalanceScenario(
        name="three broker sizes",
        description="3 brokers each of 62.5, 125 and 250 MB/s at 40% mean load, placed as if equal",
        brokers=brokers,
        traffic=traffic,
        placement=_balanced(traffic, dict.fromkeys(brokers, NIC_MB)),
        cycles=90,
        disturbed_at_start=True,
    )


def churn(seed: int) -> BalanceScenario:
    """Two brokers leave and come back, one after the other."""
    brokers = _brokers(10)
    _, traffic = _workload(seed, brokers, 0.4)
    b3, b7 = BrokerId("broker-3"), BrokerId("broker-7")
    return BalanceScenario(
        name="broker churn",
        description="10 brokers at 40% load; broker-3 leaves at 10, back at 40; "
        "broker-7 leaves at 70, back at 100",
        brokers=brokers,
        traffic=traffic,
        placement=_balanced(traffic, brokers),
        cycles=150,
        events=(
            Event(at=10, leave=(b3,)),
            Event(at=40, join={b3: NIC_MB}),
            Event(at=70, leave=(b7,)),
            Event(at=100, join={b7: NIC_MB}),
        ),
    )


SCENARIOS: Mapping[str, Callable[[int], BalanceScenario]] = {
    "scale-up": scale_up,
    "scale-down": scale_down,
    "hot-namespace": hot_namespace,
    "diurnal": diurnal,
    "large-skew": large_skew,
    "three-sizes": three_sizes,
    "churn": churn,
}
"""The suite, by the name ``lbd bench balance --scenario`` takes."""
