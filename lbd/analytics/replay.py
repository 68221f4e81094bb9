"""``lbd analytics replay``: a history replayed under other strategies and settings.

Each history becomes a :class:`~lbd.analytics.engine.Trace` (samples grouped into steps of
``step_s``; a broker's last sample in a step stands for it). The traces are broadcast, and one
Spark task runs each history x strategy x setting through :func:`~lbd.analytics.engine.simulate`.
Settings come from a grid over the shedding keys; keys a strategy does not read are left at their
defaults for it, so no setting is replayed twice.

Runs rank, best first: ending under the target std before ending over it (then lower final std);
then less time spent over target; fewer moves; fewer ping-pongs. Each strategy and setting is
then ranked over every history, and the first is the winner (:mod:`lbd.analytics.ranking`, which
writes ``DIR/ranking.csv``, ``DIR/runs.csv``, ``DIR/recommended.toml`` with the winner's
``[shedding]`` keys and the evidence, and ``DIR/replay.md``).
"""

from __future__ import annotations

import itertools
import time
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from lbd.analytics.engine import BrokerSample, BundleSample, Trace, TraceStep, simulate
from lbd.analytics.history_io import read_history
from lbd.analytics.progress import spark_progress
from lbd.analytics.ranking import AVG_SHEDDER_KEYS, RunResult, Standing, standings, write_results
from lbd.core.balance_metrics import episodes, ping_pongs
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.core.settings import SheddingConfig
from lbd.core.shedding import STRATEGIES
from lbd.history.schema import DecisionKind

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_GRID: Mapping[str, tuple[object, ...]] = {
    "target_std": (0.1, 0.15, 0.25),
    "hit_count_threshold": (0, 3),
    "max_brokers_per_cycle": (1, 3),
    "threshold_shedder_percentage": (5.0, 10.0, 20.0),
}
"""The settings tried when no ``--grid`` is given."""

_NOT_READ_BY: Mapping[str, frozenset[str]] = {
    "transfer_shedder": frozenset(
        {
            "threshold_shedder_percentage",
            "lower_boundary_shedding_enabled",
            "max_moves_per_broker",
            "min_throughput_threshold",
        }
    )
    | AVG_SHEDDER_KEYS,
    "threshold_shedder": frozenset(
        {
            "target_std",
            "hit_count_threshold",
            "transfer_enabled",
            "overloaded_threshold",
            "max_moves_per_broker",
        }
    )
    | AVG_SHEDDER_KEYS,
    "cluster_planner": frozenset(
        {
            "min_throughput_threshold",
            "threshold_shedder_percentage",
            "lower_boundary_shedding_enabled",
        }
    )
    | AVG_SHEDDER_KEYS,
    "avg_shedder": frozenset(
        {
            "target_std",
            "hit_count_threshold",
            "overloaded_threshold",
            "min_throughput_threshold",
            "threshold_shedder_percentage",
            "lower_boundary_shedding_enabled",
            "max_moves_per_broker",
        }
    ),
}
FINAL_STEPS = 10
"""The final std is the mean std over this many last steps."""


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Every run, ranked, and the files written."""

    ranking: tuple[RunResult, ...]
    """Every run, best first."""
    standings: tuple[Standing, ...]
    """Every strategy and setting over every history, best first: the first is the winner."""
    out: str
    seconds: float


def parse_grid(items: Sequence[str]) -> dict[str, tuple[object, ...]]:
    """``KEY=V1,V2`` flags over the shedding keys; InvalidInputError names a bad one."""
    hints = typing.get_type_hints(SheddingConfig)
    grid: dict[str, tuple[object, ...]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or key not in hints:
            accepted = ", ".join(SheddingConfig.field_names())
            raise InvalidInputError(
                f"--grid {item!r}: expected KEY=V1,V2 with KEY one of {accepted}"
            )
        parsed: list[object] = []
        for text in values.split(","):
            text = text.strip()
            try:
                if hints[key] is bool:
                    if text.lower() not in ("true", "false"):
                        raise ValueError(text)
                    parsed.append(text.lower() == "true")
                else:
                    parsed.append(hints[key](text))
            except ValueError:
                raise InvalidInputError(
                    f"--grid {key}: {text!r} is not a valid {hints[key].__name__}"
                ) from None
        grid[key] = tuple(parsed)
    for tried in grid.values():
        if not tried:
            raise InvalidInputError("--grid: every key needs at least one value")
    return grid


def settings_for(strategy: str, grid: Mapping[str, Sequence[object]]) -> list[dict[str, object]]:
    """The distinct settings of ``grid`` that matter to ``strategy``, each a valid config."""
    keys = sorted(k for k in grid if k not in _NOT_READ_BY.get(strategy, frozenset()))
    out: list[dict[str, object]] = []
    for values in itertools.product(*(grid[k] for k in keys)):
        setting = dict(zip(keys, values, strict=True))
        replace(SheddingConfig(), **setting)  # type: ignore[arg-type]  # validates
        out.append(setting)
    return out


def load_traces(spark: SparkSession, history: str, step_s: int) -> list[Trace]:
    """The history at ``history`` as one trace per cluster, in steps of ``step_s``.

    Two kinds of report are read as the leader reads them: a report without the raw throughput
    (a broker that reports only the EMAs) stands for its EMA, and a broker that reports less
    often than every step (its shortest gap between two reports) keeps its last report and
    bundles until that gap has passed, rather than leaving and coming back."""
    from pyspark.sql import functions as F

    h = read_history(spark, history)
    step_ms = step_s * 1000
    bucket = (F.floor(F.col("ts_ms") / step_ms) * step_ms).cast("long").alias("step")
    brokers = (
        h.broker_load.groupBy("cluster", bucket, "broker")
        .agg(
            F.max_by("max_usage", "ts_ms").alias("max_usage"),
            F.max_by(F.col("msg_throughput_in") + F.col("msg_throughput_out"), "ts_ms").alias(
                "throughput"
            ),
            F.max_by("load", "ts_ms").alias("load"),
            F.max_by("msg_throughput_ema", "ts_ms").alias("throughput_ema"),
        )
        .collect()
    )
    bundles = (
        h.bundle_load.groupBy("cluster", bucket, "bundle")
        .agg(
            F.max_by("broker", "ts_ms").alias("broker"),
            F.max_by("msg_throughput_in", "ts_ms").alias("tin"),
            F.max_by("msg_throughput_out", "ts_ms").alias("tout"),
        )
        .collect()
    )
    reports: dict[str, dict[int, dict[BrokerId, _Report]]] = {}
    for r in brokers:
        at = reports.setdefault(r["cluster"], {}).setdefault(r["step"], {})
        at[BrokerId(r["broker"])] = _Report(
            r["max_usage"], r["throughput"], r["load"], r["throughput_ema"]
        )
    for r in bundles:
        found = reports.get(r["cluster"], {}).get(r["step"], {}).get(BrokerId(r["broker"]))
        # A bundle whose reporter has no load sample in the step cannot be placed: left out.
        if found is not None:
            found.bundles[BundleId(r["bundle"])] = (r["tin"], r["tout"])
    traces = [
        Trace(history if len(reports) == 1 else f"{history}#{cluster}", cluster, _steps(steps))
        for cluster, steps in sorted(reports.items())
    ]
    if not any(t.steps and t.steps[0].bundles for t in traces):
        raise InvalidInputError(f"history {history}: no bundle load samples to replay")
    return traces


@dataclass(slots=True)
class _Report:
    """A broker's last report in one step, and the bundles it reported."""

    max_usage: float
    throughput: float
    load: float
    throughput_ema: float
    bundles: dict[BundleId, tuple[float, float]] = field(default_factory=dict)

    def sample(self, every_ms: int) -> BrokerSample:
        every_s = every_ms / 1000
        if self.throughput > 0 or not self.bundles:
            return BrokerSample(self.max_usage, self.throughput, report_every_s=every_s)
        # No raw sample in the report: its EMAs are all the leader knows.
        return BrokerSample(self.max_usage or self.load, self.throughput_ema, True, every_s)


def _steps(reports: Mapping[int, Mapping[BrokerId, _Report]]) -> tuple[TraceStep, ...]:
    """One cluster's steps, a late reporter's last report held for its usual gap."""
    seen: dict[BrokerId, list[int]] = {}
    for at in sorted(reports):
        for broker in reports[at]:
            seen.setdefault(broker, []).append(at)
    gap = {b: min((y - x for x, y in itertools.pairwise(ts)), default=0) for b, ts in seen.items()}
    last: dict[BrokerId, tuple[int, _Report]] = {}
    out = []
    for at in sorted(reports):
        fresh = reports[at]
        held = {b: r for b, (t, r) in last.items() if b not in fresh and at - t < gap[b]}
        last.update((b, (at, r)) for b, r in fresh.items())
        brokers = {b: r.sample(gap[b]) for b, r in {**held, **fresh}.items()}
        bundles: dict[BundleId, BundleSample] = {}
        for broker, report in [*held.items(), *fresh.items()]:  # a fresh report wins
            for bundle, (tin, tout) in report.bundles.items():
                bundles[bundle] = BundleSample(broker, tin, tout)
        out.append(TraceStep(at, brokers, bundles))
    return tuple(out)


def evaluate(
    trace: Trace,
    strategy: str,
    setting: Mapping[str, object],
    *,
    target_std: float,
    ping_pong_window_s: int,
    seed: int,
) -> RunResult:
    """Replay ``trace`` under one strategy and setting and measure the outcome."""
    config = replace(SheddingConfig(), **setting)  # type: ignore[arg-type]
    series: list[tuple[int, float]] = []
    moves: list[tuple[int, str, str | None, str | None]] = []
    shed = 0
    for o in simulate(trace.steps, strategy, config, seed=seed):
        series.append((o.ts_ms, o.std))
        for d in o.decisions:
            moves.append((d.ts_ms, d.bundle, d.src, d.dst))
            shed += d.kind in (DecisionKind.TRANSFER, DecisionKind.UNLOAD)
    eps = episodes(series, target_std)
    end_ms = series[-1][0] if series else 0
    over = sum(((e.end_ms or end_ms) - e.start_ms) / 1000 for e in eps)
    tail = [s for _, s in series[-FINAL_STEPS:]] or [0.0]
    final = sum(tail) / len(tail)
    return RunResult(
        history=trace.name,
        strategy=strategy,
        setting=dict(setting),
        final_std=final,
        seconds_over_target=over,
        episodes=len(eps),
        recovered=sum(1 for e in eps if e.end_ms is not None),
        moves=shed,
        ping_pongs=ping_pongs(moves, ping_pong_window_s * 1000),
        ends_under_target=final <= target_std,
    )


def run_replay(
    spark: SparkSession,
    histories: Sequence[str],
    out: str,
    *,
    grid: Mapping[str, Sequence[object]] | None = None,
    strategies: Sequence[str] = tuple(STRATEGIES),
    target_std: float = SheddingConfig().target_std,
    step_s: int = 60,
    ping_pong_window_s: int = 3600,
    seed: int = 1,
) -> ReplayResult:
    """Replay every history under every strategy and setting; write the ranking and the
    recommended config under the local directory ``out``."""
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise InvalidInputError(
            f"unknown strategy {', '.join(unknown)}; known: {', '.join(STRATEGIES)}"
        )
    if target_std <= 0:
        raise InvalidInputError(f"--target-std must be > 0, got {target_std:g}")
    started = time.monotonic()
    chosen = DEFAULT_GRID if grid is None else grid
    with spark_progress(spark, "replay"):
        traces = [t for h in histories for t in load_traces(spark, h, step_s)]
        jobs = [
            (i, strategy, setting)
            for i in range(len(traces))
            for strategy in strategies
            for setting in settings_for(strategy, chosen)
        ]
        shared = spark.sparkContext.broadcast(traces)

        def run(job: tuple[int, str, dict[str, object]]) -> RunResult:
            index, strategy, setting = job
            return evaluate(
                shared.value[index],
                strategy,
                setting,
                target_std=target_std,
                ping_pong_window_s=ping_pong_window_s,
                seed=seed,
            )

        results = spark.sparkContext.parallelize(jobs, len(jobs)).map(run).collect()
        shared.unpersist()
    ranking = tuple(sorted(results, key=RunResult.rank_key))
    ranked = standings(ranking)
    write_results(out, ranking, ranked, target_std)
    return ReplayResult(
        ranking=ranking, standings=ranked, out=out, seconds=time.monotonic() - started
    )
