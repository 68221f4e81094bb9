"""Synthetic demand: what clients ask of a cluster over time, with no balancer at work.

A scenario yields :class:`~lbd.analytics.engine.TraceStep` values: each bundle's traffic, the
brokers that are up, and a static layout (bundles stay where they were first placed; a broker's
bundles are scattered at random when it leaves; a joining broker starts empty). ``synth`` runs the
default shedding strategy over this demand to produce a history with decisions in it.

Every broker has a 1 Gbit/s NIC (125 MB/s each way) and its load is its inbound bandwidth share,
as in :mod:`lbd.workload.demo`. Traffic is each bundle's lognormal base rate, times a diurnal
curve whose phase differs by namespace (tenants in different time zones), times a small
per-sample noise. Scenarios add:

- ``diurnal``: only the above;
- ``burst``: hot-topic bursts: a random bundle's traffic grows 5-10x for 15-60 minutes, about
  every two hours;
- ``scale-up``: half the brokers (5 of 10) carry the traffic until a quarter of the run, when the
  other half joins;
- ``churn``: about every 90 minutes a broker leaves for 10-40 minutes and comes back empty.

Deterministic for a given seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

from lbd.analytics.engine import BrokerSample, BundleSample, TraceStep
from lbd.core.bundles import NamespaceBundles
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.names import NamespaceName
from lbd.core.settings import MB

BROKER_CAPACITY = 125.0 * MB
"""Bytes/s each way of one broker's NIC."""
START_MS = 1_714_521_600_000
"""2024-05-01T00:00:00Z, the start of every synthetic history."""
HOUR_MS = 3_600_000


class ScenarioName(StrEnum):
    """The scenarios of ``lbd analytics synth --scenario``."""

    DIURNAL = "diurnal"
    BURST = "burst"
    SCALE_UP = "scale-up"
    CHURN = "churn"


@dataclass(frozen=True, slots=True)
class SynthSpec:
    """One synthetic cluster history to generate."""

    scenario: ScenarioName = ScenarioName.DIURNAL
    brokers: int = 10
    """Brokers at full size (scale-up starts with half of them)."""
    hours: float = 24.0
    step_s: int = 60
    """Seconds between two load reports (and two shedder runs)."""
    bundles_per_broker: int = 8
    namespaces: int = 4
    utilisation: float = 0.45
    """Mean load of the full cluster at the diurnal peak."""
    seed: int = 1

    def __post_init__(self) -> None:
        problems = []
        if self.brokers < 2:
            problems.append(f"brokers must be >= 2, got {self.brokers}")
        if self.hours <= 0:
            problems.append(f"hours must be > 0, got {self.hours:g}")
        if self.step_s < 1:
            problems.append(f"step must be >= 1 s, got {self.step_s}")
        if self.bundles_per_broker < 1:
            problems.append(f"bundles per broker must be >= 1, got {self.bundles_per_broker}")
        if self.namespaces < 1:
            problems.append(f"namespaces must be >= 1, got {self.namespaces}")
        if not 0 < self.utilisation < 2:
            problems.append(f"utilisation must be in (0, 2), got {self.utilisation:g}")
        if problems:
            raise InvalidInputError("; ".join(problems))

    @property
    def steps(self) -> int:
        """Samples per broker in the history."""
        return max(1, int(self.hours * 3600 // self.step_s))


@dataclass(slots=True)
class _Burst:
    bundle: BundleId
    factor: float
    until_ms: int


def demand(spec: SynthSpec, seed: int | None = None) -> Iterator[TraceStep]:
    """The demand of ``spec`` step by step (``seed`` overrides ``spec.seed``)."""
    rng = random.Random(spec.seed if seed is None else seed)
    everyone = [BrokerId(f"broker-{i + 1}") for i in range(spec.brokers)]
    initial = spec.brokers // 2 if spec.scenario is ScenarioName.SCALE_UP else spec.brokers
    up = list(everyone[:initial])
    per_ns = max(1, spec.brokers * spec.bundles_per_broker // spec.namespaces)
    bundles: list[BundleId] = []
    namespace_of: dict[BundleId, int] = {}
    for j in range(spec.namespaces):
        ns = NamespaceName("synthetic", f"ns-{j}")
        for nb in NamespaceBundles.default(ns, per_ns).bundles():
            bundles.append(nb.id)
            namespace_of[nb.id] = j
    weights = [rng.lognormvariate(0.0, 0.8) for _ in bundles]
    # Sized so that the full cluster's mean load at the diurnal peak is ``utilisation``.
    total_in = spec.utilisation * spec.brokers * BROKER_CAPACITY
    base = {b: total_in * w / sum(weights) for b, w in zip(bundles, weights, strict=True)}
    owner = {b: rng.choice(up) for b in bundles}
    phases = [24.0 * j / (2 * spec.namespaces) for j in range(spec.namespaces)]
    bursts: list[_Burst] = []
    away: dict[BrokerId, int] = {}
    join_at = START_MS + int(spec.hours * HOUR_MS / 4)

    for step in range(spec.steps):
        now = START_MS + step * spec.step_s * 1000
        per_hour = spec.step_s / 3600
        if spec.scenario is ScenarioName.SCALE_UP and len(up) < spec.brokers and now >= join_at:
            up = list(everyone)
        if spec.scenario is ScenarioName.BURST and rng.random() < per_hour / 2:
            bursts.append(
                _Burst(rng.choice(bundles), rng.uniform(5, 10), now + rng.randint(15, 60) * 60_000)
            )
        if spec.scenario is ScenarioName.CHURN:
            for broker in [b for b, back in away.items() if back <= now]:
                del away[broker]
                up.append(broker)
            if len(up) > 2 and rng.random() < per_hour / 1.5:
                leaving = rng.choice(up)
                up.remove(leaving)
                away[leaving] = now + rng.randint(10, 40) * 60_000
                for b in [b for b, o in owner.items() if o == leaving]:
                    owner[b] = rng.choice(up)
        bursts = [x for x in bursts if x.until_ms > now]
        hot = {x.bundle: x.factor for x in bursts}
        hour = (now - START_MS) / HOUR_MS
        traffic: dict[BundleId, BundleSample] = {}
        inbound = {b: 0.0 for b in up}
        for b in bundles:
            curve = 0.6 + 0.4 * math.sin(2 * math.pi * (hour - 8 - phases[namespace_of[b]]) / 24)
            bytes_in = base[b] * curve * hot.get(b, 1.0) * rng.lognormvariate(0.0, 0.05)
            traffic[b] = BundleSample(owner[b], bytes_in, bytes_in)
            inbound[owner[b]] += bytes_in
        brokers = {
            b: BrokerSample(max_usage=inbound[b] / BROKER_CAPACITY, throughput=2 * inbound[b])
            for b in sorted(up)
        }
        yield TraceStep(now, brokers, traffic)
