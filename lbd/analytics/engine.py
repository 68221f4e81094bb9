"""Trace-driven cluster simulation: a load trace replayed under a shedding strategy of the core.

A :class:`Trace` is what a history says happened, step by step: which brokers were up, their raw
load and throughput, and every reported bundle's throughput and owner. :func:`simulate` replays
it under any strategy and settings. Bundle traffic and broker membership come from the trace;
ownership is the simulation's own: it starts as recorded, then changes only by the strategy's
decisions (a bundle whose simulated owner left, or that first appears, goes where the trace put
it). A broker's simulated raw load is its recorded load plus the traffic of the bundles the
simulation placed differently, converted to load with the cluster's load-per-byte ratio of that
step; the shedder sees the EMA of that load, as the real leader sees the reporters' EMAs.

Plain unloads (``threshold_shedder``) are placed as the next lookup would place them, with the
core's ``least_resource_usage_with_weight``. The synthetic histories of ``lbd analytics synth``
are this simulation run with the default strategy over a generated demand trace.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from lbd.core.assign import least_resource_usage_with_weight
from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData, BrokerUsage, BundleLoad, ResourceUsage, ema
from lbd.core.shedding import STRATEGIES, LoadSnapshot, ShedderState, mean_and_std
from lbd.core.tuning import AssignmentConfig, SheddingConfig
from lbd.history.schema import DecisionKind

_K = TypeVar("_K")

MESSAGE_SIZE = 1024
"""Bytes per message, to derive message rates from throughput (the trace records bytes only).
The simulated load is bandwidth-bound: its usage is reported as bandwidth, with CPU at 80% of it."""


@dataclass(frozen=True, slots=True)
class BrokerSample:
    """A broker's recorded raw load (max usage, 0..1+) and throughput (bytes/s in + out)."""

    max_usage: float
    throughput: float


@dataclass(frozen=True, slots=True)
class BundleSample:
    """A bundle's recorded owner and throughput (bytes/s)."""

    owner: BrokerId
    throughput_in: float
    throughput_out: float

    @property
    def throughput(self) -> float:
        """Bytes/s in plus out."""
        return self.throughput_in + self.throughput_out


@dataclass(frozen=True, slots=True)
class TraceStep:
    """One instant of a trace: the brokers that reported and the bundles they reported."""

    ts_ms: int
    brokers: Mapping[BrokerId, BrokerSample]
    bundles: Mapping[BundleId, BundleSample]

    def __post_init__(self) -> None:
        for bundle, sample in self.bundles.items():
            if sample.owner not in self.brokers:
                raise ValueError(
                    f"step {self.ts_ms}: bundle {bundle} is owned by {sample.owner}, "
                    "which reported no load at this step"
                )


@dataclass(frozen=True, slots=True)
class Trace:
    """A cluster's load over time, as recorded or generated."""

    name: str
    cluster: str
    steps: tuple[TraceStep, ...]


@dataclass(frozen=True, slots=True)
class Decision:
    """A decision of the simulation, with the load statistics it was made on."""

    ts_ms: int
    kind: DecisionKind
    bundle: BundleId
    src: BrokerId | None
    dst: BrokerId | None
    reason: str
    strategy: str | None
    cluster_avg: float
    cluster_std: float
    src_load: float | None
    dst_load: float | None
    bundle_throughput: float | None


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """The simulated cluster at one step, before that step's decisions take effect."""

    ts_ms: int
    loads: Mapping[BrokerId, BrokerLoadData]
    owners: Mapping[BundleId, BrokerId]
    """Simulated owner of every bundle reported at this step."""
    bundles: Mapping[BundleId, BundleSample]
    """The step's bundle samples (their ``owner`` is the trace's, not the simulation's)."""
    avg: float
    std: float
    """Mean and population std of the brokers' load EMAs."""
    decisions: tuple[Decision, ...]


@dataclass(slots=True)
class _State:
    owners: dict[BundleId, BrokerId] = field(default_factory=dict)
    loads: dict[BrokerId, BrokerLoadData] = field(default_factory=dict)
    shedder: ShedderState = field(default_factory=ShedderState)
    unloaded_bundles: dict[BundleId, int] = field(default_factory=dict)
    unloaded_brokers: dict[BrokerId, int] = field(default_factory=dict)


def simulate(
    steps: Iterable[TraceStep],
    strategy: str,
    config: SheddingConfig,
    *,
    seed: int = 1,
    shed_every: int = 1,
) -> Iterator[StepOutcome]:
    """Replay ``steps`` (a :class:`Trace`'s, or a generator's) under ``strategy`` with
    ``config``; the shedder runs every ``shed_every`` steps. Deterministic for a given ``seed``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    shed = STRATEGIES[strategy]
    rng = random.Random(seed)
    st = _State()
    assignment = AssignmentConfig()
    for index, step in enumerate(steps):
        now = step.ts_ms
        decisions = _place_bundles(st, step)
        _update_loads(st, step)
        alive = {b: st.loads[b] for b in step.brokers}
        avg, std = mean_and_std(d.weighted_max_ema for d in alive.values())
        decisions = [
            Decision(
                now,
                d.kind,
                d.bundle,
                d.src,
                d.dst,
                d.reason,
                None,
                avg,
                std,
                None,
                _load(alive, d.dst),
                d.bundle_throughput,
            )
            for d in decisions
        ]
        if alive and index % shed_every == 0:
            snapshot = _snapshot(st, step, config, now)
            result, st.shedder = shed(snapshot, config, st.shedder, now, rng)
            throughput = {b: s.throughput for b, s in step.bundles.items()}
            for d in result.decisions:
                dst = d.dst
                if dst is None:
                    dst = least_resource_usage_with_weight(sorted(alive), alive, assignment, rng)
                kind = DecisionKind.TRANSFER if d.dst is not None else DecisionKind.UNLOAD
                decisions.append(
                    Decision(
                        now,
                        kind,
                        d.bundle,
                        d.src,
                        d.dst,
                        str(d.reason),
                        strategy,
                        result.avg,
                        result.std,
                        _load(alive, d.src),
                        _load(alive, d.dst),
                        throughput.get(d.bundle),
                    )
                )
                if d.dst is None and dst is not None:
                    decisions.append(
                        Decision(
                            now,
                            DecisionKind.ASSIGN,
                            d.bundle,
                            None,
                            dst,
                            "Lookup",
                            None,
                            result.avg,
                            result.std,
                            None,
                            _load(alive, dst),
                            throughput.get(d.bundle),
                        )
                    )
                if dst is not None:
                    st.owners[d.bundle] = dst
                st.unloaded_bundles[d.bundle] = now
                st.unloaded_brokers[d.src] = now
        owners = {b: st.owners[b] for b in step.bundles}
        yield StepOutcome(now, alive, owners, step.bundles, avg, std, tuple(decisions))


def _load(loads: Mapping[BrokerId, BrokerLoadData], broker: BrokerId | None) -> float | None:
    data = loads.get(broker) if broker is not None else None
    return None if data is None else data.weighted_max_ema


def _place_bundles(st: _State, step: TraceStep) -> list[Decision]:
    """Bundles that are new, or whose simulated owner is gone, go where the trace put them."""
    out: list[Decision] = []
    for bundle, sample in step.bundles.items():
        current = st.owners.get(bundle)
        if current is not None and current in step.brokers:
            continue
        st.owners[bundle] = sample.owner
        if current is None and not st.loads:
            continue  # the initial layout is not a decision
        reason = "Lookup" if current is None else "Orphan"
        out.append(
            Decision(
                step.ts_ms,
                DecisionKind.ASSIGN,
                bundle,
                current,
                sample.owner,
                reason,
                None,
                0.0,
                0.0,
                None,
                None,
                sample.throughput,
            )
        )
    return out


def _update_loads(st: _State, step: TraceStep) -> None:
    """Fold this step's simulated raw loads into the brokers' EMAs."""
    total_tput = sum(s.throughput for s in step.brokers.values())
    total_load = sum(s.max_usage for s in step.brokers.values())
    per_byte = total_load / total_tput if total_tput > 0 else 0.0
    extra: dict[BrokerId, float] = {b: 0.0 for b in step.brokers}
    counts: dict[BrokerId, int] = {b: 0 for b in step.brokers}
    for bundle, sample in step.bundles.items():
        owner = st.owners[bundle]
        counts[owner] += 1
        if owner != sample.owner:
            extra[owner] = extra.get(owner, 0.0) + sample.throughput
            extra[sample.owner] = extra.get(sample.owner, 0.0) - sample.throughput
    for broker, reported in step.brokers.items():
        tput = max(0.0, reported.throughput + extra[broker])
        raw = max(0.0, reported.max_usage + extra[broker] * per_byte)
        previous = st.loads.get(broker)
        bandwidth = ResourceUsage(100.0 * raw, 100.0)
        usage = BrokerUsage(
            cpu=ResourceUsage(80.0 * raw, 100.0),
            bandwidth_in=bandwidth,
            bandwidth_out=bandwidth,
            msg_throughput_in=tput / 2,
            msg_throughput_out=tput / 2,
            msg_rate_in=tput / 2 / MESSAGE_SIZE,
            msg_rate_out=tput / 2 / MESSAGE_SIZE,
            bundle_count=counts[broker],
        )
        st.loads[broker] = BrokerLoadData(
            broker=broker,
            usage=usage,
            max_resource_usage=raw,
            weighted_max_ema=ema(None if previous is None else previous.weighted_max_ema, raw),
            msg_throughput_ema=ema(None if previous is None else previous.msg_throughput_ema, tput),
            updated_at_ms=step.ts_ms,
        )


def _snapshot(st: _State, step: TraceStep, config: SheddingConfig, now: int) -> LoadSnapshot:
    top: dict[BrokerId, list[BundleLoad]] = {b: [] for b in step.brokers}
    for bundle, sample in step.bundles.items():
        top[st.owners[bundle]].append(
            BundleLoad(bundle, sample.throughput_in, sample.throughput_out)
        )
    horizon = now - max(config.bundle_grace_period_s, config.cooldown_s) * 1000
    _forget_before(st.unloaded_bundles, horizon)
    _forget_before(st.unloaded_brokers, horizon)
    return LoadSnapshot(
        brokers={b: st.loads[b] for b in step.brokers},
        top_bundles={b: tuple(sorted(v, key=lambda x: x.msg_throughput)) for b, v in top.items()},
        owners={b: st.owners[b] for b in step.bundles},
        recently_unloaded_bundles=dict(st.unloaded_bundles),
        recently_unloaded_brokers=dict(st.unloaded_brokers),
    )


def _forget_before(table: dict[_K, int], horizon: int) -> None:
    """Entries older than every window the strategies look at can never matter again."""
    for key in [k for k, at in table.items() if at < horizon]:
        del table[key]
