"""Trace-driven cluster simulation: a load trace replayed under a shedding strategy of the core.

A :class:`Trace` is what a history says happened, step by step: which brokers were up, their raw
load and throughput, and every reported bundle's throughput and owner. :func:`simulate` replays
it under any strategy and settings. Bundle traffic and broker membership come from the trace;
ownership is the simulation's own: it starts as recorded, then changes only by the strategy's
decisions (a bundle whose simulated owner left, or that first appears, goes where the trace put
it). The replay runs on the one load model (:class:`~lbd.workload.model.LoadModel`): a broker's
simulated raw load is its recorded load plus the traffic of the bundles the simulation placed
differently, converted to load with the cluster's load-per-byte ratio of that step; the shedder
sees the EMA of that load, as the real leader sees the reporters' EMAs.

Plain unloads (``threshold_shedder``) are placed as the next lookup would place them, with the
core's ``select_broker``. The synthetic histories of ``lbd analytics synth``
are this simulation run with the default strategy over a generated demand trace.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace

from lbd.core.ids import BrokerId, BundleId
from lbd.core.load import BrokerLoadData
from lbd.core.settings import MB, SheddingConfig
from lbd.core.shedding import STRATEGIES, mean_and_std
from lbd.history.schema import DecisionKind
from lbd.workload.model import LoadModel, Move


@dataclass(frozen=True, slots=True)
class BrokerSample:
    """A broker's recorded raw load (max usage, 0..1+) and throughput (bytes/s in + out)."""

    max_usage: float
    throughput: float
    ema_only: bool = False
    """Its reports carry only the EMAs (the load and throughput above are its EMAs): the
    simulated broker reports the same way."""
    report_every_s: float = 0.0
    """It reports at most once in this many seconds: so does the simulated broker."""


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
    # Every reported bundle goes in the top-bundles report: the history holds only those.
    model = LoadModel({}, {}, seed=seed, top_count=None)
    for index, step in enumerate(steps):
        now = model.now_ms = step.ts_ms
        decisions = _follow_trace(model, step)
        model.report()
        alive = dict(model.loads)
        avg, std = mean_and_std(d.weighted_max_ema for d in alive.values())
        decisions = [
            replace(d, cluster_avg=avg, cluster_std=std, dst_load=_load(alive, d.dst))
            for d in decisions
        ]
        if alive and index % shed_every == 0:
            result = model.shed(strategy, config)
            stats = (result.avg, result.std)
            reasons = {d.bundle: str(d.reason) for d in result.decisions}
            for move in model.apply(result.decisions):
                kind = DecisionKind.UNLOAD if move.dst is None else DecisionKind.TRANSFER
                decisions.append(
                    decision_row(now, kind, move, reasons[move.bundle], strategy, stats, alive)
                )
            for move in model.place_orphans():
                decisions.append(
                    decision_row(now, DecisionKind.ASSIGN, move, "Lookup", None, stats, alive)
                )
        owners = {b: model.owners[b] for b in step.bundles}
        yield StepOutcome(now, alive, owners, step.bundles, avg, std, tuple(decisions))


def decision_row(
    now: int,
    kind: DecisionKind,
    move: Move,
    reason: str,
    strategy: str | None,
    stats: tuple[float, float],
    loads: Mapping[BrokerId, BrokerLoadData],
) -> Decision:
    """The decision recorded for ``move`` (an assignment names no source), with the loads of its
    brokers as ``loads`` last had them."""
    return Decision(
        now,
        kind,
        move.bundle,
        None if kind is DecisionKind.ASSIGN else move.src,
        move.dst,
        reason,
        strategy,
        stats[0],
        stats[1],
        None if kind is DecisionKind.ASSIGN else _load(loads, move.src),
        _load(loads, move.dst),
        move.throughput,
    )


def _load(loads: Mapping[BrokerId, BrokerLoadData], broker: BrokerId | None) -> float | None:
    data = loads.get(broker) if broker is not None else None
    return None if data is None else data.weighted_max_ema


def _follow_trace(model: LoadModel, step: TraceStep) -> list[Decision]:
    """Bring the model to the trace's step: its brokers (a broker that left takes its bundles
    with it), the bundles' traffic, and what each broker carries beside the bundles the model
    placed differently. Bundles that are new, or whose simulated owner is gone, go where the
    trace put them: those placements are the decisions returned."""
    orphaned: dict[BundleId, BrokerId] = {}
    for broker in [b for b in model.capacity if b not in step.brokers]:
        orphaned.update(dict.fromkeys(model.leave(broker), broker))
    # A broker's load is its recorded load, plus the traffic the model placed differently at
    # the cluster's load per byte of this step: its capacity is what makes that ratio, and its
    # background what its recorded load holds beside its recorded bundles.
    total_tput = sum(s.throughput for s in step.brokers.values())
    per_byte = sum(s.max_usage for s in step.brokers.values()) / total_tput if total_tput else 0.0
    recorded: dict[BrokerId, float] = dict.fromkeys(step.brokers, 0.0)
    for sample in step.bundles.values():
        recorded[sample.owner] += sample.throughput
    for broker, reported in step.brokers.items():
        model.join(broker, 1 / (2 * per_byte * MB) if per_byte else math.inf)
        if reported.ema_only:
            model.ema_only.add(broker)
        else:
            model.ema_only.discard(broker)
        model.report_every_s[broker] = reported.report_every_s
        model.background[broker] = reported.max_usage - recorded[broker] * per_byte
        model.background_throughput[broker] = reported.throughput - recorded[broker]
    model.traffic = {b: s.throughput for b, s in step.bundles.items()}
    out: list[Decision] = []
    first = not model.loads
    for bundle, sample in step.bundles.items():
        if bundle in model.owners:
            continue
        model.place(bundle, sample.owner)
        if first:
            continue  # the initial layout is not a decision
        src = orphaned.get(bundle)
        reason = "Lookup" if src is None else "Orphan"
        out.append(
            Decision(
                step.ts_ms,
                DecisionKind.ASSIGN,
                bundle,
                src,
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
